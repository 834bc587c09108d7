"""The offline engine's native memory stays flat over steps of ever new shapes (issue 18).

Each call embeds a batch whose token count the process has not seen, so every step builds new
oneDNN primitives; without worker/memory.py's caps, the shape-keyed caches (1,024 entries each)
keep growing glibc's in-use heap, and RSS with it. The loop runs in a fresh process: oneDNN reads
its cache capacity once, at the process's first primitive, which an earlier test may have built.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

LOOP = r"""
import ctypes, json, random, sys
from tidepool import LLM
from tidepool.worker.memory import resident_set_bytes

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
llm = LLM()
rng = random.Random(0)
warmup_calls, calls = int(sys.argv[1]), int(sys.argv[2])
seen, samples = set(), []
for i in range(calls):
    while True:  # a batch whose total token count is new: new GEMM shapes in every step
        lens = [rng.randint(1, 120) for _ in range(rng.randint(1, 8))]
        if sum(lens) + 2 * len(lens) not in seen:
            break
    seen.add(sum(lens) + 2 * len(lens))
    llm.embed([" ".join(["fox"] * n) for n in lens], use_tqdm=False)
    if i + 1 in (warmup_calls, calls):
        samples.append({"in_use": libc.mallinfo2().uordblks, "rss": resident_set_bytes()})
print(json.dumps(samples))
"""

WARMUP_CALLS = 100
CALLS = 220
# Measured (2-core Xeon, MiniLM float32, 120 + 240 calls): in-use heap growth after warm-up
# -0.1 MiB with the caps (RSS +19 MiB, +2.8%); with torch's caches
# (TIDEPOOL_ONEDNN_CACHE_CAPACITY=torch) +165 MiB (RSS +315 MiB, +36%): ~0.7 MiB per new shape.
MAX_IN_USE_GROWTH = 30 * 2**20


def _run_loop(capacity: str | None) -> tuple[dict, dict]:
    env = dict(os.environ, TIDEPOOL_NUM_THREADS="1")
    env.pop("TIDEPOOL_ONEDNN_CACHE_CAPACITY", None)
    if capacity is not None:
        env["TIDEPOOL_ONEDNN_CACHE_CAPACITY"] = capacity
    out = subprocess.run(
        [sys.executable, "-c", LOOP, str(WARMUP_CALLS), str(CALLS)],
        env=env, capture_output=True, text=True, timeout=240, check=True,
    )  # fmt: skip
    after_warmup, end = json.loads(out.stdout.strip().splitlines()[-1])
    return after_warmup, end


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2, /proc")
def test_heap_stays_flat_over_new_step_shapes():
    after_warmup, end = _run_loop(None)
    assert end["in_use"] - after_warmup["in_use"] < MAX_IN_USE_GROWTH, (after_warmup, end)
    assert end["rss"] < after_warmup["rss"] * 1.15 + 30 * 2**20, (after_warmup, end)
