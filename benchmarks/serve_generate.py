"""Generation behind the server vs offline `LLM.generate`, same model, same prompts, same run.

N concurrent clients (default 32) stream completions (`/v1/completions`, `stream: true`, greedy,
EOS ignored, --max-tokens each) from a `tidepool serve` this script starts on the small random
Llama of benchmarks/random_decoder.py; the offline side generates the same prompts in one
`LLM.generate` call in this process. The sides run alternately (A B A B ...); the ratio quoted is
the median of the per-round ratios (server tokens/s ÷ offline tokens/s). Every streamed text is
checked against the offline text, so a lost, cut or reordered delta fails the run. Also printed:
time to first token and the gap between deltas, as the clients see them.

    python benchmarks/serve_generate.py [--clients 32] [--requests 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

# tidepool sets OpenMP's wait policy when imported, before torch loads (random_decoder imports
# torch): the offline side must run under the same policy as the server.
import tidepool  # noqa: F401

# isort: split
import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from corpus import make_corpus  # noqa: E402
from random_decoder import build_random_decoder  # noqa: E402
from serve_process import running_server  # noqa: E402


async def _load(url: str, prompts: list[str], max_tokens: int, num_clients: int, stream: bool):
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    texts: list[str | None] = [None] * len(prompts)
    first_token_s: list[float] = []
    gaps_s: list[float] = []
    limits = httpx.Limits(max_connections=num_clients, max_keepalive_connections=num_clients)

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            body = {"prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "stream": stream}  # fmt: skip
            parts = []
            last = time.perf_counter()
            if not stream:
                response = await http.post("/v1/completions", json=body)
                response.raise_for_status()
                first_token_s.append(time.perf_counter() - last)  # here: the whole request
                texts[i] = response.json()["choices"][0]["text"]
                continue
            async with http.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    (first_token_s if not parts else gaps_s).append(now - last)
                    last = now
                    parts.append(json.loads(line[6:])["choices"][0]["text"])
            texts[i] = "".join(parts)

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(num_clients)))
        seconds = time.perf_counter() - start
    return seconds, texts, first_token_s, gaps_s


def run_offline(llm, prompts: list[str], max_tokens: int) -> tuple[float, list[str]]:
    from tidepool import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].text for o in outs]


def _ms(values: list[float], q: float) -> str:
    return f"{np.percentile(np.asarray(values), q) * 1000:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=60, help="prompts cut to this many")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--no-stream", action="store_true", help="plain JSON answers instead")
    args = parser.parse_args()

    from tidepool import LLM

    path = build_random_decoder("LlamaForCausalLM")
    prompts = [" ".join(t.split()[: args.prompt_words]) for t in make_corpus(args.requests, 3)]
    num_tokens = len(prompts) * args.max_tokens
    kind = "JSON" if args.no_stream else "streaming"
    print(f"{len(prompts)} requests x {args.max_tokens} tokens, {args.clients} {kind} clients; "
          f"model {path.name} {args.dtype}")  # fmt: skip
    with running_server(str(path), ["--dtype", args.dtype]) as url:
        llm = LLM(str(path), dtype=args.dtype)
        run_offline(llm, prompts[:4], 8)  # warm-up both sides
        asyncio.run(_load(url, prompts[:4], 8, 4, not args.no_stream))
        ratios = []
        for round_index in range(args.rounds):
            offline_s, expected = run_offline(llm, prompts, args.max_tokens)
            server_s, texts, first_s, gaps_s = asyncio.run(
                _load(url, prompts, args.max_tokens, args.clients, not args.no_stream)
            )
            num_differ = sum(a != b for a, b in zip(texts, expected, strict=True))
            if num_differ:
                raise SystemExit(f"{num_differ} streamed texts differ from the offline ones")
            ratios.append(offline_s / server_s)
            latency = (
                f"request p50 {_ms(first_s, 50)} ms p99 {_ms(first_s, 99)} ms"
                if args.no_stream
                else f"first token p50 {_ms(first_s, 50)} ms p99 {_ms(first_s, 99)} ms, between "
                f"deltas p50 {_ms(gaps_s, 50)} ms p99 {_ms(gaps_s, 99)} ms"
            )
            print(
                f"round {round_index + 1}: offline {num_tokens / offline_s:7.1f} tok/s | server "
                f"{num_tokens / server_s:7.1f} tok/s, {latency} | ratio {ratios[-1]:.3f} | "
                "texts equal",
                flush=True,
            )
        print(f"median ratio server/offline over {args.rounds} rounds: "
              f"{statistics.median(ratios):.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
