"""The attention backend registry: chosen once, when a model is built; models call the backend
they are given. What a backend is: abstract.py; its step metadata: common.py (the runner's
neutral description) → the backend's builder → its metadata. One module per backend
(backends/), one entry here (or `register_encoder_backend` / `register_decoder_backend`).

    encoder backends (bidirectional, packed sequences, no KV cache), in order of preference
      cpu_kernel      tidepool's AVX-512 variable-length kernel (backends/cpu_kernel.py): the layers
                      run on the packed tokens, no buckets, no mask; provides banded, packed_buckets
      bucketed_sdpa   torch SDPA per bucket of similar lengths (backends/bucketed_sdpa.py), the
                      layers on padded slots (metadata.pad_buckets); runs wherever torch runs;
                      provides banded, packed_buckets, padded_buckets
    Both take an optional relative position bias (relative_bias.py: MPNet's): the kernel reads it
    per head by key - query distance, SDPA gets it as a dense additive mask per bucket. Both
    take per-sequence key counts (metadata.key_lens): the kernel as an argument, SDPA in the
    buckets' key masks.
    decoder backends (causal, over the paged KV cache)
      paged_sdpa      torch SDPA per bucket of rows over gathered cache blocks, and the CPU
                      in-place decode kernel for short rows (backends/paged_sdpa.py)

`select_encoder_backend(spec)` / `select_decoder_backend(spec)` return the first registered
backend whose `supports(spec)` holds and that provides what the spec `needs` (abstract.py's
capabilities: DeBERTa needs padded_buckets, so it takes bucketed_sdpa; none left: the load is
refused naming the model and the backends); `check_provides` refuses a backend handed over by
other means. The loader (model_loader/registry.py, the transformers backend)
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

from tidepool.attention.abstract import (
    BANDED,
    CAPABILITIES,
    PACKED_BUCKETS,
    PADDED_BUCKETS,
    REDUCED_MATMUL,
    AttentionSpec,
    DecoderAttentionBackend,
    DecoderStepMetadata,
    EncoderAttentionBackend,
    EncoderStepMetadata,
    reduced_precision_matmul,
    with_reduced_precision,
)
from tidepool.attention.backends.bucketed_sdpa import BUCKETED_SDPA, BucketedSdpaBackend
from tidepool.attention.backends.cpu_kernel import CPU_KERNEL, CPU_KERNEL_AMX, CpuKernelBackend
from tidepool.attention.backends.paged_sdpa import PAGED_SDPA, PagedSdpaBackend

__all__ = [
    "BANDED",
    "BUCKETED_SDPA",
    "CAPABILITIES",
    "PACKED_BUCKETS",
    "PADDED_BUCKETS",
    "CPU_KERNEL",
    "CPU_KERNEL_AMX",
    "DECODER_BACKENDS",
    "ENCODER_BACKENDS",
    "PAGED_SDPA",
    "REDUCED_MATMUL",
    "AttentionSpec",
    "BucketedSdpaBackend",
    "CpuKernelBackend",
    "DecoderAttentionBackend",
    "DecoderStepMetadata",
    "EncoderAttentionBackend",
    "EncoderStepMetadata",
    "PagedSdpaBackend",
    "check_provides",
    "reduced_precision_matmul",
    "register_decoder_backend",
    "register_encoder_backend",
    "select_decoder_backend",
    "select_encoder_backend",
    "with_reduced_precision",
]

ENCODER_BACKENDS: dict[str, EncoderAttentionBackend] = {
    backend.name: backend for backend in (CPU_KERNEL, BUCKETED_SDPA)
}
"""Encoder backends by name, in order of preference (the last one supports every spec)."""

DECODER_BACKENDS: dict[str, DecoderAttentionBackend] = {PAGED_SDPA.name: PAGED_SDPA}
"""Decoder backends by name, in order of preference (the last one supports every spec)."""


def register_encoder_backend(backend: EncoderAttentionBackend, first: bool = True) -> None:
    """Add `backend` to the encoder registry, in front of the others (`first`) or last."""
    _register(ENCODER_BACKENDS, backend, first)


def register_decoder_backend(backend: DecoderAttentionBackend, first: bool = True) -> None:
    """Add `backend` to the decoder registry, in front of the others (`first`) or last."""
    _register(DECODER_BACKENDS, backend, first)


def _register(registry: dict, backend, first: bool) -> None:
    if backend.name in registry:
        raise ValueError(f"an attention backend named {backend.name!r} is already registered")
    entries = [(backend.name, backend), *registry.items()]
    if not first:
        entries = [*registry.items(), (backend.name, backend)]
    registry.clear()
    registry.update(entries)


def missing_capabilities(backend: object, spec: AttentionSpec) -> list[str]:
    """What `spec` needs that `backend` does not provide (decoder backends provide none)."""
    return sorted(spec.needs - getattr(backend, "provides", frozenset()))


def check_provides(backend: object, spec: AttentionSpec, model_name: str) -> None:
    """Refuse `backend` for a model whose attention spec needs what it does not provide."""
    missing = missing_capabilities(backend, spec)
    if missing:
        name = getattr(backend, "name", type(backend).__name__)
        raise ValueError(
            f"{model_name} needs attention {', '.join(missing)}, which backend {name!r} does "
            f"not provide (attention/abstract.py); backends that do: {_providers(spec)}"
        )


def _providers(spec: AttentionSpec) -> str:
    names = [n for n, b in ENCODER_BACKENDS.items() if not missing_capabilities(b, spec)]
    return ", ".join(names) or "none registered"


def select_encoder_backend(
    spec: AttentionSpec, model_name: str = "the model"
) -> EncoderAttentionBackend:
    """The first encoder backend (ENCODER_BACKENDS order) that supports `spec` and provides
    what it needs."""
    for backend in ENCODER_BACKENDS.values():
        if not missing_capabilities(backend, spec) and backend.supports(spec):
            return backend.for_spec(spec)
    if spec.needs:
        raise ValueError(
            f"no encoder attention backend both supports {spec} and provides what "
            f"{model_name} needs ({', '.join(sorted(spec.needs))}); registered: "
            f"{', '.join(ENCODER_BACKENDS)}"
        )
    raise ValueError(f"no encoder attention backend supports {spec}")


def select_decoder_backend(spec: AttentionSpec) -> DecoderAttentionBackend:
    """The first decoder backend (DECODER_BACKENDS order) that supports `spec`."""
    if spec.needs:
        raise ValueError(f"decoder attention backends provide none of {sorted(spec.needs)}")
    for backend in DECODER_BACKENDS.values():
        if backend.supports(spec):
            return backend
    raise ValueError(f"no decoder attention backend supports {spec}")
