"""tidepool's CPU decode attention over the paged KV cache (csrc/cpu_paged_decode.cpp): rows of a
few queries (a decode's one token, short prompts, a prefill's last token in the output-rows
layer) read their keys and values from the cache blocks in place, one task per (row, KV head),
GQA heads sharing every K / V load, sliding windows reading only their window's blocks, Gemma 2's
soft-capping inside. The planner (paged_metadata.py) hands such rows to it as `PagedDecodeRows`;
everything else keeps the SDPA buckets.

Why: the SDPA path gathers every block a decode reads into a padded copy each layer and step
(`index_select`), builds an additive mask, and runs SDPA per bucket; reading in place moves each
cached K / V byte once (docs/performance.md, "Decode").

Loaded by kernels/build.py (the installed build of these sources, else built on first use with
torch's C++ extension loader, cached under TORCH_EXTENSIONS_DIR), one source per ISA (csrc/cpu_simd.h; cpu_kernels.BUILD_ISAS:
AVX-512, 16 lanes, or AVX2 + FMA, 8 lanes, for AVX2-only CPUs such as AMD Zen 2 / 3); the build
run is the best the CPU has and TIDEPOOL_CPU_ISA allows (kernels/cpu_features.py; =avx2 runs the
AVX2 build on an AVX-512 machine). Where the CPU has neither or the build fails, `load()` says
why once and returns None, and decodes keep the SDPA buckets. TIDEPOOL_CPU_ATTENTION=sdpa turns
it off (one switch for tidepool's hand-written CPU code), =native makes a failure an error.
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

DTYPES = (torch.float32, torch.bfloat16)
MAX_QUERY_LEN = 16
"""Rows of at most this many queries take the kernel at any head size."""
LONG_ROW_QUERY_LEN = 512
"""Heads of a multiple of 64 floats: rows up to this many queries (paged_metadata's tiles of
MAX_ROW_QUERY_LEN: prompt chunks, long prompts under a sliding window) take the kernel too, in
its GEMM-shaped path (keys transposed once per task, query tiles of 32 that read only the keys
they see): no gather, no mask, Gemma 2's soft-cap inside instead of torch's explicit ops."""


def max_query_len(head_size: int) -> int:
    """The longest row (queries) the kernel takes for heads of `head_size` floats."""
    return LONG_ROW_QUERY_LEN if head_size % 64 == 0 else MAX_QUERY_LEN


_lock = threading.Lock()
_state: dict[str | None, Any] = {}
_chosen: dict[str | None, Any] = {}
"""TIDEPOOL_CPU_ISA's cap → the op it chooses (load() runs per layer and step: one lookup)."""


def _compile(isa: str) -> Any:
    build = specs.PAGED_DECODE[isa]
    load_build(build)
    return getattr(torch.ops, build.namespace).paged_decode


def load(isa: str | None = None) -> Any | None:
    """The `paged_decode` op of the chosen build (cpu_kernels.chosen_isa: the best the CPU and
    TIDEPOOL_CPU_ISA allow) or of `isa`'s (tests: any build the CPU runs, whatever the cap),
    built and loaded on first call; None where it cannot run."""
    if isa is None:
        cap = cpu_features.cap()
        if cap not in _chosen:
            _chosen[cap] = load(cpu_kernels.chosen_isa() or "none")
        return _chosen[cap]
    key = isa if isa in cpu_kernels.BUILD_ISAS and cpu_features.cpu_has(isa) else None
    if key not in _state:
        with _lock:
            if key not in _state:
                _state[key] = build_or_fall_back(
                    _compile,
                    "cpu_paged_decode.cpp",
                    "tidepool's CPU paged decode kernel",
                    "SDPA over gathered blocks for decodes",
                    key,
                )
    return _state[key]


def supports(device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
    """Whether the kernel runs this cache here (builds it on first call: call at load time)."""
    if device.type != "cpu" or dtype not in DTYPES or head_size % 8:
        return False
    return load() is not None


def paged_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    window: int | None,
    scale: float,
    softcap: float | None,
    out: torch.Tensor,
) -> None:
    """query [T, Hq, D] (D contiguous); kv_cache [2, Hkv, num_blocks, block_size, D]; row r's
    queries query[query_starts[r] + i], i < query_lens[r], are the last of its seq_lens[r] keys
    (block_table [R, W] int32, the rest int32 [R]) → out[query_starts[r] + i] ([T', Hq * D]);
    other rows of `out` are left alone. `window`: a sliding window (None: full attention)."""
    op = load()
    assert op is not None, "check supports() first"
    op(
        query,
        kv_cache,
        block_table,
        seq_lens,
        query_starts,
        query_lens,
        window or 0,
        scale,
        softcap or 0.0,
        out,
    )
