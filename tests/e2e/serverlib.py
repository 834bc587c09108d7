"""Helpers for the server tests: a real `tidepool serve` subprocess on 127.0.0.1, a tiny
random cross-encoder built offline, Prometheus text parsing."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
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
