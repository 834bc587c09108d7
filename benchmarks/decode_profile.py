"""Where a decode step's time goes, end to end: schedule, input preparation, model (attention
apart), sampling, the scheduler's update, output processing (detokenization), the rest.

A random Llama (benchmarks/random_decoder.py) generates --new-tokens tokens for --requests
token-id prompts of --min-prompt..--max-prompt tokens, greedy, EOS ignored; every piece of the
engine's step is wrapped with a timer, and the steps that are decodes only (one token per
request) are reported: milliseconds per step, median over the run, per piece and as a share.

    python benchmarks/decode_profile.py [--hidden-size 1024 --layers 8 --heads 16 --kv-heads 8
        --intermediate 3072] [--requests 64] [--new-tokens 64] [--sampling greedy|top-k|top-p]

--prefill-profile: the prompts' prefill alone (1 new token) under torch's profiler, the ops
with the most self CPU time printed; --workload gemma2 runs generate_vs_vllm.py's Gemma-2
folder and prompt lengths (32 prompts of 500-1,000 tokens) instead of the Llama shape:

    python benchmarks/decode_profile.py --workload gemma2 --prefill-profile [--requests 8]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

# tidepool sets OpenMP's wait policy when imported, before torch loads.
import tidepool  # noqa: F401

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from random_decoder import build_random_decoder  # noqa: E402


class Timers:
    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    @contextmanager
    def time(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.step[name] += time.perf_counter() - start

    def wrap(self, owner, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        def timed(*args, **kwargs):
            with self.time(name):
                return original(*args, **kwargs)

        setattr(owner, attribute, timed)


def instrument(llm, timers: Timers) -> None:
    from tidepool.attention import paged
    from tidepool.worker import model_runner as runner_module

    engine = llm.llm_engine
    core, runner = engine.core, engine.core.model_runner
    timers.wrap(core.scheduler, "schedule", "schedule")
    timers.wrap(core.scheduler, "update", "scheduler update")
    timers.wrap(runner_module, "build_causal_batch", "input preparation")
    timers.wrap(runner, "_sample", "logits + sampling")
    timers.wrap(paged, "paged_attention", "attention (in model)")
    timers.wrap(runner, "execute", "runner execute")
    timers.wrap(engine.output_processor, "process", "output processing")
    step = engine.step

    def timed_step():
        timers.step = defaultdict(float)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        sched = core.scheduler
        decode_only = (
            bool(sched.running)
            and not sched.waiting
            and all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running)
        )
        out = step()
        timers.step["step"] = time.perf_counter() - start
        timers.step["page faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        if decode_only:
            timers.steps.append(dict(timers.step))
        return out

    engine.step = timed_step


def profile_decode_steps(llm, num_steps: int, rows: int) -> None:
    """torch.profiler over `num_steps` decode-only steps (after the prefill): the ops with the
    most self CPU time, printed when the run ends."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    sched = engine.core.scheduler
    step = engine.step
    state: dict = {"prof": None, "steps": 0}

    def profiled_step():
        decode_only = (
            bool(sched.running)
            and not sched.waiting
            and all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running)
        )
        if decode_only and state["prof"] is None and state["steps"] < num_steps:
            state["prof"] = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            state["prof"].__enter__()
        out = step()
        if state["prof"] is not None:
            state["steps"] += 1
            if state["steps"] == num_steps or not decode_only:
                state["prof"].__exit__(None, None, None)
                table = (
                    state["prof"]
                    .key_averages(group_by_input_shape=True)
                    .table(sort_by="self_cpu_time_total", row_limit=rows)
                )
                print(f"{state['steps']} decode steps under torch.profiler:")
                print(table)
                state["prof"] = None
                state["steps"] = num_steps
        return out

    engine.step = profiled_step


def report(timers: Timers) -> None:
    steps = timers.steps
    if not steps:
        print("no decode-only steps")
        return
    med = {k: statistics.median(s.get(k, 0.0) for s in steps) for k in steps[0]}
    total = med["step"]
    execute = med.get("runner execute", 0.0)
    model = execute - med.get("input preparation", 0) - med.get("logits + sampling", 0)
    rows = [
        ("schedule", med.get("schedule", 0)),
        ("input preparation", med.get("input preparation", 0)),
        ("model (all layers)", model),
        ("  of which attention", med.get("attention (in model)", 0)),
        ("logits + sampling", med.get("logits + sampling", 0)),
        ("scheduler update", med.get("scheduler update", 0)),
        ("output processing", med.get("output processing", 0)),
    ]
    accounted = sum(v for name, v in rows if not name.startswith(" "))
    rows.append(("rest (driver, routing)", total - accounted))
    print(
        f"decode-only steps: {len(steps)}; median step {total * 1e3:.2f} ms, "
        f"{med['page faults']:.0f} page faults"
    )
    for name, value in rows:
        print(f"  {name:<26} {value * 1e3:8.2f} ms  {100 * value / total:5.1f}%")


def prefill_profile(llm, prompts, rows: int) -> None:
    """One prefill pass (1 new token) over `prompts` under torch.profiler: the top ops by self
    CPU time, and the wall time of the pass."""
    from torch.profiler import ProfilerActivity, profile

    from tidepool import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    plain = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    print(f"prefill of {len(prompts)} prompts ({tokens} tokens): {plain:.2f} s unprofiled")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=20)
    parser.add_argument("--max-prompt", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--sampling", default="greedy", choices=["greedy", "top-k", "top-p"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--workload", default="llama", choices=["llama", "gemma2"])
    parser.add_argument("--prefill-profile", action="store_true")
    parser.add_argument("--rows", type=int, default=25, help="ops printed by the profiles")
    parser.add_argument(
        "--decode-profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="run STEPS decode-only steps under torch.profiler (the step timers then include it)",
    )
    args = parser.parse_args()
    if args.workload == "gemma2":  # generate_vs_vllm.py's Gemma-2 prompts
        args.min_prompt, args.max_prompt = max(args.min_prompt, 500), max(args.max_prompt, 1000)
    if args.threads:
        torch.set_num_threads(args.threads)
    from tidepool import LLM, SamplingParams

    if args.workload == "gemma2":
        from generate_vs_vllm import build_model

        path = build_model("gemma2", args.layers)
    else:
        path = build_random_decoder(
            "LlamaForCausalLM",
            args.hidden_size,
            args.layers,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            intermediate_size=args.intermediate,
        )
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(n)]}
        for n in (rng.randint(args.min_prompt, args.max_prompt) for _ in range(args.requests))
    ]
    sampling = {"greedy": {"temperature": 0.0}, "top-k": {"top_k": 50}, "top-p": {"top_p": 0.9}}
    params = SamplingParams(
        max_tokens=args.new_tokens, ignore_eos=True, seed=None, **sampling[args.sampling]
    )
    llm = LLM(
        str(path),
        dtype="float32",
        enable_prefix_caching=False,
        max_model_len=args.max_prompt + args.new_tokens + 16,
        max_num_batched_tokens=8192,  # generate_worker.py's, both engines'
    )
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    if args.prefill_profile:
        prefill_profile(llm, prompts, args.rows)
        return
    timers = Timers()
    instrument(llm, timers)
    if args.decode_profile:
        profile_decode_steps(llm, args.decode_profile, args.rows)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    print(
        f"{path.name}: {args.requests} requests x {args.new_tokens} new tokens, "
        f"{args.sampling}, threads={torch.get_num_threads()}: {elapsed:.2f} s, "
        f"{args.requests * args.new_tokens / elapsed:.1f} tok/s"
    )
    report(timers)


if __name__ == "__main__":
    main()
