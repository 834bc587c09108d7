"""vLLM 0.32's documented online pooling usage against one tidepool server (an embedding model
and a cross-encoder, tiny and random): the OpenAI client, Cohere / Jina-style rerank bodies,
and every vLLM pooling field honoured or refused with a 400 naming it."""

from __future__ import annotations

import base64
import json
import math
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from serverlib import start_threaded_server  # noqa: E402

from tidepool import LLM
from tidepool.engine.async_engine import AsyncEngine
from tidepool.entrypoints.openai.served_models import NamedEngine
from tidepool.entrypoints.openai.server import ServerArgs, build_app

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
QUERY, DOCS = "capital of France", ["Paris is the capital of France.", "Berlin is in Germany."]


@pytest.fixture(scope="module")
def models(tiny_model_path) -> dict[str, str]:
    return {
        "embed": str(tiny_model_path("bert")),
        "rerank": str(tiny_model_path("bert-cross-encoder")),
    }


@pytest.fixture(scope="module")
def server(models):
    common = {"device": "cpu", "dtype": "float32"}
    embed = AsyncEngine.from_args(models["embed"], chat_template=CHAT_TEMPLATE, **common)
    rerank = AsyncEngine.from_args(models["rerank"], **common)
    app = build_app(
        [NamedEngine(embed, ("embed",)), NamedEngine(rerank, ("rerank",))], ServerArgs()
    )
    srv = start_threaded_server(app)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def offline(models) -> dict[str, LLM]:
    return {k: LLM(v, device="cpu", dtype="float32") for k, v in models.items()}


def _post(http: httpx.Client, path: str, body: dict) -> dict:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_openai_client_embeddings(server, offline) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY")
    out = client.embeddings.create(model="embed", input=DOCS)
    expected = [o.outputs.embedding for o in offline["embed"].embed(DOCS)]
    for item, vector in zip(out.data, expected, strict=True):
        assert item.embedding == pytest.approx(vector, abs=1e-5)
    b64 = client.embeddings.create(model="embed", input=DOCS[0], encoding_format="base64")
    values = np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype="<f4")
    assert values.tolist() == pytest.approx(expected[0], abs=1e-5)


def test_use_activation_false_is_honoured(http, offline) -> None:
    raw = _post(
        http, "/v1/embeddings", {"model": "embed", "input": DOCS[0], "use_activation": False}
    )
    vector = torch.tensor(raw["data"][0]["embedding"])
    assert abs(float(vector.norm()) - 1.0) > 1e-3
    normed = offline["embed"].embed(DOCS[0])[0].outputs.embedding
    assert F.normalize(vector, dim=0).tolist() == pytest.approx(normed, abs=1e-5)
    score = _post(http, "/score", {"model": "rerank", "queries": QUERY, "documents": DOCS[:1]})
    logit = _post(
        http,
        "/score",
        {"model": "rerank", "queries": QUERY, "documents": DOCS[:1], "use_activation": False},
    )
    assert 1 / (1 + math.exp(-logit["data"][0]["score"])) == pytest.approx(
        score["data"][0]["score"], abs=1e-6
    )


def test_truncation_side_and_add_special_tokens(http, offline) -> None:
    tokenizer = offline["embed"].get_tokenizer()
    ids = tokenizer(DOCS[0])["input_ids"]
    left = _post(
        http,
        "/pooling",
        {"model": "embed", "input": DOCS[0], "task": "token_embed", "truncate_prompt_tokens": 4,
         "truncation_side": "left"},
    )  # fmt: skip
    expected = (
        offline["embed"]
        .encode([{"prompt_token_ids": [ids[0], *ids[-3:]]}], pooling_task="token_embed")[0]
        .outputs.data
    )
    assert np.allclose(left["data"][0]["data"], expected.numpy(), atol=1e-5)
    bare = _post(
        http, "/v1/embeddings", {"model": "embed", "input": DOCS[0], "add_special_tokens": False}
    )
    assert bare["usage"]["prompt_tokens"] == len(ids) - 2


def test_messages_are_rendered_with_the_chat_template(http, offline) -> None:
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    out = _post(http, "/v1/embeddings", {"model": "embed", "messages": messages})
    text = "user: hello\nassistant: hi\n"
    expected = offline["embed"].embed(text, tokenization_kwargs={"add_special_tokens": False})
    assert out["data"][0]["embedding"] == pytest.approx(expected[0].outputs.embedding, abs=1e-5)
    refused = http.post("/classify", json={"model": "rerank", "messages": messages})
    assert refused.status_code == 400 and "chat" in refused.json()["error"]["message"]


def test_score_queries_items_and_jina_cohere_rerank(http) -> None:
    documents = _post(http, "/score", {"model": "rerank", "queries": QUERY, "documents": DOCS})
    items = _post(http, "/score", {"model": "rerank", "queries": QUERY, "items": DOCS})
    assert [d["score"] for d in items["data"]] == [d["score"] for d in documents["data"]]
    jina = _post(
        http, "/v1/rerank", {"model": "rerank", "query": QUERY, "documents": DOCS, "top_n": 1}
    )
    cohere = _post(
        http, "/v2/rerank", {"model": "rerank", "query": QUERY, "documents": DOCS, "top_n": 1}
    )
    best = max(documents["data"], key=lambda d: d["score"])
    for answer in (jina, cohere):
        assert answer["results"][0]["index"] == best["index"]
        assert answer["results"][0]["relevance_score"] == pytest.approx(best["score"], abs=1e-6)


def test_max_tokens_per_doc_cuts_each_document(http, offline) -> None:
    cut = _post(
        http,
        "/rerank",
        {"model": "rerank", "query": QUERY, "documents": DOCS, "max_tokens_per_doc": 2},
    )
    tokenizer = offline["rerank"].get_tokenizer()
    cut_docs = []
    for doc in DOCS:
        offsets = tokenizer(doc, add_special_tokens=False, return_offsets_mapping=True)[
            "offset_mapping"
        ]
        cut_docs.append(doc[: offsets[1][1]])
    expected = [o.outputs.score for o in offline["rerank"].score(QUERY, cut_docs)]
    got = {r["index"]: r["relevance_score"] for r in cut["results"]}
    assert [got[i] for i in range(len(DOCS))] == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("embed_dtype", ["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_bytes_encoding_as_vllm_writes_it(http, offline, embed_dtype: str) -> None:
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
              "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}  # fmt: skip
    views = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    body = {"model": "embed", "input": DOCS, "encoding_format": "bytes", "embed_dtype": embed_dtype}
    response = http.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    metadata = json.loads(response.headers["metadata"])
    expected = [torch.tensor(o.outputs.embedding) for o in offline["embed"].embed(DOCS)]
    dtype = dtypes[embed_dtype]
    view = views[torch.empty(0, dtype=dtype).element_size()]
    for item, vector in zip(metadata["data"], expected, strict=True):
        raw = np.frombuffer(response.content[item["start"] : item["end"]], dtype=np.uint8)
        values = torch.from_numpy(raw.copy()).view(view).view(dtype).reshape(item["shape"])
        torch.testing.assert_close(values, vector.to(dtype), atol=0, rtol=0)
    only = http.post("/v1/embeddings", json={**body, "encoding_format": "bytes_only"})
    assert only.content == response.content and "metadata" not in only.headers
    b64 = _post(http, "/v1/embeddings", {**body, "encoding_format": "base64", "input": DOCS[0]})
    start, end = metadata["data"][0]["start"], metadata["data"][0]["end"]
    assert base64.b64decode(b64["data"][0]["embedding"]) == response.content[start:end]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("priority", 1),
        ("padding", "max_length"),
        ("cache_salt", "s"),
        ("mm_processor_kwargs", {"a": 1}),
    ],
)
def test_unimplemented_vllm_fields_get_400_naming_them(http, field: str, value) -> None:
    response = http.post("/v1/embeddings", json={"model": "embed", "input": "x", field: value})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field


def test_request_id_is_echoed(http) -> None:
    out = _post(http, "/v1/embeddings", {"model": "embed", "input": "x", "request_id": "abc"})
    assert out["id"] == "embd-abc"


def test_ping_invocations_and_vllm_metrics(http) -> None:
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    inv = _post(http, "/invocations", {"model": "embed", "input": ["a", "b"]})
    assert inv["object"] == "list" and len(inv["data"]) == 2 and "embedding" in inv["data"][0]
    rerank = _post(http, "/invocations", {"model": "rerank", "query": QUERY, "documents": DOCS})
    assert len(rerank["results"]) == 2
    assert http.post("/invocations", json={"what": 1}).status_code == 400
    metrics = http.get("/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:prompt_tokens_total",
        "vllm:request_success_total",
    ):
        lines = [line for line in metrics.splitlines() if line.startswith(name + "{")]
        assert any('model_name="embed"' in line for line in lines), name


def test_max_tokens_per_query_cuts_each_query(http, offline) -> None:
    tokenizer = offline["rerank"].get_tokenizer()
    offsets = tokenizer(QUERY, add_special_tokens=False, return_offsets_mapping=True)[
        "offset_mapping"
    ]
    cut_query = QUERY[: offsets[0][1]]
    got = _post(
        http,
        "/score",
        {"model": "rerank", "queries": QUERY, "documents": DOCS, "max_tokens_per_query": 1},
    )
    expected = [o.outputs.score for o in offline["rerank"].score(cut_query, DOCS)]
    assert [d["score"] for d in got["data"]] == pytest.approx(expected, abs=1e-6)
    # 0 (vLLM's default) cuts nothing; `user` is OpenAI's end-user id, with no effect
    whole = _post(
        http,
        "/rerank",
        {"model": "rerank", "query": QUERY, "documents": DOCS, "max_tokens_per_query": 0,
         "max_tokens_per_doc": 0, "user": "someone"},
    )  # fmt: skip
    plain = _post(http, "/rerank", {"model": "rerank", "query": QUERY, "documents": DOCS})
    assert whole["results"] == plain["results"]
    assert plain["usage"]["prompt_tokens"] == plain["usage"]["total_tokens"] > 0


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("max_tokens_per_doc", -1, "non-negative"),
        ("max_tokens_per_query", 10_000, "less than max_model_len"),
        ("instruction", "Judge relevance", "--score-instruction"),
        ("chat_template_kwargs", {"instruction": "x"}, "--score-template"),
    ],
)
def test_scoring_fields_refused_with_400_naming_them(http, field: str, value, words: str) -> None:
    for path, body in (
        ("/score", {"model": "rerank", "queries": QUERY, "documents": DOCS}),
        ("/rerank", {"model": "rerank", "query": QUERY, "documents": DOCS}),
    ):
        response = http.post(path, json={**body, field: value})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert field in error["message"] or error["param"] == field
        assert words in error["message"]


def test_request_chat_template_on_pooling_needs_the_flag(http) -> None:
    messages = [{"role": "user", "content": "hello"}]
    for path in ("/v1/embeddings", "/pooling"):
        body = {"model": "embed", "messages": messages, "chat_template": CHAT_TEMPLATE}
        response = http.post(path, json=body)
        assert response.status_code == 400
        assert "--trust-request-chat-template" in response.json()["error"]["message"]
