"""Ray Data scaling: rows/s of 1 and 2 actors vs one engine in this process (fixed-seed corpus).

Configurations (a local Ray cluster of --cpus CPUs is started here):

    local   LLM.embed in this process, --cpus torch threads, no Ray (the peer)
    1x2     1 actor with 2 threads            (one engine using the whole 2-core machine)
    2x1     2 actors with 1 thread each       (two engines side by side)
    1x1     1 actor with 1 thread             (the unit that 2x1 doubles)

Every round runs each configuration once, in turn, so the machine's noise hits all of them;
the medians over rounds are printed. Two rates per Ray job:

    steady  rows / (last batch end - first batch start), timed inside the actors: the engines
            at work, without starting actors and loading the model
    job     rows / wall time of the whole `take_all()`, startup included (what a short job sees)

    python benchmarks/ray_scaling.py [--texts 2000] [--rounds 3] [--batch-size 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from corpus import make_corpus  # noqa: E402

from tidepool.ray import Predictor  # noqa: E402

CONFIGS = {"1x2": (1, 2), "2x1": (2, 1), "1x1": (1, 1)}  # name → (actors, threads per actor)


class TimedPredictor(Predictor):
    """Predictor that stamps each output row with its batch's start and end (wall clock)."""

    def __call__(self, batch):
        import pyarrow as pa

        start = time.time()
        out = super().__call__(batch)
        num_rows = out.num_rows
        stamps = {"t_start": start, "t_end": time.time()}
        for name, value in stamps.items():
            out = out.append_column(name, pa.array([value] * num_rows, pa.float64()))
        return out


@dataclass
class Rates:
    steady: float
    job: float


def run_ray(texts: list[str], actors: int, threads: int, batch_size: int, model: str) -> Rates:
    import ray

    ds = ray.data.from_items([{"id": i, "text": t} for i, t in enumerate(texts)])
    out = ds.map_batches(
        TimedPredictor,
        fn_constructor_kwargs={"model": model, "num_threads": threads},
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_cpus=threads,
        batch_size=batch_size,
        batch_format="pyarrow",
    ).select_columns(["id", "error", "t_start", "t_end"])
    start = time.perf_counter()
    rows = out.take_all()
    wall = time.perf_counter() - start
    assert sorted(r["id"] for r in rows) == list(range(len(texts)))
    assert all(r["error"] is None for r in rows)
    busy = max(r["t_end"] for r in rows) - min(r["t_start"] for r in rows)
    return Rates(steady=len(texts) / busy, job=len(texts) / wall)


def run_local(llm, texts: list[str]) -> Rates:
    start = time.perf_counter()
    llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
    rate = len(texts) / (time.perf_counter() - start)
    return Rates(steady=rate, job=rate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)  # embed_dataset's default
    parser.add_argument("--cpus", type=int, default=2)
    args = parser.parse_args()

    import ray
    import torch

    from tidepool import LLM

    texts = make_corpus(args.texts, seed=0)
    torch.set_num_threads(args.cpus)
    llm = LLM(args.model)
    llm.embed(texts[:32], use_tqdm=False)  # warm-up: first-call allocations are not throughput
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    print(f"{len(texts)} texts, seed 0; {args.cpus} CPUs; load average {os.getloadavg()[0]:.1f}")

    results: dict[str, list[Rates]] = {name: [] for name in ["local", *CONFIGS]}
    for round_index in range(args.rounds):
        results["local"].append(run_local(llm, texts))
        for name, (actors, threads) in CONFIGS.items():
            results[name].append(run_ray(texts, actors, threads, args.batch_size, args.model))
        line = ", ".join(f"{n} {r[-1].steady:.0f}/{r[-1].job:.0f}" for n, r in results.items())
        load = os.getloadavg()[0]  # other work on the machine shows up here
        print(f"round {round_index + 1}: steady/job rows/s: {line}; load average {load:.1f}")
    ray.shutdown()
    _report(results)


def _report(results: dict[str, list[Rates]]) -> None:
    steady = {n: statistics.median(r.steady for r in rates) for n, rates in results.items()}
    job = {n: statistics.median(r.job for r in rates) for n, rates in results.items()}
    print(f"\n{'config':<8}{'steady rows/s':>15}{'job rows/s':>12}{'steady vs local':>17}")
    for name in results:
        print(
            f"{name:<8}{steady[name]:>15.0f}{job[name]:>12.0f}{steady[name] / steady['local']:>16.2f}x"
        )

    def ratio(a: str, b: str) -> float:
        return float(
            np.median([x.steady / y.steady for x, y in zip(results[a], results[b], strict=True)])
        )

    print(
        f"\n2 actors x 1 thread vs 1 actor x 1 thread (median of rounds): {ratio('2x1', '1x1'):.2f}x"
    )
    print(f"2 actors x 1 thread vs 1 actor x 2 threads: {ratio('2x1', '1x2'):.2f}x")


if __name__ == "__main__":
    main()
