"""tidepool int8 vs float32 vs bfloat16 in one process: corpus throughput and one-text latency.
"int8-onednn" is the int8 mode on oneDNN's GEMM + the epilogue kernels (TIDEPOOL_INT8_GEMM=onednn
at its load), "int8" on tidepool's own GEMM where the CPU has one (AMX, else VNNI).

The three engines load once; each round embeds the same corpus texts with each engine in turn
(alternating, so machine noise hits every side alike), and the figures are medians over rounds,
with each side's per-round ratio to float32 (median). Then the p50 of one 32-token text per mode.

    python benchmarks/int8_speed.py [--model PATH] [--texts 1000] [--rounds 3] [--threads 2]
        [--modes float32,bfloat16,int8-onednn,int8] [--cpu-time]

--cpu-time (with --threads 1) times by the engine thread's CPU time: on a loaded machine it leaves
out the time that thread was descheduled.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus import make_corpus  # noqa: E402
from one_text import text_of_tokens  # noqa: E402

MODES = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "int8-onednn": {"quantization": "int8"},
    "int8": {"quantization": "int8"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--latency-calls", type=int, default=50)
    parser.add_argument("--modes", default=",".join(MODES), help="float32 first")
    parser.add_argument("--cpu-time", action="store_true", help="thread CPU time (1 thread)")
    args = parser.parse_args()
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time measures the calling thread: it needs --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    os.environ.setdefault("TIDEPOOL_NUM_THREADS", str(args.threads))
    from tidepool import LLM
    from tidepool.kernels import cpu_features

    print(f"CPU: {cpu_features.describe()}; {'CPU' if args.cpu_time else 'wall'} time")
    engines = {}
    for name in args.modes.split(","):
        if name == "int8-onednn":
            os.environ["TIDEPOOL_INT8_GEMM"] = "onednn"
        engines[name] = LLM(model=args.model, **MODES[name])
        os.environ.pop("TIDEPOOL_INT8_GEMM", None)
        kernels = {
            r.split("kernels=")[1].rstrip(")") for r in map(repr, _int8_layers(engines[name]))
        }
        if kernels:
            print(f"{name}: int8 linears' kernels: {', '.join(sorted(kernels))}")
    limit = engines["float32"].model_config.max_model_len
    texts = make_corpus(args.texts)
    tokenizer = engines["float32"].get_tokenizer()
    num_tokens = sum(
        len(ids) for ids in tokenizer(texts, truncation=True, max_length=limit)["input_ids"]
    )
    for llm in engines.values():  # warm-up: primitives for the corpus' step shapes
        llm.embed(texts, use_tqdm=False, truncate_prompt_tokens=limit)
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            start = clock()
            llm.embed(texts, use_tqdm=False, truncate_prompt_tokens=limit)
            seconds[name].append(clock() - start)
    print(f"{args.model}, {len(texts)} texts ({num_tokens} tokens), {args.threads} thread(s)")
    print(f"{'mode':10} {'tokens/s':>10} {'vs float32':>11} {'one 32-token text p50':>22}")
    text32 = text_of_tokens(tokenizer, 32)
    for name, llm in engines.items():
        ratio = statistics.median(
            f / s for f, s in zip(seconds["float32"], seconds[name], strict=True)
        )
        p50 = _latency_p50(llm, text32, args.latency_calls)
        tokens_per_s = num_tokens / statistics.median(seconds[name])
        print(f"{name:10} {tokens_per_s:10.0f} {ratio:10.2f}x {p50 * 1e3:19.1f} ms")


def _int8_layers(llm) -> list:
    from tidepool.quantization.int8_linear import Int8Linear

    model = llm.engine.model_runner.model
    return [m for m in model.modules() if isinstance(m, Int8Linear)]


def _latency_p50(llm, text: str, calls: int) -> float:
    llm.embed([text], use_tqdm=False)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        llm.embed([text], use_tqdm=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


if __name__ == "__main__":
    main()
