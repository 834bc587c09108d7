"""tidepool's CPU attention kernel (csrc/), loaded by kernels/build.py: the package's build when
it was installed from these sources, else built on first use.

`encoder_attention` (csrc/cpu_encoder_attention.cpp) is bidirectional attention over packed,
variable-length sequences: no padding, no mask, each (sequence, head) one task for a thread,
float32 arithmetic on float32 or bfloat16 inputs, head_dim 32, 64 or 128, with an optional
relative position bias read per head by key - query distance (MPNet), and optional key counts
per sequence (keys are a sequence's first key_lens[i] tokens, queries all of them: ColBERT
queries whose [MASK] expansion is not attended to). Its two products (scores Q·Kᵀ and P·V) run
in float32 FMAs (`matmul="float32"`, exact: the default) or, where the CPU has AMX-bf16, on bf16
tiles: "bf16" rounds Q, K, P and V to bf16 once, "bf16x3" splits each into bf16 hi + lo and sums
three tile products (float32-like accuracy); the softmax stays float32 in every mode
(MATMULS; which models get which: attention/backend.py). Where the CPU has avx512_bf16 but no
AMX (AMD Zen 4 / 5), "bf16" runs the same rounding on vdpbf16ps dot products and "bf16x3" the
float32 FMAs (`products`). It replaces PyTorch's
CPU SDPA for the native encoders because SDPA's flash kernel runs 32- and 64-wide heads as many
tiny GEMMs (far below the CPU's GEMM rate: figures in docs/performance.md). Written by hand deliberately:
no maintained library offers varlen encoder attention for CPU (vLLM's CPU kernels are part of
vLLM, not a library).

One source, built per ISA (BUILD_ISAS; csrc/cpu_simd.h): AVX-512 (16 lanes, and the AMX-bf16
products where the CPU has them) or AVX2 + FMA (8 lanes; laptops, older servers, AMD Zen 2 / 3).
The build run is chosen once, at load, by cpu_features.py: the best the CPU has, capped by
TIDEPOOL_CPU_ISA (=avx2 runs the AVX2 build on an AVX-512 machine). `pip install` builds each
ISA's module (setup.py, kernels/specs.py); an edited source (a developer's tree) is built on
first use instead, ~10-40 s once per machine (torch caches it under TORCH_EXTENSIONS_DIR, by
default ~/.cache/torch_extensions), which needs a C++ compiler and ninja (the `ninja` package is
a dependency). Where the CPU has neither ISA or the build fails, `load()` says why once and returns
None, and the encoders keep PyTorch's SDPA. TIDEPOOL_CPU_ATTENTION=sdpa turns the kernel off,
=native makes a failure an error (envs.cpu_attention).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from tidepool.attention.relative_bias import RelativePositionBias
from tidepool.kernels import cpu_features, specs
from tidepool.kernels.build import build_or_fall_back, load_build

logger = logging.getLogger("tidepool")

HEAD_DIMS = (32, 64, 128)
# Each thread keeps one sequence's [L, L] float32 scores (L2-sized for encoder lengths: 1 MiB at
# 512 tokens, 16 MiB at this limit); longer models keep PyTorch's SDPA, which tiles its scores.
# The op's own check is built from this constant (-DTIDEPOOL_MAX_SEQ_LEN, kernels/specs.py).
MAX_SEQ_LEN = specs.ATTENTION_MAX_SEQ_LEN
_DTYPES = (torch.float32, torch.bfloat16)
MATMULS = {"float32": 0, "bf16": 1, "bf16x3": 2}
"""The kernel's product modes → the op's `matmul` code (csrc/cpu_encoder_attention.cpp)."""
BUILD_ISAS = specs.BUILD_ISAS
"""The ISA levels (cpu_features.LEVELS) tidepool's vector kernels are built for, best first:
csrc/cpu_simd.h's TP_ISA_AVX512 and TP_ISA_AVX2."""
_SOURCE_NAME = specs.ENCODER_ATTENTION["avx512"].source

_lock = threading.Lock()
_state: dict[str, Any] = {}


def _compile(isa: str) -> Any:
    build = specs.ENCODER_ATTENTION[isa]
    load_build(build)
    return getattr(torch.ops, build.namespace)


def load_isa(isa: str) -> Any | None:
    """The op namespace of `isa`'s build (BUILD_ISAS), built and loaded on first call, whatever
    TIDEPOOL_CPU_ISA says (tests run each build the CPU can); None where it cannot run."""
    if isa not in _state:
        with _lock:
            if isa not in _state:
                _state[isa] = build_or_fall_back(
                    _compile, _SOURCE_NAME, f"tidepool's CPU attention kernel ({isa})",
                    "PyTorch SDPA", isa if cpu_features.cpu_has(isa) else None,
                )  # fmt: skip
    return _state[isa]


def chosen_isa() -> str | None:
    """The build the encoders run: the best of BUILD_ISAS usable here (cpu_features.usable:
    the CPU has it, TIDEPOOL_CPU_ISA allows it), None where none is."""
    return cpu_features.best(BUILD_ISAS)


def load():
    """The chosen build's op namespace (chosen_isa), built and loaded on first call; None where
    it cannot run (then the encoders run PyTorch SDPA)."""
    isa = chosen_isa()
    if isa is None:
        key = "none"
        if key not in _state:
            with _lock:
                _state[key] = build_or_fall_back(
                    _compile, _SOURCE_NAME, "tidepool's CPU attention kernel", "PyTorch SDPA", None
                )
        return _state[key]
    return load_isa(isa)


DOT_BF16 = 3
"""The op's code for "bf16" with the products on AVX512-BF16 vdpbf16ps (no AMX)."""


def dot_bf16_available() -> bool:
    """Whether the kernel runs "bf16" on vdpbf16ps here (the CPU has avx512_bf16, and
    TIDEPOOL_CPU_ISA does not cap the kernels below avx512_bf16)."""
    ops = load()
    if ops is None or not cpu_features.usable("avx512_bf16"):
        return False
    return bool(ops.dot_bf16_available())


def products(matmul: str) -> str:
    """Where a MATMULS mode's products run here: "amx" (AMX-bf16 tiles), "avx512_bf16"
    ("bf16" on vdpbf16ps, CPUs with avx512_bf16 and no AMX) or "float32" (FMAs: the float32
    mode, and bf16x3 without AMX, whose float32-like accuracy the float32 FMAs give exactly)."""
    if matmul == "float32":
        return "float32"
    if amx_bf16_available():
        return "amx"
    return "avx512_bf16" if matmul == "bf16" and dot_bf16_available() else "float32"


def amx_bf16_available() -> bool:
    """Whether the kernel runs its AMX-bf16 modes here (the CPU has AMX-bf16 and AVX512-BF16
    and the OS granted the tile state); elsewhere they run the float32 path."""
    ops = load()
    if ops is None or not cpu_features.usable("amx"):
        return False
    return bool(ops.amx_bf16_available())


def supports(
    device: torch.device, dtype: torch.dtype, head_dim: int, max_seq_len: int = MAX_SEQ_LEN
) -> bool:
    """Whether the kernel handles this case (and is available): CPU, float32 / bfloat16, a head
    width it was written for, sequences of at most MAX_SEQ_LEN tokens."""
    if (
        device.type != "cpu"
        or dtype not in _DTYPES
        or head_dim not in HEAD_DIMS
        or max_seq_len > MAX_SEQ_LEN
    ):
        return False
    return load() is not None


def encoder_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    first_token_only: bool = False,
    bias: RelativePositionBias | None = None,
    key_lens: torch.Tensor | None = None,
    matmul: str = "float32",
    isa: str | None = None,
) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim], k / v: [num_tokens, kv_heads, head_dim] (views with any
    row and head strides, head_dim contiguous; kv_heads dividing heads), sequence i at rows
    seq_starts[i] .. + seq_lens[i] (int64 tensors) → [num_tokens, heads * head_dim] (rows outside
    every sequence are left unset), or with `first_token_only` [num_seqs, heads * head_dim]: each
    sequence's first query only, in sequence order. `bias` (relative_bias.py) is added to the
    scores inside the kernel, read by key - query distance. `key_lens` ([num_seqs] int64, each
    in 1..seq_lens[i]): sequence i's keys are its first key_lens[i] rows; None: all its rows.
    `matmul`: a MATMULS mode, run where products(matmul) says.
    `isa`: run that build (BUILD_ISAS; tests), not the chosen one."""
    ops = load() if isa is None else load_isa(isa)
    assert ops is not None, "check supports() first"
    path = products(matmul)  # also where TIDEPOOL_CPU_ISA caps the kernels
    code = {"amx": MATMULS[matmul], "avx512_bf16": DOT_BF16, "float32": 0}[path]
    num_tokens, num_heads, head_dim = q.shape
    if first_token_only:
        out = q.new_empty(seq_starts.shape[0], num_heads * head_dim)
        out_starts = torch.arange(seq_starts.shape[0], dtype=torch.int64)
    else:
        out = q.new_empty(num_tokens, num_heads * head_dim)
        out_starts = seq_starts
    table, offset = (None, 0) if bias is None else (bias.by_distance, bias.offset)
    ops.encoder_attention(
        q,
        k,
        v,
        seq_starts,
        seq_lens,
        out_starts,
        first_token_only,
        scale,
        table,
        offset,
        key_lens,
        code,
        out,
    )
    return out
