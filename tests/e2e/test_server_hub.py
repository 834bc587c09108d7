"""A new user's first command: `tidepool serve <hub id>` downloads only what the load reads from
the Hub (here the test Hub, tests/hub_server.py) and is healthy; the second start, with
HF_HUB_OFFLINE=1 and the Hub gone, loads from the cache."""

from __future__ import annotations

import httpx
import pytest
import torch
import torch.nn.functional as F
from hub_server import DECOYS, folder_files
from serverlib import start_server

from tidepool import LLM
from tidepool.checkpoint.hub import select_files

pytestmark = pytest.mark.slow  # two server starts

TEXTS = ["The tide pool is full of life.", "hi"]


def _embeddings(url: str) -> torch.Tensor:
    answer = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS}, timeout=60.0)
    assert answer.status_code == 200, answer.text
    return torch.tensor([row["embedding"] for row in answer.json()["data"]])


def test_serve_a_hub_id_then_offline_from_the_cache(fake_hub, tmp_path):
    hub = fake_hub.hub
    server = start_server(
        ["org/tiny-st", "--device", "cpu"], tmp_path / "first.log", fake_hub.env()
    )
    try:
        first = _embeddings(server.url)
    finally:
        assert server.stop_gracefully(), server.log()
    assert "model org/tiny-st: from the Hub" in server.log()
    assert sorted(hub.fetched("org/tiny-st")) == select_files(
        list(folder_files(fake_hub.models.v2))
    )
    assert not set(hub.touched("org/tiny-st")) & set(DECOYS)
    expected = LLM(str(fake_hub.models.v2), device="cpu").embed(TEXTS)
    expected = F.normalize(torch.tensor([o.outputs.embedding for o in expected]), dim=-1)
    torch.testing.assert_close(F.normalize(first, dim=-1), expected, rtol=0, atol=1e-6)

    hub.stop()
    env = fake_hub.env(offline=True)
    server = start_server(["org/tiny-st", "--device", "cpu"], tmp_path / "second.log", env)
    try:
        torch.testing.assert_close(_embeddings(server.url), first, rtol=0, atol=0)
    finally:
        assert server.stop_gracefully(), server.log()
    assert "model org/tiny-st: from the Hugging Face cache" in server.log()
