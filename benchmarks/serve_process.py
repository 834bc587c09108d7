"""`tidepool serve` in a subprocess on 127.0.0.1, for the server benchmarks (serve_load.py,
serve_generate.py). The tests have their own, which also captures the log (tests/e2e/serverlib.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server(model: str, extra_args: list[str]) -> Iterator[str]:
    """`tidepool serve MODEL EXTRA_ARGS` on a free port: yields its URL once /health answers 200,
    then stops it with SIGTERM (a graceful drain). Exits the script if the server does not start."""
    with running_server_process(model, extra_args) as (url, _pid):
        yield url


@contextmanager
def running_server_process(
    model: str, extra_args: list[str], env: dict[str, str] | None = None
) -> Iterator[tuple[str, int]]:
    """`running_server`, yielding the URL and the server's process id (soak.py reads its RSS).
    `env`: variables set for the server on top of this process's (e.g. a PYTHONPATH, to serve
    another source tree side by side)."""
    port = free_port()
    command = [sys.executable, "-m", "tidepool.entrypoints.cli", "serve", model, "--host",
               "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log",
               "--uvicorn-log-level", "warning", *extra_args]  # fmt: skip
    process = subprocess.Popen(command, env={**os.environ, **env} if env else None)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            process.kill()
            raise SystemExit("the server did not start")
        time.sleep(0.3)
    try:
        yield url, process.pid
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
