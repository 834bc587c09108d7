"""tidepool's CPU kernels around the int8 GEMM (csrc/cpu_int8_ops.cpp): the per-token
quantization of a GEMM's input and the epilogue of its float32 output (per-token scale, bias,
zero-point correction, activation, multiply / residual, optionally LayerNorm), each one pass over
a row while it sits in L1.

Why: the same work as torch ops took ~63% of an int8 pass (three to four passes over each
input to quantize it, two to three over each output; profile in docs/performance.md, "int8"),
several times the GEMM itself. Loaded like the attention kernels (kernels/build.py: the
installed build of these sources, else built on first use), for AVX-512 or AVX2 + FMA (BUILD_ISAS, one
source: csrc/cpu_simd.h; chosen once by kernels/cpu_features.py, capped by TIDEPOOL_CPU_ISA);
where the build fails or the CPU has neither, `load()` says why once and returns None, and
`Int8Linear` keeps its torch ops. The AMX GEMM (load_amx) needs the "amx" level.
TIDEPOOL_CPU_ATTENTION=sdpa turns these off too (one switch for tidepool's hand-written CPU
code), =native makes a failure an error.
"""

from __future__ import annotations

import threading

import torch

from tidepool.kernels import cpu_features, specs
from tidepool.kernels.build import build_or_fall_back, load_build

BUILD_ISAS = specs.BUILD_ISAS
"""The ISA levels the quantizer / epilogue kernels are built for, best first."""
ACTIVATION_CODES = {None: 0, "gelu": 1, "relu": 2}
"""The activations the epilogue applies itself (the kernel's codes); others run as torch ops."""

_lock = threading.Lock()
_state: dict[str, object] = {}


def _compile(isa: str) -> object:
    build = specs.INT8_OPS[isa]
    load_build(build)
    return getattr(torch.ops, build.namespace)


def chosen_isa() -> str | None:
    """The build the int8 linears run: the best of BUILD_ISAS the CPU and TIDEPOOL_CPU_ISA
    allow (cpu_features.usable), None where none is."""
    return cpu_features.best(BUILD_ISAS)


def load(isa: str | None = None) -> object | None:
    """The op namespace of the chosen build (chosen_isa) or of `isa`'s (tests), built and
    loaded on first call; None where it cannot run. Call at load time (Int8Linear's
    constructor), not per step."""
    if isa is None:
        isa = chosen_isa()
    elif not cpu_features.cpu_has(isa):
        isa = None
    if isa not in _state:
        with _lock:
            if isa not in _state:
                _state[isa] = build_or_fall_back(
                    _compile, "cpu_int8_ops.cpp", "tidepool's int8 CPU kernels", "torch ops", isa
                )
    return _state[isa]


def quantize_rows(
    x: torch.Tensor, smoothing: torch.Tensor | None, asym: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K] float32 (rows contiguous) → (q [T, K] int8 or uint8 (`asym`), scale [T, 1],
    scale · zero point [T, 1]; zeros when symmetric)."""
    rows = x.shape[0]
    q = torch.empty(x.shape, dtype=torch.uint8 if asym else torch.int8)
    scale = torch.empty(rows, 1)
    scaled_zero = torch.empty(rows, 1)
    load().quantize_rows(x, smoothing, asym, q, scale, scaled_zero)
    return q, scale, scaled_zero


def _compile_amx(isa: str) -> object:
    load_build(specs.INT8_AMX_GEMM)
    ops = torch.ops.tidepool_int8_amx
    return ops if ops.available() else None


def load_amx() -> object | None:
    """The `tidepool_int8_amx` namespace (the AMX GEMM with its epilogue in the tile loop,
    csrc/cpu_int8_gemm.cpp) where the CPU has AMX-INT8 and the build works, else None (then
    Int8Linear runs oneDNN's GEMM and the epilogue kernels)."""
    if "amx_gemm" not in _state:
        epilogues = load()  # first: it takes the same lock
        with _lock:
            if "amx_gemm" not in _state:
                ops = None
                if epilogues is not None and cpu_features.usable("amx"):
                    ops = build_or_fall_back(
                        _compile_amx, specs.INT8_AMX_GEMM.source, "tidepool's AMX int8 GEMM",
                        "oneDNN's int8 GEMM", "amx",
                    )  # fmt: skip
                _state["amx_gemm"] = ops
    return _state["amx_gemm"]


def pack_weight(weight_q: torch.Tensor) -> torch.Tensor:
    """weight [N, K] int8 → the AMX GEMM's tile layout [N/16, K/64, 16, 64]: tile (nb, kb) is
    16 rows, row r holding W[nb·16 + j, kb·64 + 4r + i] at byte 4j + i (the VNNI order)."""
    n, k = weight_q.shape
    tiles = weight_q.reshape(n // 16, 16, k // 64, 16, 4)  # [nb, j, kb, r, i]
    return tiles.permute(0, 2, 3, 1, 4).reshape(n // 16, k // 64, 16, 64).contiguous()


VNNI_ISAS = tuple(specs.INT8_VNNI_GEMM)
"""The VNNI GEMM's builds (csrc/cpu_int8_vnni.cpp), best first: AVX-512 VNNI (vpdpbusd on
zmm) and the 256-bit AVX-VNNI of client CPUs; one source, the ISA a compile parameter."""


def _compile_vnni(isa: str) -> object:
    build = specs.INT8_VNNI_GEMM[isa]
    load_build(build)
    return getattr(torch.ops, build.namespace)


def vnni_isa() -> str | None:
    """The VNNI GEMM's build the int8 linears run: the best of VNNI_ISAS the CPU and
    TIDEPOOL_CPU_ISA allow, None where none is (then oneDNN's GEMM)."""
    return cpu_features.best(VNNI_ISAS)


def load_vnni(isa: str | None = None) -> object | None:
    """The op namespace of the chosen VNNI build (vnni_isa), or of `isa`'s (tests: every build
    the CPU can run, whatever the cap), built and loaded on first call; None where it cannot
    run or the epilogue kernels are off. Call at load time, not per step."""
    if isa is None:
        isa = vnni_isa()
    elif not cpu_features.cpu_has(isa):
        isa = None
    key = f"vnni_{isa}"
    if key not in _state:
        epilogues = load()  # first: it takes the same lock
        with _lock:
            if key not in _state:
                ops = None
                if epilogues is not None and isa is not None:
                    ops = build_or_fall_back(
                        _compile_vnni, specs.INT8_VNNI_GEMM[isa].source, f"tidepool's VNNI int8 GEMM ({isa})",
                        "oneDNN's int8 GEMM", isa,
                    )  # fmt: skip
                _state[key] = ops
    return _state[key]


def pack_weight_vnni(weight_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] int8 (N % 16, K % 4) → (the VNNI GEMM's layout [N/16, K/4, 16, 4]: for 16
    columns and each k-quad, 4 consecutive k of each column; 128 · Σ_k W_nk [N] int32, taken off
    the sums of symmetric inputs, which the GEMM reads as q + 128)."""
    n, k = weight_q.shape
    packed = weight_q.reshape(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    comp = weight_q.sum(dim=1, dtype=torch.int32).mul_(128)
    return packed, comp
