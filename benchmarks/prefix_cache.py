"""Prefix caching on a decoder embedder: 500 queries sharing a ~200-token instruction, caching on
vs off, in one run.

e5-mistral style: every input is "Instruct: <task description>\\nQuery: <query>" and the model
(a small random Llama body, LAST pooling) embeds it. With prefix caching the instruction's full
blocks are computed once and every other query computes only its own tokens. The two engines run
alternately (A B A B ...); the prefix cache is emptied before each run of the caching engine, so
each run pays for the instruction once. The ratio quoted is the median of the per-round ratios;
outputs are checked to agree.

    python benchmarks/prefix_cache.py [--queries 500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# tidepool sets OpenMP's wait policy when imported, before torch loads: the same for all sides.
import tidepool  # noqa: F401

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from corpus import make_corpus  # noqa: E402
from random_decoder import build_random_decoder  # noqa: E402

INSTRUCTION_WORDS = 175  # ~200 WordPiece tokens with the punctuation and the "Instruct:" frame


def make_inputs(num_queries: int) -> list[str]:
    words = " ".join(make_corpus(40, seed=1)).split()[:INSTRUCTION_WORDS]
    instruction = "Instruct: " + " ".join(words)
    queries = [" ".join(t.split()[:30]) for t in make_corpus(num_queries, seed=2)]
    return [f"{instruction}\nQuery: {q}" for q in queries]


def run(llm, texts: list[str], reset: bool) -> tuple[float, torch.Tensor]:
    if reset:
        assert llm.engine.kv_cache_manager.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.embed(texts, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, torch.tensor([o.outputs.embedding for o in outs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's own choice)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from tidepool import LLM

    path = build_random_decoder("LlamaModel", args.hidden_size, args.layers)
    texts = make_inputs(args.queries)
    on = LLM(str(path), dtype="float32", enable_prefix_caching=True)
    off = LLM(str(path), dtype="float32", enable_prefix_caching=False)
    tokenizer = on.get_tokenizer()
    lens = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    instruction_len = len(tokenizer(texts[0].split("\nQuery:")[0])["input_ids"]) - 1
    num_tokens = sum(lens)
    print(
        f"{len(texts)} queries, {num_tokens} tokens (mean {num_tokens / len(texts):.0f}); shared "
        f"instruction ~{instruction_len} tokens; model {path.name}; threads={torch.get_num_threads()}"
    )
    run(on, texts[:50], reset=True)  # warm-up both
    run(off, texts[:50], reset=False)

    on_times, off_times, ratios = [], [], []
    emb_on = emb_off = None
    for r in range(args.rounds):
        hits_before = on.get_metrics().prefix_cache_hits
        t_on, emb_on = run(on, texts, reset=True)
        hits = on.get_metrics().prefix_cache_hits - hits_before
        t_off, emb_off = run(off, texts, reset=False)
        on_times.append(t_on)
        off_times.append(t_off)
        ratios.append(t_off / t_on)
        print(
            f"round {r}: caching on {num_tokens / t_on:9,.0f} tok/s ({t_on:.2f} s, "
            f"{hits / num_tokens:.0%} of tokens from the cache) | off {num_tokens / t_off:9,.0f} "
            f"tok/s ({t_off:.2f} s) | ratio {t_off / t_on:.2f}x",
            flush=True,
        )
    cos = torch.nn.functional.cosine_similarity(emb_on, emb_off, dim=1)
    print(
        f"\nprefix caching on: {statistics.median(on_times):.2f} s, off: "
        f"{statistics.median(off_times):.2f} s; speed-up (median of rounds) "
        f"{statistics.median(ratios):.2f}x; agreement: min cosine {cos.min().item():.6f}"
    )


if __name__ == "__main__":
    main()
