"""Admission control on a real HTTP server (uvicorn in a thread, tiny random models): 429 above
--max-concurrent-requests and --max-queued-tokens (with Retry-After, counted in /metrics), 413
above the body / batch limits (and their TEI-named aliases), and a request that outlives
--request-timeout aborted with 503, its KV blocks and scheduler rows freed.

Engine steps are slowed down (a sleep in the model runner) so that requests stay in flight long
enough for the limits to be reached: the outcomes do not depend on the machine's speed.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from serverlib import ThreadedServer, metric_value, start_threaded_server

from tidepool.engine.async_engine import AsyncEngine
from tidepool.entrypoints.cli import build_parser
from tidepool.entrypoints.openai.admission import Admission
from tidepool.entrypoints.openai.server import ServerArgs, build_app

TEXTS = [f"text number {i} about admission control" for i in range(20)]
TOKENS_40 = "word " * 38  # 38 words + [CLS] + [SEP]: 40 tokens with MiniLM's tokenizer
# Another 40-token text: an identical one would join the first's computation (shared work,
# engine/shared_work.py) and queue no tokens of its own.
OTHER_40 = "tide " * 38


def slow_steps(monkeypatch: pytest.MonkeyPatch, engine: AsyncEngine, seconds: float) -> None:
    """Each engine step takes at least `seconds` (the engine thread sleeps before the forward)."""
    runner = engine._core.model_runner
    execute = runner.execute

    def slow_execute(sched_out):
        time.sleep(seconds)
        return execute(sched_out)

    monkeypatch.setattr(runner, "execute", slow_execute)


def wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def assert_error(response: httpx.Response, status: int, words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert words in error["message"], error["message"]
    return error


@pytest.fixture(scope="module")
def embedder_path(tiny_model_path) -> Path:
    return tiny_model_path("bert")


@pytest.fixture(scope="module")
def reference(tiny_llm) -> dict[str, torch.Tensor]:
    outputs = tiny_llm("bert").embed(TEXTS, use_tqdm=False)
    return {t: torch.tensor(o.outputs.embedding) for t, o in zip(TEXTS, outputs, strict=True)}


@dataclass
class Served:
    engine: AsyncEngine
    server: ThreadedServer
    admission: Admission

    @property
    def url(self) -> str:
        return self.server.url


def _serve(path: Path, args, **engine_args) -> Iterator[Served]:
    engine = AsyncEngine.from_args(str(path), device="cpu", dtype="float32", **engine_args)
    app = build_app(engine, args)
    served = Served(engine, start_threaded_server(app), app.state.admission)
    yield served
    served.server.stop()


# ---------------------------------------------------------------------- concurrency


@pytest.fixture(scope="module")
def burst_server(embedder_path: Path) -> Iterator[Served]:
    yield from _serve(embedder_path, ServerArgs(max_concurrent_requests=32))


def test_burst_of_500_gets_200_or_429(burst_server, reference, monkeypatch) -> None:
    engine, server = burst_server.engine, burst_server
    slow_steps(monkeypatch, engine, 0.005)
    before = httpx.get(f"{server.url}/metrics").text

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=500, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=60.0, limits=limits) as client:
            bodies = [{"input": TEXTS[i % len(TEXTS)]} for i in range(500)]
            return await asyncio.gather(*(client.post("/v1/embeddings", json=b) for b in bodies))

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert len(responses) == 500 and set(statuses) <= {200, 429}, sorted(set(statuses))
    num_ok, num_refused = statuses.count(200), statuses.count(429)
    assert num_ok >= 32 and num_refused > 0, (num_ok, num_refused)
    for i, response in enumerate(responses):
        if response.status_code == 200:
            vector = torch.tensor(response.json()["data"][0]["embedding"])
            torch.testing.assert_close(vector, reference[TEXTS[i % len(TEXTS)]], atol=1e-5, rtol=0)
        else:
            error = assert_error(response, 429, "--max-concurrent-requests")
            assert error["type"] == "RateLimitError"
            assert response.headers["retry-after"] == "1"
    after = httpx.get(f"{server.url}/metrics").text
    refused = {"reason": "concurrency"}
    assert (
        metric_value(after, "tidepool:requests_refused_total", refused)
        - metric_value(before, "tidepool:requests_refused_total", refused)
        == num_refused
    )
    assert metric_value(after, "tidepool:num_requests_in_flight") == 0
    assert metric_value(after, "tidepool:num_queued_tokens") == 0
    # Still serving, and probes are never refused.
    again = httpx.post(f"{server.url}/v1/embeddings", json={"input": TEXTS[0]})
    assert again.status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200


# ---------------------------------------------------------------------- queued tokens


@pytest.fixture(scope="module")
def token_server(embedder_path: Path) -> Iterator[Served]:
    yield from _serve(embedder_path, ServerArgs(max_queued_tokens=64))


def _in_background(url: str, body: dict) -> tuple[list[httpx.Response], object]:
    import threading

    answers: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: answers.append(httpx.post(url, json=body, timeout=60.0)), daemon=True
    )
    thread.start()
    return answers, thread


def test_queued_tokens_limit_429_and_413(token_server, monkeypatch) -> None:
    engine, server, admission = token_server.engine, token_server, token_server.admission
    slow_steps(monkeypatch, engine, 0.5)
    answers, thread = _in_background(f"{server.url}/v1/embeddings", {"input": TOKENS_40})
    wait_until(lambda: admission.num_queued_tokens == 40)
    refused = httpx.post(f"{server.url}/v1/embeddings", json={"input": OTHER_40})
    assert_error(refused, 429, "--max-queued-tokens")
    assert refused.headers["retry-after"] == "1"
    too_big = httpx.post(f"{server.url}/v1/embeddings", json={"input": [OTHER_40, "tide " * 39]})
    assert_error(too_big, 413, "more than this server queues at once (64")
    thread.join(30)  # type: ignore[attr-defined]
    assert answers[0].status_code == 200
    assert admission.num_queued_tokens == 0
    text = httpx.get(f"{server.url}/metrics").text
    assert metric_value(text, "tidepool:requests_refused_total", {"reason": "queued_tokens"}) == 1
    assert metric_value(text, "tidepool:requests_refused_total", {"reason": "request_tokens"}) == 1


def test_queued_tokens_released_on_disconnect(token_server, monkeypatch) -> None:
    engine, server, admission = token_server.engine, token_server, token_server.admission
    slow_steps(monkeypatch, engine, 0.5)
    body = json.dumps({"input": TOKENS_40}).encode()
    with socket.create_connection(("127.0.0.1", server.server.port)) as sock:
        sock.sendall(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: admission.num_queued_tokens == 40)
    # The client went away: the request is aborted, its tokens and its permit given back.
    wait_until(lambda: admission.num_queued_tokens == 0 and admission.num_in_flight == 0)
    wait_until(lambda: engine.stats.num_unfinished_requests == 0)
    monkeypatch.undo()
    assert httpx.post(f"{server.url}/v1/embeddings", json={"input": TOKENS_40}).status_code == 200


# ---------------------------------------------------------------------- 413: body and batch size


@pytest.fixture(scope="module")
def size_server(embedder_path: Path) -> Iterator[Served]:
    # The TEI names of the two limits (aliases of --max-request-body-bytes and
    # --max-inputs-per-request), through the real command-line parser.
    argv = ["serve", "--max-input-bytes", "4096", "--max-batch-size", "8"]
    yield from _serve(embedder_path, build_parser().parse_args(argv))


def test_oversized_requests_get_413(size_server: Served) -> None:
    url = f"{size_server.url}/v1/embeddings"
    assert_error(httpx.post(url, json={"input": "x" * 5000}), 413, "--max-input-bytes")
    assert_error(httpx.post(url, json={"input": ["x"] * 9}), 413, "9 items")
    assert_error(
        httpx.post(f"{size_server.url}/rerank", json={"query": "q", "documents": ["d"] * 9}),
        413,
        "documents has 9 items",
    )
    assert httpx.post(url, json={"input": ["x"] * 8}).status_code == 200


# ---------------------------------------------------------------------- request timeout


@pytest.fixture(scope="module")
def timeout_server(tiny_decoder_path) -> Iterator[Served]:
    # One sequence at a time: a second request waits in the scheduler's queue.
    args = ServerArgs(request_timeout_s=0.6)
    yield from _serve(tiny_decoder_path("llama"), args, max_num_seqs=1)


def test_request_past_its_deadline_is_aborted_and_frees_its_blocks(
    timeout_server, monkeypatch
) -> None:
    engine, server, admission = timeout_server.engine, timeout_server, timeout_server.admission
    slow_steps(monkeypatch, engine, 0.05)
    long_generation = {"prompt": "The quick brown fox", "max_tokens": 300, "ignore_eos": True}
    url = f"{server.url}/v1/completions"
    aborted_before = engine.stats.num_aborted_requests

    async def two_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60.0) as client:
            # The second is still queued (max_num_seqs=1) when its deadline passes.
            return await asyncio.gather(
                client.post(url, json=long_generation), client.post(url, json=long_generation)
            )

    for response in asyncio.run(two_at_once()):
        assert_error(response, 503, "--request-timeout of 0.6 s")
        assert response.headers["retry-after"] == "1"
    with httpx.stream("POST", url, json={**long_generation, "stream": True}) as stream:
        assert stream.status_code == 200  # the 200 went out with the stream's first bytes
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: ") :])["error"]["code"] == 503

    # Every aborted request left the scheduler and gave its KV blocks back.
    wait_until(lambda: engine.stats.num_unfinished_requests == 0)
    scheduler = engine._core.scheduler
    assert scheduler.num_running == 0 and scheduler.num_waiting == 0
    assert engine._core.kv_cache_manager.usage == 0.0
    assert engine.stats.num_aborted_requests - aborted_before == 3
    assert admission.num_queued_tokens == 0 and admission.num_in_flight == 0
    text = httpx.get(f"{server.url}/metrics").text
    assert metric_value(text, "tidepool:requests_timed_out_total") == 3
    assert metric_value(text, "tidepool:kv_cache_usage") == 0.0
    short = httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=60.0)
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 2
