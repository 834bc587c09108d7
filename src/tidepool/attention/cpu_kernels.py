"""tidepool's own CPU kernels (csrc/), built on first use with torch's C++ extension loader.

`encoder_attention` (csrc/cpu_encoder_attention.cpp) is bidirectional attention over packed,
variable-length sequences: no padding, no mask, each (sequence, head) one task for a thread,
AVX-512 in float32 with float32 or bfloat16 inputs, head_dim 32, 64 or 128, with an optional
relative position bias read per head by key - query distance (MPNet), and optional key counts
per sequence (keys are a sequence's first key_lens[i] tokens, queries all of them: ColBERT
queries whose [MASK] expansion is not attended to). Its two products (scores Q·Kᵀ and P·V) run
in float32 FMAs (`matmul="float32"`, exact: the default) or, where the CPU has AMX-bf16, on bf16
tiles: "bf16" rounds Q, K, P and V to bf16 once, "bf16x3" splits each into bf16 hi + lo and sums
three tile products (float32-like accuracy); the softmax stays float32 in every mode
(MATMULS; which models get which: attention/backend.py). It replaces PyTorch's
CPU SDPA for the native encoders because SDPA's flash kernel runs 32- and 64-wide heads as many
tiny GEMMs (25-60 GFLOP/s here; figures in docs/performance.md). Written by hand deliberately:
no maintained library offers varlen encoder attention for CPU (vLLM's CPU kernels are part of
vLLM, not a library).

The build takes ~10 s once per machine (torch caches it under TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions); it needs a C++ compiler and ninja (the `ninja` package is a
dependency). Where the CPU has no AVX-512 or the build fails, `load()` says why once and returns
None, and the encoders keep PyTorch's SDPA. TIDEPOOL_CPU_ATTENTION=sdpa turns the kernel off,
=native makes a failure an error (envs.cpu_attention).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path

import torch

from tidepool import envs
from tidepool.attention.relative_bias import RelativePositionBias

logger = logging.getLogger("tidepool")

_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_encoder_attention.cpp"
HEAD_DIMS = (32, 64, 128)
# Each thread keeps one sequence's [L, L] float32 scores (L2-sized for encoder lengths: 1 MiB at
# 512 tokens, 16 MiB at this limit); longer models keep PyTorch's SDPA, which tiles its scores.
# The op's own check is built from this constant (-DTIDEPOOL_MAX_SEQ_LEN).
MAX_SEQ_LEN = 2048
_DTYPES = (torch.float32, torch.bfloat16)
MATMULS = {"float32": 0, "bf16": 1, "bf16x3": 2}
"""The kernel's product modes → the op's `matmul` code (csrc/cpu_encoder_attention.cpp)."""
# tidepool's sources are compiled for AVX-512 (F/BW/DQ/VL); build_or_fall_back runs them only
# where the CPU has them.
AVX512_CFLAGS = [
    "-O3",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512dq",
    "-mavx512vl",
    "-mfma",
    "-std=c++17",
    "-fopenmp",
]
_CFLAGS = [*AVX512_CFLAGS, f"-DTIDEPOOL_MAX_SEQ_LEN={MAX_SEQ_LEN}"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_has_avx512() -> tuple[bool, str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False, f"the CPU is {platform.machine()}, not x86-64"
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False, "cannot read /proc/cpuinfo to check for AVX-512"
    missing = [f for f in ("avx512f", "avx512bw", "avx512dq", "avx512vl") if f not in flags]
    if missing:
        return False, f"the CPU lacks {', '.join(missing)}"
    return True, ""


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the `ninja` package's binary is not there unless the
    environment is activated."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def build_extension(source: Path, prefix: str, cflags: list[str]) -> None:
    """Build (or load the cached build of) one of tidepool's C++ sources as a torch extension;
    raises where it cannot. Named by the source's and flags' hash: checkouts with different
    kernels (worktrees, upgrades) share torch's build cache without loading each other's builds.
    Shared by the encoder attention kernel, the decoder kernels and the int8 kernels."""
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    # The headers beside the source (csrc/*.h) are part of every build's name too.
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(cflags).encode())
    digest = digest.hexdigest()[:12]
    load(
        name=f"{prefix}_{digest}",
        sources=[str(source)],
        extra_cflags=cflags,
        # OpenMP: ATen's parallel_for is a header template, compiled into the kernel; without
        # it the kernel runs on one thread. libgomp.so.1 resolves to the one torch loaded.
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


def _compile() -> object:
    build_extension(_SOURCE, "tidepool_cpu_ops", _CFLAGS)
    return torch.ops.tidepool_cpu.encoder_attention


def build_or_fall_back(compile_fn, source_name: str, what: str, fallback: str) -> object | None:
    """`compile_fn()` where TIDEPOOL_CPU_ATTENTION allows it and the CPU has AVX-512, else None
    with one warning line (`what` is off, `fallback` runs instead); `=native` makes a failed
    build an error. Shared by the encoder attention kernel and the decoder kernels."""
    mode = envs.cpu_attention()
    if mode == "sdpa":
        return None
    ok, why = _cpu_has_avx512()
    if ok:
        try:
            return compile_fn()
        except Exception as e:  # a missing compiler / ninja, a failed build
            why = f"building {source_name} failed: {type(e).__name__}: {e}"
    if mode == "native":
        raise RuntimeError(f"TIDEPOOL_CPU_ATTENTION=native, but {what} is unusable: {why}")
    logger.warning("%s is off (%s); using %s", what, why, fallback)
    return None


def _build() -> object | None:
    return build_or_fall_back(
        _compile, _SOURCE.name, "tidepool's CPU attention kernel", "PyTorch SDPA"
    )


def load():
    """The `encoder_attention` op, built and loaded on first call; None where it cannot run."""
    if "op" not in _state:
        with _lock:
            if "op" not in _state:
                _state["op"] = _build()
    return _state["op"]


def amx_bf16_available() -> bool:
    """Whether the kernel runs its AMX-bf16 modes here (the CPU has AMX-bf16 and AVX512-BF16
    and the OS granted the tile state); elsewhere they run the float32 path."""
    if load() is None:
        return False
    return bool(torch.ops.tidepool_cpu.amx_bf16_available())


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
) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim], k / v: [num_tokens, kv_heads, head_dim] (views with any
    row and head strides, head_dim contiguous; kv_heads dividing heads), sequence i at rows
    seq_starts[i] .. + seq_lens[i] (int64 tensors) → [num_tokens, heads * head_dim] (rows outside
    every sequence are left unset), or with `first_token_only` [num_seqs, heads * head_dim]: each
    sequence's first query only, in sequence order. `bias` (relative_bias.py) is added to the
    scores inside the kernel, read by key - query distance. `key_lens` ([num_seqs] int64, each
    in 1..seq_lens[i]): sequence i's keys are its first key_lens[i] rows; None: all its rows.
    `matmul`: a MATMULS mode (the AMX ones run float32 where amx_bf16_available() is False)."""
    op = load()
    assert op is not None, "check supports() first"
    num_tokens, num_heads, head_dim = q.shape
    if first_token_only:
        out = q.new_empty(seq_starts.shape[0], num_heads * head_dim)
        out_starts = torch.arange(seq_starts.shape[0], dtype=torch.int64)
    else:
        out = q.new_empty(num_tokens, num_heads * head_dim)
        out_starts = seq_starts
    table, offset = (None, 0) if bias is None else (bias.by_distance, bias.offset)
    op(
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
        MATMULS[matmul],
        out,
    )
    return out
