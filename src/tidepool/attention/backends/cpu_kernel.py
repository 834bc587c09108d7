"""The `cpu_kernel` encoder backend: tidepool's AVX-512 variable-length kernel (cpu_kernels.py,
csrc/). The layers run on the packed tokens, no buckets, no mask; the kernel reads each
sequence's start, length and key count (`KernelMetadata`, built by `KernelBuilder`).

The layers the kernel cannot take run torch SDPA over buckets of the packed tokens
(torch_backend.py): a head width it was not built for (attend_heads) and a band or causal mask
(attend_banded: sliding-window layers past their window, a causal text tower). Those buckets
are the metadata's `packed_buckets`, built on the first such call of a step, so a step that
never falls back builds none.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from tidepool.attention import cpu_kernels, torch_backend
from tidepool.attention.abstract import (
    BANDED,
    PACKED_BUCKETS,
    AttentionSpec,
    EncoderAttentionBackend,
)
from tidepool.attention.common import AttentionMetadataBuilder, CommonAttentionMetadata, LayerRows
from tidepool.attention.metadata import EncoderAttentionMetadata, build_buckets
from tidepool.attention.relative_bias import RelativePositionBias


@dataclass(frozen=True)
class KernelMetadata:
    """The kernel's step: per sequence its start, length and key count, on the device."""

    num_tokens: int
    seq_lens: list[int]
    cu_seqlens: torch.Tensor
    """[num_seqs + 1] int64: sequence i is flat tokens cu_seqlens[i]:cu_seqlens[i+1]."""
    seq_lens_tensor: torch.Tensor
    """[num_seqs] int64."""
    key_lens_tensor: torch.Tensor | None
    """[num_seqs] int64 keys per sequence; None: every token of every sequence is a key."""
    rows: LayerRows
    """The packed tokens (the layers' rows)."""
    step: CommonAttentionMetadata
    """The runner's description, kept for the fallbacks' buckets."""

    @cached_property
    def packed_buckets(self) -> EncoderAttentionMetadata:
        """Buckets of similar lengths over the packed tokens (metadata.build_encoder_metadata),
        for the layers that fall back to SDPA; built on first use."""
        return build_buckets(self.step)


class KernelBuilder(AttentionMetadataBuilder[KernelMetadata]):
    def build(self, common: CommonAttentionMetadata) -> KernelMetadata:
        device, seq_lens, key_lens = common.device, common.seq_lens, common.key_lens
        cu_seqlens = common.query_start_loc.to(device)
        keys = None
        if key_lens is not None and any(k != n for k, n in zip(key_lens, seq_lens, strict=True)):
            keys = torch.tensor(key_lens, dtype=torch.int64, device=device)
        return KernelMetadata(
            common.num_tokens,
            list(seq_lens),
            cu_seqlens,
            torch.tensor(seq_lens, dtype=torch.int64, device=device),
            keys,
            LayerRows.packed(cu_seqlens),
            common,
        )


KERNEL_BUILDER = KernelBuilder()


class CpuKernelBackend(EncoderAttentionBackend):
    name = "cpu_kernel"
    provides = frozenset({BANDED, PACKED_BUCKETS})

    def __init__(self, matmul: str = "float32") -> None:
        self.matmul = matmul
        """The kernel's products (cpu_kernels.MATMULS)."""

    @classmethod
    def supports(cls, spec: AttentionSpec) -> bool:
        return cpu_kernels.supports(spec.device, spec.dtype, spec.head_dim, spec.max_positions)

    def for_spec(self, spec: AttentionSpec) -> EncoderAttentionBackend:
        if cpu_kernels.products(spec.matmul) == "float32":
            return CPU_KERNEL
        return CPU_KERNEL_AMX[spec.matmul]

    def metadata_builder(self) -> KernelBuilder:
        return KERNEL_BUILDER

    def attend(self, qkv, meta, scale, bias=None):
        q, k, v = qkv.unbind(1)
        return _kernel(q, k, v, meta, scale, bias=bias, matmul=self.matmul)

    def attend_first_tokens(self, qkv, meta, scale, bias=None):
        q, k, v = qkv.unbind(1)
        return _kernel(q, k, v, meta, scale, True, bias, self.matmul)

    def attend_heads(self, q, k, v, meta, scale):
        if q.shape[2] not in cpu_kernels.HEAD_DIMS:
            # A layer whose heads differ from the config's (the spec saw those): packed buckets.
            return torch_backend.encoder_attention_heads(q, k, v, meta.packed_buckets, scale)
        return _kernel(q, k, v, meta, scale, matmul=self.matmul)

    def attend_banded(self, q, k, v, meta, scale, window, causal=False):
        buckets = meta.packed_buckets
        return torch_backend.encoder_attention_heads(
            q, k, v, buckets, scale, window, buckets.band_masks, causal
        )

    def __repr__(self) -> str:
        path = cpu_kernels.products(self.matmul)
        suffix = "" if path == "float32" else f" ({self.matmul} on {path})"
        return f"<{self.name} attention{suffix}>"


def _kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: KernelMetadata,
    scale: float,
    first_token_only: bool = False,
    bias: RelativePositionBias | None = None,
    matmul: str = "float32",
) -> torch.Tensor:
    """The kernel over the packed sequences of `meta`, with their key counts."""
    starts, lens, keys = meta.cu_seqlens[:-1], meta.seq_lens_tensor, meta.key_lens_tensor
    return cpu_kernels.encoder_attention(
        q, k, v, starts, lens, scale, first_token_only, bias, key_lens=keys, matmul=matmul
    )


CPU_KERNEL = CpuKernelBackend()
CPU_KERNEL_AMX = {matmul: CpuKernelBackend(matmul) for matmul in ("bf16", "bf16x3")}
