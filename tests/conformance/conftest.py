"""Fixtures of the vLLM conformance suite: tiny models (tests/conftest.py) and one in-process
server per module (tests/e2e/serverlib.py's threaded uvicorn)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
