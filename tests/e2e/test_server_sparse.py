"""Sparse, multi-vector and per-token routes: TEI's /embed_sparse, /pooling with embed_sparse /
token_embed / token_classify, /classify on a token classifier; each equal to the offline LLM.

uvicorn runs in a thread over apps on tiny random models (SPLADE, BGE-M3, a BERT token
classifier, the tiny BERT embedder for the refusals)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from serverlib import ThreadedServer, request_on, start_threaded_server
from sparse_models import NER_LABELS, save_bge_m3, save_splade, save_token_classifier

from tidepool import LLM
from tidepool.outputs import sparse_pairs

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "what is the capital?"]


def _serve(path) -> tuple[ThreadedServer, LLM]:
    from tidepool.engine.async_engine import AsyncEngine
    from tidepool.entrypoints.openai.server import ServerArgs, build_app

    engine = AsyncEngine.from_args(str(path), device="cpu", dtype="float32")
    return start_threaded_server(build_app(engine, ServerArgs())), engine


@pytest.fixture(scope="module")
def servers(tmp_path_factory, minilm_path, tiny_model_path) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("sparse_servers")
    paths = {
        "splade": save_splade(root / "splade", minilm_path, 150, "max"),
        "bge_m3": save_bge_m3(root / "bge_m3"),
        "ner": save_token_classifier("bert", root / "ner", minilm_path),
        "dense": tiny_model_path("bert"),
    }
    running = {name: (_serve(path)[0], path) for name, path in paths.items()}
    yield running
    for server, _ in running.values():
        server.stop()


@pytest.fixture(scope="module")
def offline(servers):
    engines: dict[str, LLM] = {}

    def get(name: str) -> LLM:
        if name not in engines:
            engines[name] = LLM(str(servers[name][1]), device="cpu", dtype="float32")
        return engines[name]

    return get


def post(servers, name: str, path: str, body: dict):
    conn = servers[name][0].connection()
    try:
        answer = request_on(
            conn, "POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
    finally:
        conn.close()
    return answer.status, answer.json()


def _pairs(values: list[dict]) -> dict[int, float]:
    return {v["index"]: v["value"] for v in values}


@pytest.mark.parametrize("name", ["splade", "bge_m3"])
def test_embed_sparse_is_tei_shaped_and_equals_offline(name, servers, offline):
    status, body = post(servers, name, "/embed_sparse", {"inputs": TEXTS})
    assert status == 200, body
    assert isinstance(body, list) and len(body) == len(TEXTS)
    expected = offline(name).embed_sparse(TEXTS, use_tqdm=False)
    for got, want in zip(body, expected, strict=True):
        assert all(set(v) == {"index", "value"} for v in got)
        assert [v["index"] for v in got] == want.outputs.indices
        assert _pairs(got) == pytest.approx(want.outputs.as_dict(), abs=1e-6)
    status, one = post(servers, name, "/embed_sparse", {"inputs": TEXTS[0], "max_active_dims": 2})
    assert status == 200 and len(one) == 1 and len(one[0]) <= 2


def test_pooling_embed_sparse_and_token_tasks(servers, offline):
    status, body = post(servers, "bge_m3", "/pooling", {"input": TEXTS, "task": "embed_sparse"})
    assert status == 200, body
    llm = offline("bge_m3")
    for item, text in zip(body["data"], TEXTS, strict=True):
        ids, values = sparse_pairs(llm.encode([text], pooling_task="embed_sparse")[0].outputs.data)
        assert _pairs(item["data"]) == pytest.approx(dict(zip(ids, values, strict=True)))
    for task in ("token_embed", "token_classify"):
        status, body = post(servers, "bge_m3", "/pooling", {"input": TEXTS[1], "task": task})
        assert status == 200, body
        expected = llm.encode([TEXTS[1]], pooling_task=task, use_tqdm=False)[0].outputs.data
        torch.testing.assert_close(torch.tensor(body["data"][0]["data"]), expected)


def test_token_classifier_on_pooling_and_classify(servers, offline):
    expected = offline("ner").encode(TEXTS, pooling_task="token_classify", use_tqdm=False)
    status, body = post(servers, "ner", "/pooling", {"input": TEXTS})
    assert status == 200, body
    for item, want in zip(body["data"], expected, strict=True):
        torch.testing.assert_close(torch.tensor(item["data"]), want.outputs.data)
    status, body = post(servers, "ner", "/classify", {"input": TEXTS})
    assert status == 200, body
    for item, want in zip(body["data"], expected, strict=True):
        probs = want.outputs.data
        assert item["num_classes"] == len(NER_LABELS)
        torch.testing.assert_close(torch.tensor(item["probs"]), probs)
        assert item["label"] == [NER_LABELS[i] for i in probs.argmax(-1).tolist()]


def test_sparse_on_a_dense_model_is_a_400(servers):
    status, body = post(servers, "dense", "/embed_sparse", {"inputs": "x"})
    assert status == 400 and "embed_sparse" in body["error"]["message"]
    status, body = post(servers, "dense", "/pooling", {"input": "x", "task": "embed_sparse"})
    assert status == 400 and "embed_sparse" in body["error"]["message"]
    status, body = post(servers, "dense", "/pooling", {"input": "x", "task": "token_classify"})
    assert status == 400
    status, body = post(servers, "splade", "/embed_sparse", {"inputs": ["a", ""]})
    assert status == 400 and body["error"]["param"] == "inputs"
    status, body = post(servers, "splade", "/embed_sparse", {"inputs": "a", "max_active_dims": 0})
    assert status == 400 and "max_active_dims" in body["error"]["message"]
