"""One huge text must not starve the other requests (issue 18): while one client sends a 30 MB
text to /v1/embeddings, another sends one sentence every 50 ms; prints the huge request's status
and time and the small requests' latencies (target: every small one under 1 s).

Tokenization is bounded by what is kept (engine/prefix_tokenizer.py) and prompts tokenize on
several input workers (engine/async_engine.py), so the 30 MB text costs what its first tokens
cost plus parsing the body. Loopback only, bounded in time.

    python benchmarks/big_input.py [--megabytes 30] [--truncate]
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import httpx
from serve_process import running_server

WORDS = "the quick brown fox jumps over a lazy dog near the tide pool".split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=int, default=30)
    parser.add_argument("--truncate", action="store_true", help="send truncate_prompt_tokens=-1")
    args = parser.parse_args()
    rng = random.Random(0)
    num_chars = args.megabytes * 1_000_000
    big = " ".join(rng.choice(WORDS) for _ in range(num_chars // 4))[:num_chars]
    body: dict = {"input": big}
    if args.truncate:
        body["truncate_prompt_tokens"] = -1
    with running_server("sentence-transformers/all-MiniLM-L6-v2", []) as url:
        endpoint = f"{url}/v1/embeddings"
        for _ in range(3):  # warm
            httpx.post(endpoint, json={"input": "warm up"}, timeout=60)
        result: dict = {}

        def send_big() -> None:
            start = time.perf_counter()
            response = httpx.post(endpoint, json=body, timeout=300)
            result["status"], result["seconds"] = response.status_code, time.perf_counter() - start

        thread = threading.Thread(target=send_big)
        thread.start()
        latencies = []
        with httpx.Client(timeout=60) as client:
            while thread.is_alive() or not latencies:
                start = time.perf_counter()
                client.post(endpoint, json={"input": "one short sentence."})
                latencies.append(time.perf_counter() - start)
                time.sleep(0.05)
        thread.join()
    print(f"{args.megabytes} MB text: HTTP {result['status']} in {result['seconds']:.2f} s")
    print(
        f"one-sentence requests meanwhile: {len(latencies)}, median "
        f"{statistics.median(latencies) * 1e3:.0f} ms, max {max(latencies) * 1e3:.0f} ms "
        f"({'under' if max(latencies) < 1 else 'OVER'} 1 s)"
    )


if __name__ == "__main__":
    main()
