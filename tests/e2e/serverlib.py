"""Helpers for the server tests: a real `tidepool serve` subprocess on 127.0.0.1, or uvicorn in a
thread over an in-process app; one keep-alive connection's requests; a tiny random cross-encoder
built offline; Prometheus text parsing."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

BERT_TOKENIZER_FILES = (
    "vocab.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
STARTUP_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop_gracefully(self, timeout_s: float = 30.0) -> bool:
        """SIGTERM; True if the server drained and exited on its own (uvicorn re-raises the
        signal after a graceful shutdown, so the exit status is -SIGTERM, or 0)."""
        code = self.stop(timeout_s)
        return code in (0, -signal.SIGTERM) and "Application shutdown complete" in self.log()

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(
    args: list[str], log_path: Path, env: dict[str, str] | None = None
) -> ServerProcess:
    """`tidepool serve ARGS --host 127.0.0.1 --port <free>`; returns once /health answers 200."""
    port = free_port()
    command = [sys.executable, "-m", "tidepool.entrypoints.cli", "serve", *args]
    command += ["--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    log = log_path.open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = ServerProcess(process, port, log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"the server did not start in {STARTUP_TIMEOUT_S} s:\n{server.log()}")


def build_tiny_cross_encoder(folder: Path, minilm_path: Path, seed: int = 0) -> Path:
    """A random BertForSequenceClassification (num_labels=1) with MiniLM's tokenizer files."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        type_vocab_size=2,
        num_labels=1,
        initializer_range=0.2,  # far from uniform attention: a bug moves scores visibly
    )
    BertForSequenceClassification(config).save_pretrained(str(folder))
    for name in BERT_TOKENIZER_FILES:
        shutil.copy(minilm_path / name, folder / name)
    return folder


def metric_value(metrics_text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The value of one sample in Prometheus text format (0.0 if absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in (labels or {}).items())
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        series_name, _, series_labels = series.partition("{")
        if series_name != name:
            continue
        if labels is None or series_labels.rstrip("}") == wanted:
            total += float(value)
    return total


# ---------------------------------------------------------------------- in-process server


@dataclass
class ThreadedServer:
    """uvicorn on 127.0.0.1 (a free port) in a thread of this process, over an app whose
    lifespan starts and stops its engine: a real HTTP server whose engine the test can reach."""

    server: object
    thread: threading.Thread
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def connection(self, timeout_s: float = 60.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def start_threaded_server(app) -> ThreadedServer:
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return ThreadedServer(server, thread, port)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


def request_on(
    conn: http.client.HTTPConnection,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> Answer:
    """One request on `conn`'s socket; fails if the server closed (or means to close) it, so a
    sequence of calls proves they all went over the same keep-alive connection."""
    sock_before = conn.sock
    conn.request(method, path, body=body, headers=headers or {})
    response = conn.getresponse()
    payload = response.read()
    assert not response.will_close, f"the server closes the connection after {response.status}"
    assert sock_before is None or conn.sock is sock_before, "a new connection was opened"
    return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, payload)
