"""One short text through `LLM.embed`: p50 / p99 per mode, and where the time of a call goes.

    python benchmarks/one_text.py [--modes float32,bfloat16,int8] [--calls 200] [--rounds 5]
        [--threads 2] [--tokens 32] [--stages] [--profile float32]

Each mode's engine loads once; rounds alternate the modes (machine noise hits every side alike)
and each round times `--calls` calls of `llm.embed([text])` after a warm-up; the figures are the
medians over rounds of each round's p50 / p99. `--stages` then times the stages of one call
(inclusive wall time, perf_counter_ns around the engine's own functions, median per call);
`--profile MODE` prints a cProfile of the calls for that mode.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus import make_corpus  # noqa: E402

MODES = {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}}


def text_of_tokens(tokenizer, num_tokens: int) -> str:
    """A corpus text of exactly (or just over) `num_tokens` tokens, special tokens included."""
    words = make_corpus(50, seed=3)[0].split() * 20
    for count in range(1, len(words)):
        text = " ".join(words[:count])
        if len(tokenizer(text)["input_ids"]) >= num_tokens:
            return text
    return " ".join(words)


def call_times(llm, text: str, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        llm.embed([text], use_tqdm=False)
        times.append((time.perf_counter_ns() - start) / 1e6)
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class StageTimer:
    """Wraps named callables with perf_counter_ns; inclusive microseconds per call."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = defaultdict(list)
        self._undo: list[Callable[[], None]] = []

    def wrap(self, name: str, owner, attr: str) -> None:
        original = getattr(owner, attr)
        samples = self.samples[name]

        def timed(*args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                samples.append((time.perf_counter_ns() - start) / 1e3)

        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, original))

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def stage_breakdown(llm, text: str, calls: int) -> dict[str, float]:
    """Median inclusive µs per stage of one call (stages nest: see the printed indentation)."""
    from tidepool.worker import model_runner as runner_module

    core = llm.llm_engine.core
    runner = core.model_runner
    timer = StageTimer()
    timer.wrap("embed (whole call)", llm, "embed")
    timer.wrap("  input_processor.process (tokenize, Request)", llm.input_processor, "process")
    timer.wrap("  run_batch", llm.llm_engine, "run_batch")
    timer.wrap("    add_request", llm.llm_engine, "add_request")
    timer.wrap("    step", llm.llm_engine, "step")
    timer.wrap("      schedule", core.scheduler, "schedule")
    timer.wrap("      execute", runner, "execute")
    timer.wrap("        _execute_encoder", runner, "_execute_encoder")
    timer.wrap("          build_encoder_metadata", runner_module, "build_encoder_metadata")
    timer.wrap("          model forward", runner.model, "forward")
    timer.wrap("          pooler", runner.pooler, "forward")
    timer.wrap("      update", core.scheduler, "update")
    timer.wrap("  _finish (output objects)", llm, "_finish")
    try:
        call_times(llm, text, calls)
    finally:
        timer.restore()
    return {name: statistics.median(v) for name, v in timer.samples.items() if v}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--modes", default="float32,bfloat16,int8")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--stages", action="store_true")
    parser.add_argument("--profile", default=None, help="a mode to cProfile")
    args = parser.parse_args()
    os.environ.setdefault("TIDEPOOL_NUM_THREADS", str(args.threads))
    from tidepool import LLM

    modes = args.modes.split(",")
    engines = {name: LLM(model=args.model, **MODES[name]) for name in modes}
    text = text_of_tokens(engines[modes[0]].get_tokenizer(), args.tokens)
    num_tokens = len(engines[modes[0]].get_tokenizer()(text)["input_ids"])
    for llm in engines.values():
        call_times(llm, text, 20)
    p50s: dict[str, list[float]] = {m: [] for m in modes}
    p99s: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            times = call_times(llm, text, args.calls)
            p50s[name].append(statistics.median(times))
            p99s[name].append(percentile(times, 0.99))
    load = os.getloadavg()[0]
    print(f"{args.model}, one {num_tokens}-token text, {args.threads} thread(s), load {load:.1f}")
    print(f"{'mode':10} {'p50 ms':>8} {'p99 ms':>8}   per-round p50s")
    for name in modes:
        rounds = " ".join(f"{v:.2f}" for v in p50s[name])
        p50, p99 = statistics.median(p50s[name]), statistics.median(p99s[name])
        print(f"{name:10} {p50:8.2f} {p99:8.2f}   {rounds}")
    if args.stages:
        for name, llm in engines.items():
            print(f"\nstages, {name} (median µs per call, inclusive):")
            for stage, micros in stage_breakdown(llm, text, args.calls).items():
                print(f"  {stage:58} {micros:9.1f}")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        call_times(engines[args.profile], text, args.calls)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(35)


if __name__ == "__main__":
    main()
