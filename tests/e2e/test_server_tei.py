"""text-embeddings-inference's native routes on real servers (uvicorn in a thread) started with
--api-style tei: /embed, /embed_all, /rerank, /predict, /tokenize in TEI's request and response
shapes, results equal to the offline LLM, every bad input a 4xx in TEI's error shape."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serverlib import start_threaded_server

from tidepool.params import PoolingParams

TEXTS = ["a tide pool at dawn", "the rocks are wet", "crabs hide under weed"]
LONG_TEXT = " ".join(f"word{i}" for i in range(400))
TEI_ERROR_KEYS = {"error", "error_type"}


def _serve(path, api_style: str = "tei"):
    from tidepool.engine.async_engine import AsyncEngine
    from tidepool.entrypoints.openai.server import ServerArgs, build_app

    engine = AsyncEngine.from_args(str(path), device="cpu", dtype="float32")
    return start_threaded_server(build_app(engine, ServerArgs(api_style=api_style)))


@pytest.fixture(scope="module")
def clients(tiny_model_path) -> Iterator[dict[str, httpx.Client]]:
    kinds = {"embed": "bert", "rerank": "bert-cross-encoder", "predict": "roberta-classifier"}
    servers = {role: _serve(tiny_model_path(kind)) for role, kind in kinds.items()}
    opened = {role: httpx.Client(base_url=s.url, timeout=60.0) for role, s in servers.items()}
    yield opened
    for role, server in servers.items():
        opened[role].close()
        server.stop()


def assert_tei_error(answer: httpx.Response, status: int, word: str = "") -> None:
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert set(body) == TEI_ERROR_KEYS and body["error_type"] == "Validation"
    assert word in body["error"], body["error"]


def test_embed(clients, tiny_llm) -> None:
    offline = tiny_llm("bert")
    http = clients["embed"]
    expected = np.array([o.outputs.embedding for o in offline.embed(TEXTS, use_tqdm=False)])
    body = http.post("/embed", json={"inputs": TEXTS}).json()
    assert np.allclose(body, expected, atol=1e-6)
    single = http.post("/embed", json={"inputs": TEXTS[0]}).json()
    assert len(single) == 1 and np.allclose(single[0], expected[0], atol=1e-6)
    raw = http.post("/embed", json={"inputs": TEXTS[0], "normalize": False}).json()[0]
    assert not np.isclose(np.linalg.norm(raw), 1.0) and np.allclose(
        raw / np.linalg.norm(raw), expected[0], atol=1e-5
    )
    assert len(http.post("/embed", json={"inputs": TEXTS[0], "dimensions": 8}).json()[0]) == 8
    assert_tei_error(http.post("/embed", json={"inputs": LONG_TEXT}), 400, "128")
    left = http.post(
        "/embed", json={"inputs": LONG_TEXT, "truncate": True, "truncation_direction": "Left"}
    )
    right = http.post("/embed", json={"inputs": LONG_TEXT, "truncate": True})
    params = PoolingParams(truncate_prompt_tokens=-1, truncation_side="left")
    reference = offline.embed([LONG_TEXT], use_tqdm=False, pooling_params=params)[
        0
    ].outputs.embedding
    assert np.allclose(left.json()[0], reference, atol=1e-6)
    assert not np.allclose(left.json()[0], right.json()[0], atol=1e-3)


def test_embed_all(clients, tiny_llm) -> None:
    offline = tiny_llm("bert")
    body = clients["embed"].post("/embed_all", json={"inputs": TEXTS[:2]}).json()
    expected = offline.encode(TEXTS[:2], pooling_task="token_embed", use_tqdm=False)
    assert len(body) == 2
    for tokens, out in zip(body, expected, strict=True):
        assert np.allclose(tokens, out.outputs.data.numpy(), atol=1e-6)


def test_rerank(clients, tiny_llm) -> None:
    offline = tiny_llm("bert-cross-encoder")
    http = clients["rerank"]
    expected = [o.outputs.score for o in offline.score(TEXTS[0], TEXTS, use_tqdm=False)]
    order = sorted(range(len(TEXTS)), key=lambda i: -expected[i])
    body = http.post("/rerank", json={"query": TEXTS[0], "texts": TEXTS}).json()
    assert [r["index"] for r in body] == order
    assert all(set(r) == {"index", "score"} for r in body)
    assert np.allclose([r["score"] for r in body], [expected[i] for i in order], atol=1e-5)
    with_text = http.post(
        "/rerank", json={"query": TEXTS[0], "texts": TEXTS, "return_text": True, "top_n": 2}
    ).json()
    assert [(r["index"], r["text"]) for r in with_text] == [(i, TEXTS[i]) for i in order[:2]]
    raw = http.post("/rerank", json={"query": TEXTS[0], "texts": TEXTS, "raw_scores": True}).json()
    logits = {r["index"]: r["score"] for r in raw}
    assert np.allclose(
        [1 / (1 + np.exp(-logits[i])) for i in range(len(TEXTS))], expected, atol=1e-5
    )
    # vLLM's rerank keeps /v1/rerank and /v2/rerank.
    vllm = http.post("/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS}).json()
    assert [r["index"] for r in vllm["results"]] == order


def test_predict(clients, tiny_llm) -> None:
    offline = tiny_llm("roberta-classifier")
    http = clients["predict"]
    probs = [o.outputs.probs for o in offline.classify(TEXTS, use_tqdm=False)]
    labels = ("neg", "neutral", "pos")
    single = http.post("/predict", json={"inputs": TEXTS[0]}).json()
    assert [p["label"] for p in single] == [labels[k] for k in np.argsort(probs[0])[::-1]]
    assert np.allclose(sorted(p["score"] for p in single), sorted(probs[0]), atol=1e-6)
    batch = http.post("/predict", json={"inputs": TEXTS}).json()
    assert len(batch) == 3
    for predictions, expected in zip(batch, probs, strict=True):
        assert np.allclose(
            [p["score"] for p in predictions], sorted(expected, reverse=True), atol=1e-6
        )
    # A list of two texts is one pair (TEI's reading); a batch of pairs gives one list each.
    pair = http.post("/predict", json={"inputs": TEXTS[:2]}).json()
    assert isinstance(pair[0], dict) and len(pair) == 3
    pairs = http.post("/predict", json={"inputs": [TEXTS[:2], TEXTS[1:]]}).json()
    assert len(pairs) == 2 and [p["label"] for p in pairs[0]] == [p["label"] for p in pair]
    assert np.allclose([p["score"] for p in pairs[0]], [p["score"] for p in pair], atol=1e-6)
    assert not np.allclose(
        [p["score"] for p in pairs[0]], [p["score"] for p in pairs[1]], atol=1e-4
    )
    raw = http.post("/predict", json={"inputs": TEXTS[0], "raw_scores": True}).json()
    assert not np.isclose(sum(p["score"] for p in raw), 1.0)


def test_tokenize(clients, tiny_llm) -> None:
    tokenizer = tiny_llm("bert").get_tokenizer()
    body = clients["embed"].post("/tokenize", json={"inputs": "Hello world"}).json()
    ids = tokenizer("Hello world")["input_ids"]
    assert [t["id"] for t in body[0]] == ids
    assert body[0][0] == {
        "id": ids[0],
        "text": "[CLS]",
        "special": True,
        "start": None,
        "stop": None,
    }
    assert body[0][1] == {"id": ids[1], "text": "Hello", "special": False, "start": 0, "stop": 5}
    plain = (
        clients["embed"]
        .post("/tokenize", json={"inputs": ["a", "b c"], "add_special_tokens": False})
        .json()
    )
    assert [[t["text"] for t in tokens] for tokens in plain] == [["a"], ["b", "c"]]


def test_openai_style_keeps_vllm_paths(tiny_model_path) -> None:
    server = _serve(tiny_model_path("bert"), api_style="openai")
    try:
        with httpx.Client(base_url=server.url, timeout=60.0) as http:
            assert "tokens" in http.post("/tokenize", json={"prompt": "hello"}).json()
            assert len(http.post("/embed", json={"inputs": "hello"}).json()) == 1
    finally:
        server.stop()


BAD = [
    ("embed", "/embed", {}, 422, "inputs"),
    ("embed", "/embed", {"inputs": []}, 400, "empty"),
    ("embed", "/embed", {"inputs": [""]}, 400, "inputs[0]"),
    ("embed", "/embed", {"inputs": "x", "truncation_direction": "Up"}, 422, "truncation_direction"),
    ("embed", "/embed", {"inputs": "x", "normalize": "yes"}, 422, "normalize"),
    ("embed", "/embed", {"inputs": "x", "prompt_name": "query"}, 400, "prompt_name"),
    ("embed", "/embed", {"inputs": [[10**9]]}, 400, "vocabulary"),
    ("embed", "/predict", {"inputs": "x"}, 400, "/predict"),
    ("rerank", "/rerank", {"query": "q", "texts": []}, 400, "texts"),
    ("rerank", "/rerank", {"query": "", "texts": ["a"]}, 400, "query"),
    ("rerank", "/rerank", {"query": "q", "texts": ["a"], "top_n": -1}, 400, "top_n"),
    ("rerank", "/rerank", {"query": "q", "texts": ["a"], "raw_scores": 1}, 422, "raw_scores"),
    ("predict", "/predict", {"inputs": [["a", "b", "c"]]}, 400, "inputs[0]"),
    ("predict", "/predict", {"inputs": 5}, 400, "inputs"),
    ("predict", "/embed_all", {"inputs": "x"}, 400, "/embed_all"),
    ("embed", "/tokenize", {"inputs": 3}, 400, "inputs"),
]


@pytest.mark.parametrize(("role", "path", "body", "status", "word"), BAD)
def test_bad_inputs(clients, role, path, body, status, word) -> None:
    assert_tei_error(clients[role].post(path, json=body), status, word)


def test_bad_json(clients) -> None:
    for raw in (b"", b"{not json", b"[]"):
        answer = clients["embed"].post(
            "/embed", content=raw, headers={"Content-Type": "application/json"}
        )
        assert 400 <= answer.status_code < 500 and set(answer.json()) == TEI_ERROR_KEYS


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 300) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
ROUTE_FIELDS = {
    "/embed": (
        "inputs",
        "normalize",
        "truncate",
        "truncation_direction",
        "dimensions",
        "prompt_name",
    ),
    "/rerank": ("query", "texts", "raw_scores", "return_text", "top_n", "truncate"),
    "/predict": ("inputs", "raw_scores", "truncate", "truncation_direction"),
    "/tokenize": ("inputs", "add_special_tokens", "prompt_name"),
}
ROLE_OF = {"/embed": "embed", "/rerank": "rerank", "/predict": "predict", "/tokenize": "embed"}


@st.composite
def route_bodies(draw):
    path = draw(st.sampled_from(sorted(ROUTE_FIELDS)))
    body = draw(st.dictionaries(st.sampled_from(ROUTE_FIELDS[path]), json_values, max_size=4))
    return path, body


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=route_bodies())
def test_fuzz_never_5xx(clients, case) -> None:
    path, body = case
    answer = clients[ROLE_OF[path]].post(path, content=json.dumps(body))
    assert answer.status_code < 500, answer.text
    if answer.status_code >= 400:
        assert set(answer.json()) == TEI_ERROR_KEYS
    else:
        assert isinstance(answer.json(), list)


def test_cli_flags_reach_the_server_args() -> None:
    from tidepool.entrypoints.cli import build_parser
    from tidepool.entrypoints.openai.server import ServerArgs

    argv = ["serve", "m", "--api-style", "tei", "--embedding-calibration", "ranges.npy"]
    args = ServerArgs.from_namespace(build_parser().parse_args(argv))
    assert (args.api_style, args.embedding_calibration) == ("tei", "ranges.npy")
    defaults = ServerArgs.from_namespace(build_parser().parse_args(["serve"]))
    assert (defaults.api_style, defaults.embedding_calibration) == ("openai", None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--api-style", "cohere"])
