"""Native memory that stays flat however many different step shapes the engine runs.

Cause, measured (docs/performance.md, "Memory under a soak"): on CPU the linears run on oneDNN
with pre-packed weights (models/layers/linear.py), and oneDNN builds one primitive per input
shape. Two caches keep them, keyed by shape: oneDNN's primitive cache and ideep's (torch's
oneDNN wrapper) LRU cache, 1,024 entries each by default. Every step whose token count is new
adds an entry per linear kind (~0.3 MB each), so glibc's in-use heap grew 147 → 605 MB over 160
calls of 1-64 texts; and because these long-lived entries sit among each step's short-lived
tensors, glibc cannot hand the freed space around them back: RSS 510 MB → 2.5 GB over 300 calls.

Remedy, two parts, both chosen by measurement:
  * for float32 models, a cap of 256 entries on both caches (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`,
    `LRU_CACHE_CAPACITY`), set before the first oneDNN primitive of the process: the in-use heap
    then stops growing after ~40 calls, and building a float32 primitive is cheap (even no cache
    at all was not slower). bfloat16 / float16 keep torch's 1,024: an AMX primitive takes
    milliseconds to build, and no cache or a 256 cap made their steps several times slower on
    one-text requests of 50 lengths (least-recently-used thrashing);
  * `malloc_trim(0)` after a step, at most once per `TRIM_INTERVAL_S`: glibc then returns the
    free pages inside its heap (a trim costs milliseconds: well under 1% of step time at that
    rate; figures in docs/performance.md, 'Choices elsewhere in the code').
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tidepool import envs

logger = logging.getLogger("tidepool")

# The two shape-keyed caches of oneDNN primitives (oneDNN's own, and ideep's inside torch).
CACHE_CAPACITY_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")

# The cap where the model's dtype has no entry: torch's own (see the module docstring).
DEFAULT_CACHE_CAPACITY = 1024
CACHE_CAPACITY_BY_DTYPE = {torch.float32: 256}

# Seconds of engine time between two malloc_trim calls (each costs milliseconds on a large heap).
TRIM_INTERVAL_S = 2.0


@dataclass(frozen=True)
class NativeMemoryPolicy:
    """What `NativeMemory.start` applied to this process."""

    cache_capacity: int | None
    """Entries asked for each oneDNN primitive cache; None: left to torch (1,024, untrimmed)."""
    trims: bool
    """Whether steps return glibc's free heap pages (glibc only, and the remedy is on)."""


class NativeMemory:
    """The process's native-memory remedy: start it before the model loads, call `after_step`
    after (or before) each step. Both are cheap; `after_step` is one clock read between trims."""

    def __init__(
        self, policy: NativeMemoryPolicy, malloc_trim: Callable[[int], object] | None = None
    ) -> None:
        self.policy = policy
        self._malloc_trim = malloc_trim
        self._last_trim = time.monotonic()
        self.num_trims = 0
        """How many times the heap was trimmed (for tests and logs)."""

    @classmethod
    def start(cls, dtype: torch.dtype, quantization: str | None = None) -> NativeMemory:
        """Apply TIDEPOOL_ONEDNN_CACHE_CAPACITY for a model of `dtype` (int8 `quantization`: as
        bfloat16, torch's 1,024: an int8 primitive takes longer to build than to run at a
        hundred rows, so a 256 cap would thrash like bfloat16's): cap oneDNN's caches
        (unless the user set their variables) and find glibc's malloc_trim. Must run before the process's
        first oneDNN primitive (oneDNN reads the capacities once); the runner calls it before
        loading the model, whose weight packing creates the first primitives."""
        setting = envs.onednn_cache_capacity()
        if setting == "torch":
            return cls(NativeMemoryPolicy(cache_capacity=None, trims=False))
        if setting != "auto":
            capacity = int(setting)
        elif quantization is not None:
            capacity = DEFAULT_CACHE_CAPACITY
        else:
            capacity = CACHE_CAPACITY_BY_DTYPE.get(dtype, DEFAULT_CACHE_CAPACITY)
        for name in CACHE_CAPACITY_VARIABLES:
            os.environ.setdefault(name, str(capacity))
        malloc_trim = _find_malloc_trim()
        return cls(NativeMemoryPolicy(cache_capacity=capacity, trims=malloc_trim is not None),
                   malloc_trim)  # fmt: skip

    def after_step(self, now: float | None = None) -> bool:
        """Trim glibc's heap when TRIM_INTERVAL_S passed since the last trim; returns whether
        it trimmed."""
        if self._malloc_trim is None:
            return False
        now = time.monotonic() if now is None else now
        if now - self._last_trim < TRIM_INTERVAL_S:
            return False
        self._malloc_trim(0)
        self._last_trim = time.monotonic()
        self.num_trims += 1
        return True


def _find_malloc_trim() -> Callable[[int], object] | None:
    """glibc's malloc_trim, or None elsewhere (musl, macOS, or jemalloc/tcmalloc preloaded:
    those return memory themselves and trimming glibc's unused heap would be wasted work)."""
    if os.environ.get("LD_PRELOAD", "").find("malloc") >= 0:
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        malloc_trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    return malloc_trim


def resident_set_bytes(pid: int | None = None) -> int | None:
    """VmRSS of a process (this one by default) from /proc; None where /proc has no such file."""
    path = f"/proc/{pid if pid is not None else 'self'}/status"
    try:
        with open(path, encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
