"""Every build of tidepool's C++ kernels (csrc/): its source, flags and name, as plain data.

Read by the loader at run time (kernels/build.py) and by the package build (setup.py, which
loads this file alone: it imports nothing of tidepool, nor torch). A build's name carries a
hash of its source, csrc/'s headers and its flags, so the module built when the package was
installed is loaded only while the sources are the ones it was built from; an edited source
gets a new name, which no prebuilt module has, and is built on first use (kernels/build.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "csrc"
PREBUILT_PACKAGE = "tidepool.kernels._prebuilt"
"""Where the package build puts the modules (one .so per kernel per ISA build)."""

ISA_CFLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma", "-DTP_ISA_AVX512"],
    "avx2": ["-mavx2", "-mfma", "-DTP_ISA_AVX2"],
}
"""Each ISA build's flags (csrc/cpu_simd.h's TP_ISA_AVX512 / TP_ISA_AVX2); every build also
gets BASE_CFLAGS."""
BASE_CFLAGS = ["-O3", "-std=c++17", "-fopenmp"]
AVX512_CFLAGS = [*BASE_CFLAGS, *ISA_CFLAGS["avx512"]]
"""The AVX-512 build's flags (the AMX int8 GEMM adds its own to these)."""
BUILD_ISAS = ("avx512", "avx2")
"""The ISA levels (kernels/cpu_features.py) the vector kernels are built for, best first."""
ATTENTION_MAX_SEQ_LEN = 2048
"""The encoder attention kernel's longest sequence (-DTIDEPOOL_MAX_SEQ_LEN;
attention/cpu_kernels.py's MAX_SEQ_LEN)."""


@dataclass(frozen=True)
class KernelBuild:
    """One build of one source: `prefix`_<hash> is its module's name."""

    source: str
    """The file under csrc/."""
    prefix: str
    cflags: tuple[str, ...]
    namespace: str
    """The torch.ops namespace its ops register in."""

    @property
    def path(self) -> Path:
        return CSRC / self.source

    @property
    def name(self) -> str:
        """`prefix`_<12 hex digits of sha256(source, csrc/*.h in name order, flags)>: the
        headers are part of every build's name (any source may include any of them)."""
        headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))
        digest = hashlib.sha256(self.path.read_bytes() + headers + " ".join(self.cflags).encode())
        return f"{self.prefix}_{digest.hexdigest()[:12]}"


def namespace(base: str, isa: str) -> str:
    """The op namespace of one ISA's build of a source: `base` for AVX-512 (the names the
    kernels always had), `base`_`isa` for the others, so that a process (the tests) can load
    several builds of one source side by side."""
    return base if isa == "avx512" else f"{base}_{isa}"


def isa_cflags(isa: str, base_namespace: str) -> list[str]:
    """The flags of `isa`'s build of a source whose op namespace is `base_namespace`."""
    return [*BASE_CFLAGS, *ISA_CFLAGS[isa], f"-DTP_NS={namespace(base_namespace, isa)}"]


def _per_isa(source: str, prefix: str, base: str, extra: tuple[str, ...] = ()) -> dict:
    return {
        isa: KernelBuild(
            source, f"{prefix}_{isa}", (*isa_cflags(isa, base), *extra), namespace(base, isa)
        )
        for isa in BUILD_ISAS
    }


ENCODER_ATTENTION = _per_isa(
    "cpu_encoder_attention.cpp",
    "tidepool_cpu_ops",
    "tidepool_cpu",
    (f"-DTIDEPOOL_MAX_SEQ_LEN={ATTENTION_MAX_SEQ_LEN}",),
)
"""ISA → the encoder attention kernel's build (attention/cpu_kernels.py)."""
DECODER_OPS = _per_isa("cpu_decoder_ops.cpp", "tidepool_decoder_ops", "tidepool_decoder")
"""ISA → the decoders' element-wise kernels' build (attention/cpu_decoder_ops.py)."""
INT8_OPS = _per_isa("cpu_int8_ops.cpp", "tidepool_int8_ops", "tidepool_int8")
"""ISA → the int8 quantizer / epilogue kernels' build (quantization/int8_ops.py)."""
PAGED_DECODE = _per_isa("cpu_paged_decode.cpp", "tidepool_paged_decode", "tidepool_paged")
"""ISA → the paged decode kernel's build (attention/cpu_paged_decode.py)."""
INT8_AMX_GEMM = KernelBuild(
    "cpu_int8_gemm.cpp",
    "tidepool_int8_gemm",
    (*AVX512_CFLAGS, "-mamx-tile", "-mamx-int8"),
    "tidepool_int8_amx",
)
"""The AMX int8 GEMM (quantization/int8_ops.py): one build, run where the CPU has AMX."""
INT8_VNNI_GEMM = {
    isa: KernelBuild(
        "cpu_int8_vnni.cpp",
        f"tidepool_int8_vnni_{isa}",
        (*BASE_CFLAGS, *ISA_CFLAGS[base], flag, f"-DTP_NS=tidepool_int8_vnni_{isa}"),
        f"tidepool_int8_vnni_{isa}",
    )
    for isa, base, flag in (
        ("avx512_vnni", "avx512", "-mavx512vnni"),
        ("avx2_vnni", "avx2", "-mavxvnni"),
    )
}
"""ISA → the VNNI int8 GEMM's build (quantization/int8_ops.py): AVX-512 VNNI and the 256-bit
AVX-VNNI, one source."""


def all_builds() -> list[KernelBuild]:
    """Every build the package build makes."""
    return [
        *ENCODER_ATTENTION.values(),
        *DECODER_OPS.values(),
        *INT8_OPS.values(),
        *PAGED_DECODE.values(),
        INT8_AMX_GEMM,
        *INT8_VNNI_GEMM.values(),
    ]
