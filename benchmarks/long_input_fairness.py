"""One long text must not stall the short requests (issue 26): with chunked processing on, one
client sends a ~200,000-token text to /v1/embeddings while a few others send one-text requests
back to back; prints the short requests' p50 / p99 while the long one runs (target: p99 < 1 s),
the same clients' p50 / p99 with nothing long in flight, and the long request's time.

The encoder scheduler gives a long input's chunks a share of each step (core/scheduler.py), so
a short request waits for at most the step running when it arrives. `--pythonpath DIR` serves
another source tree (e.g. one before the change) for an A/B on the same machine. Loopback only.

    python benchmarks/long_input_fairness.py [--tokens 200000] [--clients 4] [--pythonpath DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

import httpx
from serve_process import running_server_process

WORDS = "the quick brown fox jumps over a lazy dog near the tide pool".split()
MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def _percentiles(latencies: list[float]) -> str:
    if not latencies:
        return "no requests"
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return (
        f"{len(ordered)} requests, p50 {statistics.median(ordered) * 1e3:.0f} ms, "
        f"p99 {p99 * 1e3:.0f} ms, max {ordered[-1] * 1e3:.0f} ms"
    )


def _short_clients(url: str, num_clients: int, stop: threading.Event) -> list[float]:
    """`num_clients` threads, each sending one-text requests back to back until `stop`."""
    latencies: list[float] = []
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=600) as http:
            while not stop.is_set():
                text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))
                start = time.perf_counter()
                answer = http.post(f"{url}/v1/embeddings", json={"input": text})
                elapsed = time.perf_counter() - start
                assert answer.status_code == 200, answer.text
                with lock:
                    latencies.append(elapsed)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(num_clients)]
    for thread in threads:
        thread.start()
    stop.wait()
    for thread in threads:
        thread.join()
    return latencies


def _measure(url: str, args: argparse.Namespace, long_text: str | None) -> tuple[list[float], str]:
    stop = threading.Event()
    result: dict[str, list[float]] = {}
    runner = threading.Thread(
        target=lambda: result.setdefault("short", _short_clients(url, args.clients, stop))
    )
    runner.start()
    if long_text is None:
        time.sleep(args.baseline_s)
        report = f"{args.baseline_s:.0f} s, nothing long in flight"
    else:
        time.sleep(0.5)  # the short clients are running
        start = time.perf_counter()
        answer = httpx.post(f"{url}/v1/embeddings", json={"input": long_text}, timeout=3600)
        elapsed = time.perf_counter() - start
        assert answer.status_code == 200, answer.text[:300]
        tokens = answer.json()["usage"]["prompt_tokens"]
        report = f"the long text: {tokens:,} tokens in {elapsed:.1f} s ({tokens / elapsed:,.0f}/s)"
    stop.set()
    runner.join()
    return result["short"], report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=200_000, help="words in the long text")
    parser.add_argument("--clients", type=int, default=4, help="one-text clients")
    parser.add_argument("--baseline-s", type=float, default=10.0)
    parser.add_argument("--pythonpath", default=None, help="serve this source tree instead")
    args = parser.parse_args()
    rng = random.Random(0)
    long_text = " ".join(rng.choice(WORDS) for _ in range(args.tokens))
    pooler = {"enable_chunked_processing": True, "max_embed_len": 300_000}
    env = {"PYTHONPATH": args.pythonpath} if args.pythonpath else None
    server_args = ["--pooler-config", json.dumps(pooler)]
    with running_server_process(MODEL, server_args, env) as (url, _pid):
        for _ in range(3):  # warm up
            httpx.post(f"{url}/v1/embeddings", json={"input": "warm up"}, timeout=60)
        alone, report = _measure(url, args, None)
        print(f"short requests, {args.clients} clients, {report}: {_percentiles(alone)}")
        during, report = _measure(url, args, long_text)
        print(f"short requests, {args.clients} clients, while {report}: {_percentiles(during)}")


if __name__ == "__main__":
    main()
