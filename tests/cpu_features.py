"""What this CPU runs, as skip markers: a test of a path that depends on a CPU feature runs where
the machine takes that path and is skipped elsewhere, with the reason in the marker.

x86-64 machines this project meets: AMD Zen 3 (AVX2 + FMA only: the kernels' AVX2 builds, int8
runs oneDNN's GEMM on split 7-bit inputs), AMD Zen 4 (AVX-512 with VNNI and BF16, no AMX), Intel Sapphire Rapids and
later (AVX-512 + AMX-BF16 / AMX-INT8) and Intel without AMX (AVX-512 or AVX2 only).

    requires_avx512       the CPU has AVX-512 F/BW/DQ/VL (the kernels' AVX-512 builds, AMX)
    requires_cpu_kernel   tidepool's encoder attention kernel builds and loads here
    requires_amx_bf16     the kernel's AMX-bf16 modes run here (AMX-BF16 + AVX512-BF16, tiles granted)
    requires_int8_gemm    this torch has oneDNN's int8 linear (quantization="int8")
    requires_amx_int8     tidepool's AMX int8 GEMM builds and loads here

Each marker is evaluated once, at import (building a kernel is cached per machine). Reasons name
what is missing, so a skipped test says why on that machine (`pytest -rs`).
"""

from __future__ import annotations

import platform
from functools import cache

import pytest


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's flags, as the product reads them (tidepool.kernels.cpu_features)."""
    from tidepool.kernels import cpu_features

    return cpu_features.cpu_flags()


def _missing(*flags: str) -> str:
    """'' when the CPU has every flag, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU is {platform.machine()}, not x86-64"
    absent = [f for f in flags if f not in cpu_flags()]
    return f"the CPU lacks {', '.join(absent)}" if absent else ""


AVX512_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl")


def has_avx512() -> bool:
    return not _missing(*AVX512_FLAGS)


@cache
def cpu_kernel_available() -> bool:
    import torch

    from tidepool.attention import cpu_kernels

    return cpu_kernels.supports(torch.device("cpu"), torch.float32, 32)


@cache
def amx_bf16_available() -> bool:
    from tidepool.attention import cpu_kernels

    return cpu_kernels.amx_bf16_available()


@cache
def int8_gemm_available() -> bool:
    from tidepool.quantization.int8_linear import int8_gemm_available as available

    return available()


@cache
def amx_int8_available() -> bool:
    from tidepool.quantization import int8_ops

    return int8_gemm_available() and int8_ops.load_amx() is not None


def _kernel_reason() -> str:
    why = _missing("avx2", "fma")
    return (
        "tidepool's CPU attention kernel (AVX-512 or AVX2 + FMA builds) is off here "
        f"({why or 'its build failed or is disabled'}); the encoders run torch SDPA, which the "
        "same tests cover"
    )


requires_avx512 = pytest.mark.skipif(
    not has_avx512(), reason=f"needs AVX-512 ({_missing(*AVX512_FLAGS) or 'present'})"
)
requires_cpu_kernel = pytest.mark.skipif(not cpu_kernel_available(), reason=_kernel_reason())
requires_amx_bf16 = pytest.mark.skipif(
    not amx_bf16_available(),
    reason="the kernel's AMX-bf16 modes need AMX-BF16 and AVX512-BF16 "
    f"({_missing('amx_tile', 'amx_bf16', 'avx512_bf16') or 'kernel unavailable'}); "
    "elsewhere they run the float32 path, covered by the float32 cases",
)
requires_int8_gemm = pytest.mark.skipif(
    not int8_gemm_available(), reason="this torch build has no oneDNN int8 linear"
)
requires_amx_int8 = pytest.mark.skipif(
    not amx_int8_available(),
    reason="tidepool's AMX int8 GEMM needs AMX-INT8 and AVX-512 "
    f"({_missing('amx_tile', 'amx_int8', *AVX512_FLAGS) or 'its build failed'}); "
    "elsewhere int8 runs oneDNN's GEMM, covered by the int8 cases",
)


def describe() -> str:
    """One line for a test report: the flags that choose tidepool's CPU paths."""
    wanted = ("avx2", "fma", *AVX512_FLAGS, "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    have = [f for f in wanted if f in cpu_flags()]
    return f"{platform.machine()}: {' '.join(have) or 'none of ' + ' '.join(wanted)}"
