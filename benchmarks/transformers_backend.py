"""The transformers backend vs native models: same checkpoints, same engine settings, one run.

    embed     all-MiniLM-L6-v2 (a BertModel) on the benchmark corpus: tokens per second
    generate  a small random Llama (hidden 512, 4 layers, GQA 8/2 heads, 30K vocabulary), greedy,
              --max-tokens per request over corpus prompts: generated tokens per second

Each section runs native and backend alternately (A B A B ...), so the machine's noise hits both;
the figure quoted is the median of the per-round ratios backend / native (1.0 = as fast; the
issue's target is >= 0.8). Wall-clock and process CPU seconds are both reported: on a shared
machine CPU seconds are the steadier measure. Outputs are checked to agree (embedding cosine,
greedy tokens).

    python benchmarks/transformers_backend.py [--texts 1000] [--requests 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

# tidepool sets OpenMP's wait policy when imported, before torch loads: the same for all sides.
import tidepool  # noqa: F401

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from corpus import make_corpus  # noqa: E402
from random_decoder import build_random_decoder  # noqa: E402


def alternate(
    runs: dict[str, Callable[[], object]], rounds: int
) -> dict[str, list[tuple[float, float]]]:
    """(wall seconds, CPU seconds) of each run per round, the runs alternating."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def report(section: str, unit: str, amount: int, times: dict[str, list[tuple[float, float]]]):
    native, backend = times["native"], times["transformers"]
    for name, rows in times.items():
        walls = [w for w, _ in rows]
        cpus = [c for _, c in rows]
        print(
            f"  {name:<13} {amount / min(walls):9.0f} {unit}/s (best wall)  "
            f"wall {' '.join(f'{w:.2f}' for w in walls)} s  cpu {' '.join(f'{c:.2f}' for c in cpus)} s"
        )
    wall_ratio = statistics.median(n[0] / b[0] for n, b in zip(native, backend, strict=True))
    cpu_ratio = statistics.median(n[1] / b[1] for n, b in zip(native, backend, strict=True))
    print(
        f"  {section}: backend / native throughput, median of rounds: "
        f"wall {wall_ratio:.2f}x, cpu {cpu_ratio:.2f}x"
    )


def bench_embed(args: argparse.Namespace) -> None:
    from tidepool import LLM

    texts = make_corpus(args.texts)
    engines = {
        impl: LLM(args.embed_model, dtype=args.dtype, model_impl=impl)
        for impl in ("native", "transformers")
    }
    tokenizer = engines["native"].get_tokenizer()
    max_len = engines["native"].model_config.max_model_len
    num_tokens = sum(min(len(ids), max_len) for ids in tokenizer(texts)["input_ids"])
    print(f"embed: {args.embed_model}, {len(texts)} texts, {num_tokens} tokens, {args.dtype}")

    def embed(impl: str) -> torch.Tensor:
        outs = engines[impl].embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
        return torch.tensor([o.outputs.embedding for o in outs])

    cosine = torch.nn.functional.cosine_similarity(embed("native"), embed("transformers"))
    print(f"  agreement: worst cosine {cosine.min().item():.7f}")
    runs = {impl: (lambda impl=impl: embed(impl)) for impl in engines}
    report("embed", "tokens", num_tokens, alternate(runs, args.rounds))


def bench_generate(args: argparse.Namespace) -> None:
    from tidepool import LLM, SamplingParams

    folder = build_random_decoder()
    prompts = [" ".join(t.split()[:120]) for t in make_corpus(args.requests, seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {
        impl: LLM(str(folder), dtype=args.dtype, model_impl=impl)
        for impl in ("native", "transformers")
    }
    print(
        f"generate: random Llama at {folder.name}, {len(prompts)} requests x "
        f"{args.max_tokens} tokens, {args.dtype}"
    )

    def generate(impl: str) -> list[list[int]]:
        outs = engines[impl].generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    same = sum(a == b for a, b in zip(generate("native"), generate("transformers"), strict=True))
    print(f"  agreement: {same}/{len(prompts)} greedy completions identical")
    runs = {impl: (lambda impl=impl: generate(impl)) for impl in engines}
    report("generate", "tokens", len(prompts) * args.max_tokens, alternate(runs, args.rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--embed-model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sections", default="embed,generate")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    sections = {"embed": bench_embed, "generate": bench_generate}
    for name in args.sections.split(","):
        sections[name](args)


if __name__ == "__main__":
    main()
