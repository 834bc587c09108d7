"""Every environment variable tidepool reads, in one place."""

from __future__ import annotations

import os


def device() -> str | None:
    """TIDEPOOL_DEVICE: force a torch device ("cpu", "cuda:1"); default: CUDA when present."""
    return os.environ.get("TIDEPOOL_DEVICE") or None


def num_threads() -> int | None:
    """TIDEPOOL_NUM_THREADS: torch intra-op threads; default: all the cores this process may use."""
    value = os.environ.get("TIDEPOOL_NUM_THREADS")
    return int(value) if value else None


def api_key() -> str | None:
    """TIDEPOOL_API_KEY: the server's API key when `tidepool serve` gets no --api-key."""
    return os.environ.get("TIDEPOOL_API_KEY") or None
