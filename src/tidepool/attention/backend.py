"""Attention backends: chosen once, when a model is built; models call the backend they are given.

    encoder backends (bidirectional, packed sequences, no KV cache), in order of preference
      cpu_kernel      tidepool's AVX-512 variable-length kernel (cpu_kernels.py, csrc/): the layers
                      run on the packed tokens, no buckets, no mask
      bucketed_sdpa   torch SDPA per bucket of similar lengths (torch_backend.py), on the padded
                      layout (metadata.pad_buckets); runs wherever torch runs
    Both take an optional relative position bias (relative_bias.py: MPNet's): the kernel reads it
    per head by key - query distance, SDPA gets it as a dense additive mask per bucket. Both
    take per-sequence key counts (metadata.key_lens): the kernel as an argument, SDPA in the
    buckets' key masks.
    decoder backends (causal, over the paged KV cache)
      paged_sdpa      torch SDPA per bucket of rows over gathered cache blocks (paged.py)

`select_encoder_backend(spec)` / `select_decoder_backend(spec)` return the first registered
backend whose `supports(spec)` holds. The loader (model_loader/registry.py, the transformers backend)
calls them once, after the weights reached their device and dtype, and hands the result to the
model (`set_attention_backend`); the CPU kernel is therefore built while the model loads, not
inside its first request. A CUDA backend (flash-attention varlen, paged decode) registers in front
of the SDPA ones and says in `supports` which specs it takes.

Selection of the CPU kernel (cpu_kernels.supports), worked example on an AVX-512 machine:

    TIDEPOOL_CPU_ATTENTION  device  dtype     head_dim  max positions  → backend
    auto (default)          cpu     float32   32        512            cpu_kernel
    auto                    cpu     float16   32        512            bucketed_sdpa
    auto                    cpu     float32   48        512            bucketed_sdpa
    auto                    cpu     float32   64        8192           bucketed_sdpa
    auto                    cuda    float32   64        512            bucketed_sdpa
    sdpa                    cpu     float32   32        512            bucketed_sdpa
    native                  cpu     float32   32        512            cpu_kernel, or an error

The kernel's products (AttentionSpec.matmul, cpu_kernels.MATMULS): "float32" FMAs (exact, the
default and the only choice for a float32 model), or "bf16" / "bf16x3" (on AMX-bf16 tiles; "bf16"
on vdpbf16ps where the CPU has avx512_bf16 and no AMX: cpu_kernels.products) for the
models that allow reduced precision: the loader asks (`attach_attention_backend(...,
reduced_precision=True)`, models/interfaces.py) for a bfloat16 model and for the int8 mode, and
gets `reduced_precision_matmul(dtype)`: TIDEPOOL_CPU_ATTENTION_MATMUL, else REDUCED_MATMUL.
Where the CPU has neither, the kernel keeps float32. One backend instance per mode.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from tidepool import envs
from tidepool.attention import cpu_decoder_ops, cpu_kernels, paged, torch_backend
from tidepool.attention.metadata import EncoderAttentionMetadata
from tidepool.attention.paged_metadata import GroupAttentionMetadata
from tidepool.attention.relative_bias import RelativePositionBias


@dataclass(frozen=True)
class AttentionSpec:
    """What a model's attention asks of a backend: the input of the selection."""

    device: torch.device
    """Where the model's weights (and so q, k, v) live."""
    dtype: torch.dtype
    """The model's compute dtype."""
    head_dim: int
    """Width of one attention head."""
    max_positions: int
    """The longest sequence the model can attend over (max_position_embeddings)."""
    matmul: str = "float32"
    """The precision the attention's two products may take (cpu_kernels.MATMULS): "float32"
    (exact), or "bf16" / "bf16x3" where the model allows reduced precision."""


REDUCED_MATMUL = {torch.bfloat16: "bf16", torch.float32: "bf16"}
"""The products of a model that allows reduced precision, by its dtype (float32: the int8
mode's activations). Measured in docs/performance.md ("AMX-bf16 products in the attention
kernel"): bf16 costs the int8 accuracy check nothing measurable and bf16x3 bought no speed."""


def reduced_precision_matmul(dtype: torch.dtype) -> str:
    """The attention products for a bfloat16 / int8 model: TIDEPOOL_CPU_ATTENTION_MATMUL unless
    "auto", else REDUCED_MATMUL."""
    chosen = envs.cpu_attention_matmul()
    return REDUCED_MATMUL.get(dtype, "float32") if chosen == "auto" else chosen


def with_reduced_precision(spec: AttentionSpec) -> AttentionSpec:
    """`spec` for a model that allows reduced-precision attention products."""
    return replace(spec, matmul=reduced_precision_matmul(spec.dtype))


# ----------------------------------------------------------------------------- encoders


class EncoderAttentionBackend(ABC):
    """Bidirectional attention inside each packed sequence of a step. Stateless: one instance
    serves every layer and every model. Every token of a sequence is a query; its keys are all
    its tokens, or its first meta.key_lens[i] when the metadata has key counts (metadata.py)."""

    name: ClassVar[str]
    packed_layout: ClassVar[bool]
    """True: the layers run on the packed tokens (the metadata as built); False: on the padded
    layout of metadata.pad_buckets, whose buckets are plain slices."""

    @classmethod
    @abstractmethod
    def supports(cls, spec: AttentionSpec) -> bool:
        """Whether this backend runs a model with `spec` here (may build a kernel: call once)."""

    @abstractmethod
    def attend(
        self,
        qkv: torch.Tensor,
        meta: EncoderAttentionMetadata,
        scale: float,
        bias: RelativePositionBias | None = None,
    ) -> torch.Tensor:
        """qkv: [num_rows, 3, num_heads, head_dim] → [num_rows, num_heads * head_dim]; `bias`
        (relative_bias.py) is added to the scaled scores by key - query distance."""

    @abstractmethod
    def attend_first_tokens(
        self,
        qkv: torch.Tensor,
        meta: EncoderAttentionMetadata,
        scale: float,
        bias: RelativePositionBias | None = None,
    ) -> torch.Tensor:
        """Queries at each sequence's first row only → [num_seqs, num_heads * head_dim]."""

    @abstractmethod
    def attend_heads(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: EncoderAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q: [num_rows, heads, D], k / v: [num_rows, kv_heads, D] (strided views, kv_heads
        dividing heads) → [num_rows, heads * D]. The transformers backend's layers call this."""

    def for_spec(self, spec: AttentionSpec) -> EncoderAttentionBackend:
        """The instance that runs `spec` (after `supports(spec)`): this one, unless the backend
        has one per option of the spec."""
        return self

    def __repr__(self) -> str:
        return f"<{self.name} attention>"


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


class BucketedSdpaBackend(EncoderAttentionBackend):
    name = "bucketed_sdpa"
    packed_layout = False

    @classmethod
    def supports(cls, spec: AttentionSpec) -> bool:
        return True  # torch ops on any device and dtype

    def attend(self, qkv, meta, scale, bias=None):
        return torch_backend.encoder_attention(qkv, meta, scale, bias)

    def attend_first_tokens(self, qkv, meta, scale, bias=None):
        return torch_backend.encoder_attention_first_tokens(qkv, meta, scale, bias)

    def attend_heads(self, q, k, v, meta, scale):
        return torch_backend.encoder_attention_heads(q, k, v, meta, scale)


CPU_KERNEL = CpuKernelBackend()
CPU_KERNEL_AMX = {matmul: CpuKernelBackend(matmul) for matmul in ("bf16", "bf16x3")}
BUCKETED_SDPA = BucketedSdpaBackend()

ENCODER_BACKENDS: dict[str, EncoderAttentionBackend] = {
    backend.name: backend for backend in (CPU_KERNEL, BUCKETED_SDPA)
}
"""Encoder backends by name, in order of preference (the last one supports every spec)."""


def select_encoder_backend(spec: AttentionSpec) -> EncoderAttentionBackend:
    """The first encoder backend (ENCODER_BACKENDS order) that supports `spec`."""
    for backend in ENCODER_BACKENDS.values():
        if backend.supports(spec):
            return backend.for_spec(spec)
    raise ValueError(f"no encoder attention backend supports {spec}")


# ----------------------------------------------------------------------------- decoders


class DecoderAttentionBackend(ABC):
    """Causal attention over the paged KV cache (metadata planned in paged_metadata.py)."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def supports(cls, spec: AttentionSpec) -> bool:
        """Whether this backend runs a model with `spec` here."""

    @abstractmethod
    def paged_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: GroupAttentionMetadata,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """query [T, Hq, D], key / value [T, Hkv, D] of this step's tokens → [T, Hq * D]; this
        step's K/V are written into `kv_cache` ([2, Hkv, num_blocks, block_size, D]) first."""

    def __repr__(self) -> str:
        return f"<{self.name} attention>"


class PagedSdpaBackend(DecoderAttentionBackend):
    name = "paged_sdpa"

    @classmethod
    def supports(cls, spec: AttentionSpec) -> bool:
        if spec.device.type == "cpu":
            cpu_decoder_ops.load()  # its KV-cache write: built now, not inside the first step
        return True  # torch ops on any device and dtype

    def paged_attention(self, query, key, value, kv_cache, meta, scale, softcap=None):
        return paged.paged_attention(query, key, value, kv_cache, meta, scale, softcap)


PAGED_SDPA = PagedSdpaBackend()

DECODER_BACKENDS: dict[str, DecoderAttentionBackend] = {PAGED_SDPA.name: PAGED_SDPA}
"""Decoder backends by name, in order of preference (the last one supports every spec)."""


def select_decoder_backend(spec: AttentionSpec) -> DecoderAttentionBackend:
    """The first decoder backend (DECODER_BACKENDS order) that supports `spec`."""
    for backend in DECODER_BACKENDS.values():
        if backend.supports(spec):
            return backend
    raise ValueError(f"no decoder attention backend supports {spec}")
