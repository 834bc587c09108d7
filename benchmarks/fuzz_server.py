"""Hostile requests against a real `tidepool serve`: N fuzzed bodies over every pooling route,
counted by status. The invariant (issue 18): a 2xx or a 4xx in OpenAI's error shape, never a 5xx,
and the keep-alive connection keeps serving. tests/e2e/test_server_fuzz.py checks the same with
hypothesis on tiny models in CI; this runs many more requests on the bundled MiniLM.

Each body is a valid one with some fields replaced by hostile values (lone surrogates, NUL,
control characters, RTL marks, combining marks, huge strings, wrong types, deep nesting, token
ids out of range), from a seeded RNG, so a run is repeatable. Loopback only, bounded in count.

    python benchmarks/fuzz_server.py [--requests 10000] [--seed 0] [--url http://127.0.0.1:PORT]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time

import httpx
from serve_process import running_server

TEXTS = [
    "",
    " ",
    "\x00",
    "a\x00b",
    "\ud800",
    "abc \udfff",
    "\udc00\ud800 x",
    "e\u0301\u0301\u0301",
    "\u202eevil\u202c",
    "שלום עולם",
    "\t\n\r\x0b\x0c\x85",
    "\x1b[31mred",
    "\ufeffbom",
    "\uffff\ufffe",
    "\U0010ffff",
    "🙂" * 50,
    "[CLS] [SEP] [PAD] <s> </s>",
    "word " * 600,
    "a tide pool at dawn",
]
SCALARS = [None, True, False, 0, -1, 1, 2**31, -(2**63), 2**70, 1.5, float("nan"), "8", "yes"]


def _hostile(rng: random.Random, depth: int = 0) -> object:
    roll = rng.random()
    if roll < 0.45:
        return rng.choice(TEXTS)
    if roll < 0.6:
        return rng.choice(SCALARS)
    if roll < 0.7:
        return "x" * rng.choice([10_000, 300_000, 1_000_000])
    if roll < 0.8:
        return [rng.randint(-5, 40_000) for _ in range(rng.randint(0, 8))]
    if depth < 3 and roll < 0.9:
        return [_hostile(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if depth < 3:
        return {rng.choice(TEXTS): _hostile(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return rng.choice(TEXTS)


def _valid(route: str, rng: random.Random) -> dict:
    text = rng.choice(TEXTS[-3:])
    return {
        "/v1/embeddings": {"input": [text, "another one"], "encoding_format": "float"},
        "/pooling": {"input": text, "task": "embed"},
        "/classify": {"input": text},
        "/score": {"text_1": "query", "text_2": [text, "doc"]},
        "/rerank": {"query": "query", "documents": [text, "doc"], "top_n": 1},
        "/v1/rerank": {"query": "query", "documents": [text]},
        "/tokenize": {"prompt": text},
        "/detokenize": {"tokens": [101, 2000, 102]},
    }[route]


FIELDS = {
    "/v1/embeddings": ["input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens"],
    "/pooling": ["input", "task", "dimensions", "normalize", "truncate_prompt_tokens"],
    "/classify": ["input", "truncate_prompt_tokens", "activation"],
    "/score": ["text_1", "text_2", "truncate_prompt_tokens"],
    "/rerank": ["query", "documents", "top_n", "return_documents"],
    "/v1/rerank": ["query", "documents", "top_n"],
    "/tokenize": ["prompt", "add_special_tokens", "messages"],
    "/detokenize": ["tokens"],
}


def fuzz_body(rng: random.Random) -> tuple[str, bytes, str]:
    route = rng.choice(list(FIELDS))
    body: object = _valid(route, rng)
    roll = rng.random()
    if roll < 0.05:
        return route, b"", "application/json"
    if roll < 0.1:
        return route, b"{not json", "application/json"
    if roll < 0.15:
        body = _hostile(rng)
    else:
        assert isinstance(body, dict)
        fields = FIELDS[route]
        for field in rng.sample(fields, rng.randint(1, min(2, len(fields)))):
            body[field] = _hostile(rng)
    raw = json.dumps(body, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
    content_type = "application/json" if rng.random() < 0.9 else "application/x-www-form-urlencoded"
    return route, raw, content_type


def run(url: str, num_requests: int, seed: int) -> int:
    rng = random.Random(seed)
    statuses: collections.Counter[int] = collections.Counter()
    bad: list[str] = []
    start = time.perf_counter()
    with httpx.Client(base_url=url, timeout=120) as client:
        for i in range(num_requests):
            route, raw, content_type = fuzz_body(rng)
            response = client.post(route, content=raw, headers={"content-type": content_type})
            statuses[response.status_code] += 1
            if response.status_code >= 500 or (
                400 <= response.status_code < 500 and "error" not in response.json()
            ):
                bad.append(f"#{i} {route} {response.status_code} {response.text[:200]}")
            if i % 500 == 0 and client.get("/health").status_code != 200:
                bad.append(f"#{i} /health failed")
    seconds = time.perf_counter() - start
    print(f"{num_requests} requests in {seconds:.0f} s; statuses: {dict(sorted(statuses.items()))}")
    print(f"5xx or malformed errors: {len(bad)}")
    for line in bad[:20]:
        print("  ", line)
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="a running server; default: start `tidepool serve`")
    args = parser.parse_args()
    if args.url:
        return run(args.url, args.requests, args.seed)
    with running_server("sentence-transformers/all-MiniLM-L6-v2", []) as url:
        return run(url, args.requests, args.seed)


if __name__ == "__main__":
    sys.exit(main())
