"""Generation throughput: tidepool vs transformers' batched `generate`, same model, same run.

A small random Llama (hidden 512, 4 layers, GQA 8/2 heads, 30K vocabulary) completes prompts of
realistic, mixed lengths (the benchmark corpus: ~20 to ~300 tokens) with per-request output lengths
drawn from [--min-output, --max-output], greedy, EOS ignored (a random model has no sense of when
to stop). Throughput counts the tokens each request asked for.

transformers runs the prompts in batches of --hf-batch-size (sorted by length, left-padded), each
batch generating until its longest request is done (static batching: the others' extra tokens are
wasted, and so is their padding); tidepool runs all requests through continuous batching. With
--fixed-output every request asks for --max-output tokens and nothing is wasted on either side.
The two run alternately (A B A B ...); the ratio quoted is the median of the per-round ratios.

    python benchmarks/generate_throughput.py [--requests 64] [--rounds 3] [--fixed-output]
"""

from __future__ import annotations

import argparse
import os
import random
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


def make_workload(num_requests: int, min_out: int, max_out: int, fixed: bool, seed: int = 0):
    rng = random.Random(seed)
    prompts = [" ".join(t.split()[:250]) for t in make_corpus(num_requests, seed=3)]
    lengths = [max_out if fixed else rng.randint(min_out, max_out) for _ in prompts]
    return prompts, lengths


def run_tidepool(llm, prompts: list[str], lengths: list[int]) -> tuple[float, list[list[int]]]:
    from tidepool import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, [o.outputs[0].token_ids for o in outs]


@torch.inference_mode()
def run_hf(model, tokenizer, prompts: list[str], lengths: list[int], batch_size: int):
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[list[int] | None] = [None] * len(prompts)
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        batch = order[b : b + batch_size]
        enc = tokenizer(
            [prompts[i] for i in batch],
            return_tensors="pt",
            padding=True,
            return_token_type_ids=False,
        )
        max_new = max(lengths[i] for i in batch)
        out = model.generate(
            **enc,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tokenizer.pad_token_id,
        )
        for row, i in enumerate(batch):
            outputs[i] = out[row, enc["input_ids"].shape[1] :][: lengths[i]].tolist()
    return time.perf_counter() - start, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--min-output", type=int, default=32)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--fixed-output", action="store_true")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's own choice)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidepool import LLM

    path = build_random_decoder("LlamaForCausalLM", args.hidden_size, args.layers)
    prompts, lengths = make_workload(
        args.requests, args.min_output, args.max_output, args.fixed_output
    )
    llm = LLM(str(path), dtype=args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.padding_side = "left"
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype)).eval()
    prompt_lens = [len(ids) for ids in tokenizer(prompts)["input_ids"]]
    num_out = sum(lengths)
    print(
        f"{len(prompts)} requests: prompts {min(prompt_lens)}-{max(prompt_lens)} tokens (mean "
        f"{sum(prompt_lens) / len(prompts):.0f}), outputs {min(lengths)}-{max(lengths)} (total "
        f"{num_out}); model {path.name} {args.dtype}; transformers batch {args.hf_batch_size}; "
        f"threads={torch.get_num_threads()}"
    )
    run_tidepool(llm, prompts[:4], [8] * 4)  # warm-up both
    run_hf(hf, tokenizer, prompts[:4], [8] * 4, args.hf_batch_size)

    tp_times, hf_times, ratios = [], [], []
    tp_out = hf_out = None
    for r in range(args.rounds):
        t_tp, tp_out = run_tidepool(llm, prompts, lengths)
        t_hf, hf_out = run_hf(hf, tokenizer, prompts, lengths, args.hf_batch_size)
        tp_times.append(t_tp)
        hf_times.append(t_hf)
        ratios.append(t_hf / t_tp)
        print(
            f"round {r}: tidepool {num_out / t_tp:7.1f} tok/s ({t_tp:.1f} s) | transformers "
            f"{num_out / t_hf:7.1f} tok/s ({t_hf:.1f} s) | ratio {t_hf / t_tp:.2f}x",
            flush=True,
        )
    # Left padding changes float rounding in transformers, so compare the first tokens only.
    agree = sum(a[:8] == b[:8] for a, b in zip(tp_out, hf_out, strict=True))
    metrics = llm.get_metrics()
    print(
        f"\ntidepool {num_out / statistics.median(tp_times):.1f} tok/s, transformers "
        f"{num_out / statistics.median(hf_times):.1f} tok/s; speed-up (median of rounds) "
        f"{statistics.median(ratios):.2f}x; first 8 tokens equal for {agree}/{len(prompts)} "
        f"requests; tidepool steps {metrics.num_steps}, preemptions {metrics.num_preemptions}"
    )


if __name__ == "__main__":
    main()
