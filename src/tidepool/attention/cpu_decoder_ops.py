"""tidepool's CPU kernels for the decoders (csrc/cpu_decoder_ops.cpp): RMSNorm in one pass and
the per-head q / k RMSNorm (Qwen3) fused with RoPE into one pass over the QKV GEMM's output
(float32; the models call them, models/llama.py and layers/rmsnorm.py), and the paged KV-cache
write (any dtype; paged.py).

Why: on the Qwen3-Embedding-shaped body (benchmarks/decoder_embed.py) the torch forms of these
took ~15% of a pass (RoPE's broadcast multiplies over strided halves, the norm's four passes over
strided heads, index_put for the cache); figures in docs/performance.md, "Decoder pooling".
Loaded like attention/cpu_kernels.py (kernels/build.py: the installed build of these sources,
else built on first use, named by the source's hash); where the build fails or the CPU has no
AVX2 (the build is the best of AVX-512 / AVX2 + FMA the CPU and TIDEPOOL_CPU_ISA allow:
plain loops the compiler vectorises for the build's ISA), `load()` says why once and returns
None, and the callers keep their torch ops.
TIDEPOOL_CPU_ATTENTION=sdpa turns these kernels off too (one switch for tidepool's hand-written
CPU code), =native makes a failure an error.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from tidepool.attention import cpu_kernels
from tidepool.kernels import cpu_features, specs
from tidepool.kernels.build import build_or_fall_back, load_build

logger = logging.getLogger("tidepool")


_lock = threading.Lock()
_state: dict[str | None, Any] = {}


def _compile(isa: str) -> Any:
    build = specs.DECODER_OPS[isa]
    load_build(build)
    return getattr(torch.ops, build.namespace)


def load(isa: str | None = None) -> Any | None:
    """The op namespace of the chosen build (cpu_kernels.chosen_isa: the best the CPU and
    TIDEPOOL_CPU_ISA allow) or of `isa`'s (tests), built and loaded on first call; None where it
    cannot run."""
    if isa is None:
        isa = cpu_kernels.chosen_isa()
    elif not cpu_features.cpu_has(isa):
        isa = None
    if isa not in _state:
        with _lock:
            if isa not in _state:
                _state[isa] = build_or_fall_back(
                    _compile,
                    "cpu_decoder_ops.cpp",
                    "tidepool's CPU decoder kernels",
                    "torch ops",
                    isa,
                )
    return _state[isa]


def usable(tensor: torch.Tensor) -> bool:
    """Whether the kernels take this tensor's device and dtype (and are available). Builds them
    on first call: call at load time (process_weights_after_loading), not per step."""
    return tensor.device.type == "cpu" and tensor.dtype == torch.float32 and load() is not None


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """key, value [T, Hkv, D] → their slots of kv_cache (paged.write_kv's contract); False
    where the kernel does not apply (not CPU, not built): the caller writes with torch ops."""
    ops = load() if kv_cache.device.type == "cpu" else None
    if ops is None:
        return False
    ops.write_kv(kv_cache, key, value, slot_mapping)
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] (rows contiguous) → x / rms(x) * weight, [T, H] contiguous."""
    out = torch.empty(x.shape, dtype=x.dtype)
    ops = load()
    assert ops is not None, "check usable() first"
    ops.rms_norm(x, weight, eps, out)
    return out


def qk_norm_rope_(
    qk: torch.Tensor,
    num_q_heads: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """In place on qk [T, Hq + Hk, D] (q heads, then k heads; a view of the QKV output): each
    head RMSNorm-ed (when its weight is given) and rotated; cos / sin [T, rotary_dim // 2]
    float32. In place: a fresh [T, heads, D] output costs page faults at thousands of tokens."""
    ops = load()
    assert ops is not None, "check usable() first"
    ops.qk_norm_rope_(qk, num_q_heads, q_weight, k_weight, eps, cos, sin)
