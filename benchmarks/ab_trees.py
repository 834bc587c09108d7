"""Offline embed speed of two source trees of tidepool, alternated in fresh processes: the check
a refactor must pass ("speed must not change"). Process CPU seconds with one torch thread, so
that a noisy shared machine moves both sides alike; per-round ratios and their median.

    python benchmarks/ab_trees.py /path/to/old/checkout /path/to/new/checkout [--texts 600]
        [--rounds 4] [--modes float32,bfloat16,int8]

Each side runs `python benchmarks/ab_trees.py --worker` with PYTHONPATH=<tree>/src: MiniLM
(bundled), in each mode (float32 and bfloat16 by default; int8: float32 with
quantization="int8"), the corpus' first N texts (truncated to max_model_len), then one 32-token
text 40 times (p50).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(num_texts: int, modes: list[str]) -> dict:
    os.environ.setdefault("TIDEPOOL_NUM_THREADS", "1")
    sys.path.insert(0, str(HERE))
    from corpus import make_corpus

    from tidepool import LLM

    texts = make_corpus(num_texts)
    out = {}
    for dtype in modes:
        llm = LLM(quantization="int8") if dtype == "int8" else LLM(dtype=dtype)
        llm.embed(texts[:64], use_tqdm=False, truncate_prompt_tokens=-1)
        start = time.process_time()
        llm.embed(texts, use_tqdm=False, truncate_prompt_tokens=-1)
        out[f"{dtype} cpu s"] = time.process_time() - start
        for _ in range(5):
            llm.embed([texts[0]], use_tqdm=False)
        times = []
        for _ in range(40):
            start = time.process_time()
            llm.embed([texts[0]], use_tqdm=False)
            times.append(time.process_time() - start)
        out[f"{dtype} one-text ms"] = statistics.median(times) * 1e3
        del llm
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trees", nargs="*", help="old and new checkout")
    parser.add_argument("--texts", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--modes", default="float32,bfloat16", help="float32, bfloat16, int8")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.texts, args.modes.split(","))))
        return
    old, new = args.trees
    ratios: dict[str, list[float]] = {}
    for round_index in range(args.rounds):
        order = [old, new] if round_index % 2 == 0 else [new, old]
        results = {}
        for tree in order:
            env = dict(os.environ, PYTHONPATH=str(Path(tree) / "src"))
            command = [sys.executable, __file__, "--worker", "--texts", str(args.texts)]
            command += ["--modes", args.modes]
            line = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            results[tree] = json.loads(line.stdout.strip().splitlines()[-1])
        for key in results[old]:
            ratios.setdefault(key, []).append(results[new][key] / results[old][key])
        print(
            f"round {round_index + 1}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in ratios.items())
        )
    print("new / old (lower is faster), median of rounds:")
    for key, values in ratios.items():
        print(
            f"  {key:20s} {statistics.median(values):.3f}  (rounds {', '.join(f'{v:.2f}' for v in values)})"
        )


if __name__ == "__main__":
    main()
