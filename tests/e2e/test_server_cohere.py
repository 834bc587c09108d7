"""Compact outputs and Cohere's routes on a real server (uvicorn in a thread): /v1/embeddings'
embed_dtype, vLLM's /score body, Cohere's /v2/embed and /v2/rerank through the `cohere` SDK;
every vector compared with offline `LLM.embed`, every quantized one with sentence-transformers'
`quantize_embeddings` on the same floats (exact)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serverlib import ThreadedServer, start_threaded_server

from tidepool.params import PoolingParams
from tidepool.quantize import decode_base64

cohere = pytest.importorskip("cohere")
st_quantization = pytest.importorskip("sentence_transformers.util.quantization")

NAME = "tiny-embedder"
TEXTS = ["a tide pool at dawn", "the rocks are wet", "crabs hide under weed", "salt and sun"]
LONG_TEXT = " ".join(f"word{i}" for i in range(400))  # longer than the tiny model's 128 tokens
PRECISIONS = ("int8", "uint8", "binary", "ubinary")


@pytest.fixture(scope="module")
def offline(tiny_llm):
    return tiny_llm("bert")


@pytest.fixture(scope="module")
def ranges(offline, tmp_path_factory) -> tuple[np.ndarray, str]:
    calibration = [f"calibration text number {i} about the sea" for i in range(40)]
    vectors = np.stack([o.outputs.embedding for o in offline.embed(calibration, use_tqdm=False)])
    found = np.vstack((vectors.min(0), vectors.max(0))).astype(np.float32)
    path = tmp_path_factory.mktemp("calibration") / "ranges.npy"
    np.save(path, found)
    return found, str(path)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from tidepool.engine.async_engine import AsyncEngine

    return AsyncEngine.from_args(str(tiny_model_path("bert")), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def server(engine, ranges) -> Iterator[ThreadedServer]:
    from tidepool.entrypoints.openai.server import ServerArgs, build_app

    args = ServerArgs(served_model_name=[NAME], embedding_calibration=ranges[1])
    srv = start_threaded_server(build_app(engine, args))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: ThreadedServer):
    return cohere.ClientV2(base_url=server.url, api_key="unused")


def _offline(offline, texts, **params) -> np.ndarray:
    pooling = PoolingParams(**params) if params else None
    outs = offline.embed(texts, use_tqdm=False, pooling_params=pooling)
    return np.array([o.outputs.embedding for o in outs], dtype=np.float32)


# ---------------------------------------------------------------------- /v1/embeddings


def test_openai_embed_dtypes_round_trip(http, offline, ranges) -> None:
    expected = _offline(offline, TEXTS)
    floats = http.post("/v1/embeddings", json={"input": TEXTS}).json()["data"]
    floats = np.array([d["embedding"] for d in floats], dtype=np.float32)
    assert np.allclose(floats, expected, atol=1e-6)
    b64 = http.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"}).json()
    assert np.array_equal(
        np.stack([decode_base64(d["embedding"], "float32") for d in b64["data"]]), floats
    )
    for dtype in ("float16", "bfloat16"):
        body = {"input": TEXTS, "encoding_format": "base64", "embed_dtype": dtype}
        data = http.post("/v1/embeddings", json=body).json()["data"]
        decoded = np.stack([decode_base64(d["embedding"], dtype) for d in data])
        import torch

        reference = torch.from_numpy(floats).to(getattr(torch, dtype)).float().numpy()
        assert np.array_equal(decoded, reference), dtype
        as_json = http.post("/v1/embeddings", json={**body, "encoding_format": "float"}).json()
        assert np.array_equal(
            np.array([d["embedding"] for d in as_json["data"]], np.float32), reference
        )
    for precision in PRECISIONS:
        wanted = st_quantization.quantize_embeddings(floats, precision, ranges=ranges[0])
        as_json = http.post(
            "/v1/embeddings", json={"input": TEXTS, "embed_dtype": precision}
        ).json()
        assert np.array_equal(np.array([d["embedding"] for d in as_json["data"]]), wanted), (
            precision
        )
        body = {"input": TEXTS, "embed_dtype": precision, "encoding_format": "base64"}
        data = http.post("/v1/embeddings", json=body).json()["data"]
        assert np.array_equal(
            np.stack([decode_base64(d["embedding"], precision) for d in data]), wanted
        )
    big = http.post(
        "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64", "endianness": "big"}
    )
    values = np.frombuffer(
        __import__("base64").b64decode(big.json()["data"][0]["embedding"]), ">f4"
    )
    assert np.array_equal(values, floats[0])


def test_openai_embed_dtype_errors(http) -> None:
    answer = http.post("/v1/embeddings", json={"input": "x", "embed_dtype": "int4"})
    assert answer.status_code == 422 and answer.json()["error"]["param"] == "embed_dtype"
    answer = http.post(
        "/v1/embeddings", json={"input": "x", "embed_dtype": "int8", "dimensions": 8}
    )
    assert answer.status_code == 400
    assert "ranges have 32 dimensions" in answer.json()["error"]["message"]


def test_no_calibration_is_a_clear_400(engine) -> None:
    from tidepool.entrypoints.openai.encodings import EmbeddingCalibration
    from tidepool.entrypoints.openai.errors import ApiError

    with pytest.raises(ApiError) as info:
        asyncio.run(EmbeddingCalibration(None).ranges(engine, "embed_dtype"))
    assert info.value.status == 400 and "--embedding-calibration" in info.value.message


def test_calibration_from_texts(engine, offline, tmp_path) -> None:
    """A file of texts: the ranges of their embeddings, computed once on first use."""
    from tidepool.entrypoints.openai.encodings import EmbeddingCalibration

    texts = [f"line {i} of the calibration set" for i in range(12)]
    path = tmp_path / "calibration.txt"
    path.write_text("\n".join(texts) + "\n\n")
    engine.start()  # the server fixture may not have started it yet; idempotent
    found = asyncio.run(EmbeddingCalibration(path).ranges(engine, "embed_dtype"))
    expected = _offline(offline, texts)
    assert np.allclose(found, np.vstack((expected.min(0), expected.max(0))), atol=1e-6)


# ---------------------------------------------------------------------- /score


def test_score_queries_documents_body(http, offline) -> None:
    expected = [o.outputs.score for o in offline.score(TEXTS[0], TEXTS[1:], use_tqdm=False)]
    for fields in (("queries", "documents"), ("text_1", "text_2"), ("data_1", "data_2")):
        body = http.post("/score", json={fields[0]: TEXTS[0], fields[1]: TEXTS[1:]}).json()
        assert np.allclose([d["score"] for d in body["data"]], expected, atol=1e-5)
        assert body["object"] == "list" and body["id"].startswith("score-")
    both = http.post(
        "/score", json={"queries": "a", "documents": "b", "text_1": "c", "text_2": "d"}
    )
    assert both.status_code == 400 and "one pair" in both.json()["error"]["message"]
    half = http.post("/score", json={"queries": "a"})
    assert half.status_code == 400 and half.json()["error"]["param"] == "documents"
    none = http.post("/score", json={"model": NAME})
    assert none.status_code == 400


# ---------------------------------------------------------------------- Cohere SDK


def test_cohere_sdk_embed(client, offline, ranges) -> None:
    types = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
    answer = client.embed(
        model=NAME, texts=TEXTS, input_type="search_document", embedding_types=types
    )
    floats = np.array(answer.embeddings.float_, dtype=np.float32)
    assert np.allclose(floats, _offline(offline, TEXTS), atol=1e-6)
    for precision in PRECISIONS:
        wanted = st_quantization.quantize_embeddings(floats, precision, ranges=ranges[0])
        assert np.array_equal(np.array(getattr(answer.embeddings, precision)), wanted), precision
    decoded = np.stack([decode_base64(b, "float32") for b in answer.embeddings.base64])
    assert np.array_equal(decoded, floats)
    assert answer.texts == TEXTS and answer.id.startswith("embed-")
    assert answer.meta.billed_units.input_tokens > len(TEXTS)
    short = client.embed(model=NAME, texts=TEXTS[:1], input_type="search_query", output_dimension=8)
    assert len(short.embeddings.float_[0]) == 8
    assert np.allclose(
        short.embeddings.float_[0], _offline(offline, TEXTS[:1], dimensions=8)[0], atol=1e-6
    )


def test_cohere_truncate(client, offline) -> None:
    def embed(truncate: str) -> np.ndarray:
        out = client.embed(
            model=NAME, texts=[LONG_TEXT], input_type="search_document", truncate=truncate
        )
        return np.array(out.embeddings.float_[0], dtype=np.float32)

    end, start = embed("END"), embed("START")
    assert not np.allclose(end, start, atol=1e-3)
    assert np.allclose(end, _offline(offline, [LONG_TEXT], truncate_prompt_tokens=-1)[0], atol=1e-6)
    left = _offline(offline, [LONG_TEXT], truncate_prompt_tokens=-1, truncation_side="left")[0]
    assert np.allclose(start, left, atol=1e-6)
    with pytest.raises(cohere.core.ApiError) as info:
        embed("NONE")
    assert info.value.status_code == 400 and set(info.value.body) == {"message"}
    assert "128" in info.value.body["message"]


def test_cohere_sdk_rerank(client, offline) -> None:
    expected = [o.outputs.score for o in offline.score(TEXTS[0], TEXTS, use_tqdm=False)]
    order = sorted(range(len(TEXTS)), key=lambda i: -expected[i])
    answer = client.rerank(model=NAME, query=TEXTS[0], documents=TEXTS, top_n=2)
    assert [r.index for r in answer.results] == order[:2]
    for r in answer.results:
        assert abs(r.relevance_score - expected[r.index]) < 1e-5


BAD_EMBED_BODIES = [
    ({}, 400, "texts"),
    ({"texts": []}, 400, "empty"),
    ({"texts": "one string"}, 400, "texts"),
    ({"texts": ["ok", 3]}, 400, "texts[1]"),
    ({"texts": ["ok", ""]}, 400, "texts[1]"),
    ({"texts": ["ok"], "embedding_types": ["float64"]}, 422, "embedding_types"),
    ({"texts": ["ok"], "truncate": "MIDDLE"}, 422, "truncate"),
    ({"texts": ["ok"], "input_type": "poem"}, 422, "input_type"),
    ({"texts": ["ok"], "output_dimension": "8"}, 422, "output_dimension"),
    ({"texts": ["ok"], "output_dimension": 0}, 400, "output_dimension must be >= 1"),
    ({"texts": ["ok"], "images": ["data:..."]}, 400, "images"),
    ({"texts": ["ok"], "input_type": "image"}, 400, "input_type image goes with images"),
    ({"texts": ["ok"], "model": "other"}, 404, "other"),
    ({"texts": ["ok"], "truncate": "NONE", "max_tokens": 4}, 400, "max_tokens"),
    ({"texts": ["ok"], "embedding_types": ["int8"], "output_dimension": 8}, 400, "dimensions"),
]


@pytest.mark.parametrize(("body", "status", "word"), BAD_EMBED_BODIES)
def test_cohere_bad_inputs(http, body, status, word) -> None:
    answer = http.post("/v2/embed", json=body)
    assert answer.status_code == status, answer.text
    assert set(answer.json()) == {"message"} and word in answer.json()["message"]


def test_cohere_bad_json(http) -> None:
    for raw in (b"", b"{not json", b"[1, 2]"):
        answer = http.post("/v2/embed", content=raw, headers={"Content-Type": "application/json"})
        assert 400 <= answer.status_code < 500 and set(answer.json()) == {"message"}


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 300)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
FIELDS = (
    "texts",
    "embedding_types",
    "truncate",
    "input_type",
    "output_dimension",
    "max_tokens",
    "model",
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=4))
def test_cohere_fuzz_never_5xx(http, body) -> None:
    body.setdefault("texts", ["a tide pool"])
    answer = http.post("/v2/embed", content=json.dumps(body))
    assert answer.status_code < 500, answer.text
    if answer.status_code >= 400:
        assert set(answer.json()) == {"message"}
    else:
        assert set(answer.json()["embeddings"]) <= {
            "float",
            "int8",
            "uint8",
            "binary",
            "ubinary",
            "base64",
        }


def test_input_type_picks_the_models_prompt() -> None:
    """The route's rule is engine/prompts.py's (the offline API's): case-insensitive, most
    likely name first; a named prompt replaces the default one, as sentence-transformers'."""
    from types import SimpleNamespace

    from tidepool.entrypoints.openai.serving_cohere import input_type_prompt

    def serving(prompts: dict[str, str], default: str | None = None):
        st_config = SimpleNamespace(prompts=prompts, default_prompt_name=default)
        return SimpleNamespace(model_config=SimpleNamespace(st=st_config, multi_vector=None))

    e5 = serving({"query": "query: ", "passage": "passage: "})
    assert input_type_prompt(e5, "search_query") == "query"
    assert input_type_prompt(e5, "search_document") == "passage"
    assert input_type_prompt(e5, "clustering") is None
    assert input_type_prompt(e5, None) is None
    gemma = serving({"Retrieval-query": "q: ", "Clustering": "c: "}, default="Clustering")
    assert input_type_prompt(gemma, "search_query") == "Retrieval-query"
    assert input_type_prompt(gemma, "classification") is None  # the default prompt then
