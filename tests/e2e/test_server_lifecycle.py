"""`tidepool serve` and SIGTERM: the request in flight is answered in full, then the process exits."""

from __future__ import annotations

import threading
import time

import httpx
from serverlib import metric_value, start_server


def test_sigterm_drains_in_flight_requests_then_exits(tmp_path) -> None:
    # 500-token steps: 24 texts of ~250 tokens take ~12 steps, seconds of work to interrupt.
    server = start_server(["--max-num-batched-tokens", "512"], tmp_path / "server.log")
    texts = [f"{i} " + "lorem ipsum dolor " * 60 for i in range(24)]
    result: dict[str, httpx.Response] = {}

    def post() -> None:
        body = {"input": texts, "truncate_prompt_tokens": 250}
        result["response"] = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=120)

    client = threading.Thread(target=post)
    try:
        client.start()
        deadline = time.monotonic() + 30
        while not _num_unfinished(server.url):
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.02)
        assert server.stop_gracefully(timeout_s=60), server.log()
        client.join(60)
    finally:
        server.stop()
    response = result["response"]
    assert response.status_code == 200, response.text
    assert len(response.json()["data"]) == len(texts)
    assert "Traceback" not in server.log()


def _num_unfinished(url: str) -> float:
    return metric_value(httpx.get(f"{url}/metrics").text, "tidepool:num_requests_unfinished")


def test_request_cut_by_the_shutdown_timeout_answers_503(tmp_path) -> None:
    # 200 texts of ~250 tokens in 512-token steps: ~100 steps, far more than a 1 s timeout.
    args = ["--max-num-batched-tokens", "512", "--shutdown-timeout", "1"]
    server = start_server(args, tmp_path / "server.log")
    texts = [f"{i} " + "lorem ipsum dolor " * 60 for i in range(200)]
    result: dict[str, httpx.Response] = {}

    def post() -> None:
        body = {"input": texts, "truncate_prompt_tokens": 250}
        result["response"] = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=120)

    client = threading.Thread(target=post)
    try:
        client.start()
        deadline = time.monotonic() + 30
        while not _num_unfinished(server.url):
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.02)
        assert server.stop_gracefully(timeout_s=60), server.log()
        client.join(60)
    finally:
        server.stop()
    response = result["response"]
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    assert "--shutdown-timeout" in error["message"]
    assert "Traceback" not in server.log()
