"""Decode attention alone: tidepool's in-place kernel (attention/cpu_paged_decode.py) vs paged SDPA
(gathered blocks, masks, SDPA per bucket) over the same paged KV cache, one layer of one decode
step, planning included (what a step pays per KV-cache group), the two alternating.

    python benchmarks/paged_decode.py [--shape llama|gemma-sliding|gemma-full] [--seqs N]
        [--repeats 20]

Shapes: llama: 16 / 8 heads of 64, contexts 20-300 (+ up to 64 generated); gemma-*: 8 / 4 heads
of 128, contexts 500-1,000, soft-cap 50, sliding window 256 or full attention. Block size 16.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

# tidepool sets OpenMP's wait policy when imported, before torch loads.
import tidepool  # noqa: F401

# isort: split
import torch

from tidepool.attention import cpu_paged_decode
from tidepool.attention.paged import paged_attention
from tidepool.attention.paged_metadata import (
    build_group_metadata,
    plan_buckets,
    split_decode_rows,
    split_rows,
)
from tidepool.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec

SHAPES = {
    "llama": dict(heads=16, kv_heads=8, head_size=64, lo=20, hi=364, window=None, cap=None),
    "gemma-sliding": dict(
        heads=8, kv_heads=4, head_size=128, lo=500, hi=1064, window=256, cap=50.0
    ),
    "gemma-full": dict(heads=8, kv_heads=4, head_size=128, lo=500, hi=1064, window=None, cap=50.0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama", choices=list(SHAPES))
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    s = SHAPES[args.shape]
    block_size = 16
    if s["window"] is None:
        spec = FullAttentionSpec(block_size, s["kv_heads"], s["head_size"], torch.float32)
    else:
        spec = SlidingWindowSpec(
            block_size, s["kv_heads"], s["head_size"], torch.float32, s["window"]
        )
    rng = random.Random(0)
    contexts = sorted((rng.randint(s["lo"], s["hi"]) for _ in range(args.seqs)), reverse=True)
    per_row = [-(-(c + 1) // block_size) for c in contexts]
    ids = list(range(1, sum(per_row) + 1))
    rng.shuffle(ids)
    table = torch.zeros(args.seqs, max(per_row), dtype=torch.int64)
    for r, n in enumerate(per_row):
        table[r, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, s["kv_heads"], sum(per_row) + 1, block_size, s["head_size"], generator=g)
    q = torch.randn(args.seqs, s["heads"], s["head_size"], generator=g)
    k = torch.randn(args.seqs, s["kv_heads"], s["head_size"], generator=g)
    v = torch.randn(args.seqs, s["kv_heads"], s["head_size"], generator=g)
    token_request = torch.arange(args.seqs)
    positions = torch.tensor(contexts)
    query_lens = [1] * args.seqs

    def step(in_place: bool) -> torch.Tensor:
        rows = split_rows(contexts, query_lens)
        rows, decode = split_decode_rows(rows, cpu_paged_decode.MAX_QUERY_LEN if in_place else 0)
        spans = plan_buckets(rows, block_size, s["kv_heads"], 0.25)
        meta = build_group_metadata(
            rows,
            spans,
            table,
            token_request,
            positions,
            spec,
            torch.float32,
            torch.device("cpu"),
            decode,
        )
        return paged_attention(q, k, v, kv, meta, s["head_size"] ** -0.5, s["cap"])

    ref, out = step(False), step(True)
    err = (ref - out).abs().max().item() / ref.abs().max().item()
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for in_place in (False, True):
            start = time.perf_counter()
            step(in_place)
            times[in_place].append(time.perf_counter() - start)
    sdpa, kernel = (statistics.median(times[x]) for x in (False, True))
    ratios = [a / b for a, b in zip(times[False], times[True], strict=True)]
    kv_bytes = (
        sum(min(c + 1, s["window"] or c + 1) for c in contexts)
        * 2
        * s["kv_heads"]
        * s["head_size"]
        * 4
    )
    print(
        f"{args.shape}: {args.seqs} decodes, contexts {min(contexts)}-{max(contexts)}, "
        f"threads={torch.get_num_threads()}: paged SDPA {sdpa * 1e3:.2f} ms, in-place kernel "
        f"{kernel * 1e3:.2f} ms ({kv_bytes / kernel / 1e9:.1f} GB/s of K/V), speed-up "
        f"{statistics.median(ratios):.2f}x (median of pairs); max diff {err:.1e} of the magnitude"
    )


if __name__ == "__main__":
    main()
