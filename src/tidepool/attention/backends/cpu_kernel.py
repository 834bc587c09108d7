"""The `cpu_kernel` encoder backend: tidepool's AVX-512 variable-length kernel (cpu_kernels.py,
csrc/). The layers run on the packed tokens, no buckets, no mask; the kernel reads each
sequence's start, length and key count."""

from __future__ import annotations

import torch

from tidepool.attention import cpu_kernels, torch_backend
from tidepool.attention.abstract import AttentionSpec, EncoderAttentionBackend
from tidepool.attention.metadata import ENCODER_BUCKETS, EncoderAttentionMetadata
from tidepool.attention.relative_bias import RelativePositionBias


class CpuKernelBackend(EncoderAttentionBackend):
    name = "cpu_kernel"
    packed_layout = True

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

    def metadata_builder(self):
        return ENCODER_BUCKETS

    def attend(self, qkv, meta, scale, bias=None):
        q, k, v = qkv.unbind(1)
        return _kernel(q, k, v, meta, scale, bias=bias, matmul=self.matmul)

    def attend_first_tokens(self, qkv, meta, scale, bias=None):
        q, k, v = qkv.unbind(1)
        return _kernel(q, k, v, meta, scale, True, bias, self.matmul)

    def attend_heads(self, q, k, v, meta, scale):
        if q.shape[2] not in cpu_kernels.HEAD_DIMS:
            # A layer whose heads differ from the config's (the spec saw those): packed buckets.
            return torch_backend.encoder_attention_heads(q, k, v, meta, scale)
        return _kernel(q, k, v, meta, scale, matmul=self.matmul)

    def __repr__(self) -> str:
        path = cpu_kernels.products(self.matmul)
        suffix = "" if path == "float32" else f" ({self.matmul} on {path})"
        return f"<{self.name} attention{suffix}>"


def _kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: EncoderAttentionMetadata,
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
