"""What this CPU's instruction sets are, read once, and the ISA level tidepool's kernels may use.

The one reader of /proc/cpuinfo for the kernels (attention/cpu_kernels.py, cpu_decoder_ops.py,
quantization/int8_ops.py) and the benchmarks. Levels, in order (as oneDNN's ISA ladder):

    level         the CPU needs                                       who uses it
    avx2          avx2, fma                                           AVX2 builds of the kernels
    avx2_vnni     + avx_vnni (256-bit VNNI of client CPUs)            (a VNNI GEMM, issue 27)
    avx512        avx2, fma, avx512f, avx512bw, avx512dq, avx512vl    AVX-512 builds
    avx512_vnni   + avx512_vnni                                       (a VNNI GEMM, issue 27)
    avx512_bf16   + avx512_bf16                                       (vdpbf16ps, issue 27)
    amx           + amx_tile, amx_int8, amx_bf16                      the AMX int8 GEMM, AMX-bf16

A level is usable where the CPU has its flags and it is not above the cap, TIDEPOOL_CPU_ISA
(envs.cpu_isa: one of the levels, or "auto" for none), as ONEDNN_MAX_CPU_ISA caps oneDNN's:
TIDEPOOL_CPU_ISA=avx2 runs the AVX2 builds on an AVX-512 machine. A level is not implied by a
higher one: avx2_vnni is not usable on an AVX-512 CPU without avx_vnni (Skylake-X), whatever the
cap. Worked example, this project's AMD EPYC (Zen 3: avx2, fma, no AVX-512), no cap: usable
"avx2" only; each kernel takes its AVX2 build. The cap covers tidepool's own kernels only;
torch's oneDNN reads its own ONEDNN_MAX_CPU_ISA.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

from tidepool import envs

FLAGS = (
    "avx2",
    "fma",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512dq",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)
"""The /proc/cpuinfo flags that decide tidepool's kernel paths (and oneDNN's GEMM paths)."""

_AVX512 = ("avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl")
LEVELS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx2", "fma"),
    "avx2_vnni": ("avx2", "fma", "avx_vnni"),
    "avx512": _AVX512,
    "avx512_vnni": (*_AVX512, "avx512_vnni"),
    "avx512_bf16": (*_AVX512, "avx512_vnni", "avx512_bf16"),
    "amx": (*_AVX512, "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"),
}
"""Each ISA level (ascending) → the CPU flags it needs."""


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where it cannot be read): read once."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block ends
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's flags among FLAGS (empty off x86-64 or where /proc/cpuinfo cannot be read)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    return frozenset(_cpuinfo().get("flags", "").split()) & frozenset(FLAGS)


@functools.cache
def cpu_model() -> str:
    """The CPU's model name ("unknown" where /proc/cpuinfo does not say)."""
    return _cpuinfo().get("model name") or platform.processor() or "unknown"


def cpu_has(level: str) -> bool:
    """Whether the CPU has `level`'s flags, ignoring the cap (tests: which builds can run)."""
    return set(LEVELS[level]) <= cpu_flags()


@functools.cache
def cap() -> str | None:
    """The highest level the kernels may use (TIDEPOOL_CPU_ISA; read once), None for no cap."""
    value = envs.cpu_isa()
    return None if value == "auto" else value


def reset() -> None:
    """Read TIDEPOOL_CPU_ISA again on next use (tests that switch it)."""
    cap.cache_clear()


def usable(level: str) -> bool:
    """Whether a kernel may use `level` here: the CPU has it and it is not above the cap."""
    limit = cap()
    order = list(LEVELS)
    return cpu_has(level) and (limit is None or order.index(level) <= order.index(limit))


def why_not(level: str) -> str:
    """Why `level` is not usable, in words ("" where it is)."""
    if not cpu_flags():
        return f"the CPU ({platform.machine()}) shows no x86-64 instruction sets"
    missing = [f for f in LEVELS[level] if f not in cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if not usable(level):
        return f"TIDEPOOL_CPU_ISA={cap()} caps the kernels below {level}"
    return ""


def best(levels: tuple[str, ...]) -> str | None:
    """The first of `levels` (a kernel's builds, best first) usable here, else None."""
    return next((level for level in levels if usable(level)), None)


def describe() -> str:
    """One line for logs and benchmarks: the model, the flags of FLAGS it has, the cap."""
    have = " ".join(f for f in FLAGS if f in cpu_flags()) or "none of " + " ".join(FLAGS)
    lacks = " ".join(f for f in FLAGS if f not in cpu_flags())
    cap_text = f"; TIDEPOOL_CPU_ISA={cap()}" if cap() else ""
    return f"{cpu_model()}: {have}" + (f" (no {lacks})" if lacks else "") + cap_text
