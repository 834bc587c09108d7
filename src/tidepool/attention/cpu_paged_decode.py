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
torch's C++ extension loader, cached under TORCH_EXTENSIONS_DIR) for AVX2 + FMA, so it runs on AVX2-only CPUs (AMD Zen 2/3) as
well as on AVX-512 ones. Where the CPU lacks them or the build fails, `load()` says why once and
returns None, and decodes keep the SDPA buckets. TIDEPOOL_CPU_ATTENTION=sdpa turns it off (one
switch for tidepool's hand-written CPU code), =native makes a failure an error.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from tidepool.kernels import cpu_features, specs
from tidepool.kernels.build import build_or_fall_back, load_build

logger = logging.getLogger("tidepool")

DTYPES = (torch.float32, torch.bfloat16)
MAX_QUERY_LEN = 16
"""Rows of at most this many queries take the kernel; longer ones are GEMM-shaped (SDPA)."""

_lock = threading.Lock()
_state: dict[str, Any] = {}


def _compile(isa: str) -> Any:
    load_build(specs.PAGED_DECODE)
    return torch.ops.tidepool_paged.paged_decode


def _build() -> Any | None:
    """The kernel where the CPU has AVX2 + FMA (and TIDEPOOL_CPU_ISA allows them: its one
    build runs on every level from avx2 up), through the kernels' shared builder."""
    isa = "avx2" if cpu_features.usable("avx2") else None
    return build_or_fall_back(
        _compile,
        specs.PAGED_DECODE.source,
        "tidepool's CPU paged decode kernel",
        "SDPA over gathered blocks for decodes",
        isa,
    )


def load() -> Any | None:
    """The `paged_decode` op, built and loaded on first call; None where it cannot run."""
    if "op" not in _state:
        with _lock:
            if "op" not in _state:
                _state["op"] = _build()
    return _state["op"]


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
