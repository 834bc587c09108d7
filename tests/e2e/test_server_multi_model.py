"""Several models in one server: a real `tidepool serve --model A --model B` (a tiny embedder and
a tiny cross-encoder), requests routed by `model` (Cohere's /v2/embed too; TEI's routes by task or
`?model=`), each answer equal to the offline LLM's; 404 for an unknown name; /v1/models, /health and /metrics report both; the memory of each load is logged.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from serverlib import ServerProcess, metric_value, start_server

from tidepool.entrypoints.cli import _served_names, build_parser
from tidepool.entrypoints.cli_args import _model_args

EMBEDDER, RERANKER = "embedder", "reranker"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "hi", "what is the capital of france?"]
QUERY = "what is the capital of france?"
DOCUMENTS = ["Paris is the capital of France.", "The fox is quick.", "Berlin is in Germany."]


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("multi_model_server") / "server.log"
    args = [
        "--model", str(tiny_model_path("bert")), "--model", str(tiny_model_path("bert-cross-encoder")),
        "--served-model-name", EMBEDDER, "--served-model-name", RERANKER,
        "--device", "cpu", "--dtype", "float32",
    ]  # fmt: skip
    srv = start_server(args, log)
    yield srv
    assert srv.stop_gracefully(), srv.log()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        yield client


def offline_embeddings(tiny_llm) -> torch.Tensor:
    return torch.tensor(
        [o.outputs.embedding for o in tiny_llm("bert").embed(TEXTS, use_tqdm=False)]
    )


def offline_scores(tiny_llm) -> list[float]:
    outputs = tiny_llm("bert-cross-encoder").score(QUERY, DOCUMENTS, use_tqdm=False)
    return [o.outputs.score for o in outputs]


def test_models_answer_side_by_side(http: httpx.Client, tiny_llm) -> None:
    expected_vectors, expected_scores = offline_embeddings(tiny_llm), offline_scores(tiny_llm)

    async def interleaved() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=str(http.base_url), timeout=60.0) as client:
            calls = []
            for _ in range(8):
                calls.append(
                    client.post("/v1/embeddings", json={"model": EMBEDDER, "input": TEXTS})
                )
                rerank = {"model": RERANKER, "query": QUERY, "documents": DOCUMENTS}
                calls.append(client.post("/rerank", json=rerank))
            return await asyncio.gather(*calls)

    for response in asyncio.run(interleaved()):
        assert response.status_code == 200, response.text
        body = response.json()
        if "data" in body:
            assert body["model"] == EMBEDDER
            vectors = torch.tensor([d["embedding"] for d in body["data"]])
            torch.testing.assert_close(vectors, expected_vectors, atol=1e-5, rtol=0)
        else:
            assert body["model"] == RERANKER
            scores = {r["index"]: r["relevance_score"] for r in body["results"]}
            got = [scores[i] for i in range(len(DOCUMENTS))]
            assert got == pytest.approx(expected_scores, abs=1e-5)


def test_request_without_model_goes_to_the_first(http: httpx.Client, tiny_llm) -> None:
    response = http.post("/v1/embeddings", json={"input": TEXTS})
    assert response.status_code == 200 and response.json()["model"] == EMBEDDER
    vectors = torch.tensor([d["embedding"] for d in response.json()["data"]])
    torch.testing.assert_close(vectors, offline_embeddings(tiny_llm), atol=1e-5, rtol=0)


def test_unknown_model_and_wrong_task(http: httpx.Client) -> None:
    response = http.post("/v1/embeddings", json={"model": "gpt-4", "input": "x"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == 404 and error["type"] == "NotFoundError" and error["param"] == "model"
    assert "`gpt-4` does not exist" in error["message"]
    assert EMBEDDER in error["message"] and RERANKER in error["message"]
    # A served name on a route its model does not support: that model's own 400.
    response = http.post("/classify", json={"model": EMBEDDER, "input": "x"})
    assert response.status_code == 400 and "embedding model" in response.json()["error"]["message"]


def test_cohere_and_tei_routes_reach_each_model(http: httpx.Client, tiny_llm) -> None:
    expected = offline_embeddings(tiny_llm)
    # Cohere's /v2/embed goes by its `model`, as the OpenAI routes do.
    response = http.post("/v2/embed", json={"model": EMBEDDER, "texts": TEXTS})
    assert response.status_code == 200, response.text
    vectors = torch.tensor(response.json()["embeddings"]["float"])
    torch.testing.assert_close(vectors, expected, atol=1e-5, rtol=0)
    response = http.post("/v2/embed", json={"model": RERANKER, "texts": TEXTS})
    assert response.status_code == 400 and "cross-encoder" in response.json()["message"]
    response = http.post("/v2/embed", json={"model": "gpt-4", "texts": TEXTS})
    assert response.status_code == 404 and "`gpt-4` does not exist" in response.json()["message"]
    # TEI's bodies name no model: the first model that serves the route answers.
    response = http.post("/embed", json={"inputs": TEXTS})
    assert response.status_code == 200, response.text
    normalized = torch.nn.functional.normalize(expected, dim=-1)
    torch.testing.assert_close(torch.tensor(response.json()), normalized, atol=1e-5, rtol=0)
    response = http.post("/predict", json={"inputs": [QUERY, DOCUMENTS[0]]})
    assert response.status_code == 200, response.text
    assert response.json()[0]["score"] == pytest.approx(offline_scores(tiny_llm)[0], abs=1e-5)
    # `?model=` picks one; an unknown name is TEI's 404.
    response = http.post(f"/predict?model={EMBEDDER}", json={"inputs": "x"})
    assert response.status_code == 400
    assert response.json()["error_type"] == "Validation" and "embedding model" in response.text
    response = http.post("/embed?model=nope", json={"inputs": "x"})
    assert response.status_code == 404 and response.json()["error_type"] == "Validation"
    assert "`nope` does not exist" in response.json()["error"]
    response = http.post(f"/predict?model={RERANKER}", json={"inputs": [QUERY, DOCUMENTS[0]]})
    assert response.status_code == 200, response.text


def test_models_health_metrics_and_memory_log(
    http: httpx.Client, server: ServerProcess, tiny_model_path
) -> None:
    cards = http.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [EMBEDDER, RERANKER]
    assert cards[1]["root"] == str(tiny_model_path("bert-cross-encoder"))
    health = http.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "models": {EMBEDDER: "running", RERANKER: "running"}}
    http.post("/v1/embeddings", json={"model": EMBEDDER, "input": "x"})
    http.post("/rerank", json={"model": RERANKER, "query": "q", "documents": ["d"]})
    text = http.get("/metrics").text
    for name in (EMBEDDER, RERANKER):
        assert metric_value(text, "tidepool:engine_steps_total", {"model": name}) > 0
        assert f'tidepool:num_requests_waiting{{model="{name}"}}' in text
    log = server.log()
    assert log.count("resident memory") == 2, log
    assert f"as {EMBEDDER} in" in log and f"as {RERANKER} in" in log


def test_health_names_a_model_whose_engine_is_not_running(tiny_model_path) -> None:
    from tidepool.engine.async_engine import AsyncEngine
    from tidepool.entrypoints.openai.served_models import NamedEngine
    from tidepool.entrypoints.openai.server import build_app

    engines = [
        NamedEngine(AsyncEngine.from_args(str(tiny_model_path(kind)), device="cpu"), (name,))
        for kind, name in (("bert", EMBEDDER), ("bert-cross-encoder", RERANKER))
    ]
    engines[0].engine.start()  # the app's lifespan is not run here: only the first is started
    app = build_app(engines)

    async def get_health() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.get("/health")

    try:
        response = asyncio.run(get_health())
        assert response.status_code == 503
        message = response.json()["error"]["message"]
        assert f"`{RERANKER}`" in message and EMBEDDER not in message
    finally:
        asyncio.run(engines[0].engine.shutdown())


# ---------------------------------------------------------------------- command line


def _serve_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize(
    "argv,models,names",
    [
        (["m"], ["m"], [["m"]]),
        (["m", "--served-model-name", "a", "b"], ["m"], [["a", "b"]]),  # aliases, as before
        (["m", "--model", "m"], ["m"], [["m"]]),  # MODEL and the same --model: one model
        (["--model", "x", "--model", "y"], ["x", "y"], [["x"], ["y"]]),
        (["x", "--model", "y", "--served-model-name", "a", "b"], ["x", "y"], [["a"], ["b"]]),
        (
            ["--model", "x", "--model", "y", "--served-model-name", "a", "a2", "--served-model-name", "b"],
            ["x", "y"],
            [["a", "a2"], ["b"]],
        ),
    ],
)  # fmt: skip
def test_serve_models_and_names(argv: list[str], models: list[str], names) -> None:
    args = _serve_args(argv)
    assert _model_args(args) == models
    assert _served_names(args, models) == names


def test_serve_refuses_names_that_do_not_fit() -> None:
    args = _serve_args(["--model", "x", "--model", "y", "--served-model-name", "a", "b", "c"])
    with pytest.raises(SystemExit, match="one --served-model-name per --model"):
        _served_names(args, _model_args(args))
    with pytest.raises(SystemExit, match="given twice"):
        _model_args(_serve_args(["--model", "x", "--model", "x"]))
    embed = build_parser().parse_args(["embed", "--model", "x", "--model", "y", "--demo"])
    from tidepool.entrypoints.cli_args import _model_arg

    with pytest.raises(SystemExit, match="two models given"):
        _model_arg(embed)


def test_duplicate_served_name_across_models_is_refused(tiny_model_path: Path) -> None:
    from tidepool.engine.async_engine import AsyncEngine
    from tidepool.entrypoints.openai.served_models import NamedEngine
    from tidepool.entrypoints.openai.server import build_app

    engine = AsyncEngine.from_args(str(tiny_model_path("bert")), device="cpu")
    with pytest.raises(ValueError, match="given to two models"):
        build_app([NamedEngine(engine, ("a",)), NamedEngine(engine, ("b", "a"))])


# ---------------------------------------------------------------------- per-model state (issue 26)


def _app_client(engines, **server_args):
    from fastapi.testclient import TestClient

    from tidepool.entrypoints.openai.served_models import NamedEngine
    from tidepool.entrypoints.openai.server import ServerArgs, build_app

    named = [NamedEngine(engine, (name,)) for name, engine in engines]
    return TestClient(build_app(named, ServerArgs(**server_args)))


@pytest.fixture(scope="module")
def wide_bert(tiny_model_path, tmp_path_factory, minilm_path) -> Path:
    """A tiny random BERT of another width than the conftest's (48, not 32)."""
    from conftest import TINY_SIZES, copy_bert_tokenizer
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("wide_bert")
    torch.manual_seed(7)
    sizes = {**TINY_SIZES, "hidden_size": 48, "num_attention_heads": 4}
    BertModel(BertConfig(vocab_size=30522, type_vocab_size=2, **sizes)).save_pretrained(folder)
    copy_bert_tokenizer(minilm_path, folder)
    return folder


CALIBRATION = [f"calibration text {i}: " + "tide pools hold " * (i % 5) for i in range(12)]


def test_calibration_ranges_are_per_model(tiny_model_path, wide_bert, tmp_path, tiny_llm) -> None:
    """One --embedding-calibration file of texts, two models of different widths: each model's
    int8 / uint8 values are quantize_embeddings' with its own ranges, whichever asks first."""
    from tidepool import LLM, quantize_embeddings
    from tidepool.engine.async_engine import AsyncEngine

    calibration = tmp_path / "calibration.txt"
    calibration.write_text("\n".join(CALIBRATION) + "\n")
    narrow_path = str(tiny_model_path("bert"))
    engines = [
        (name, AsyncEngine.from_args(path, device="cpu", dtype="float32"))
        for name, path in (("narrow", narrow_path), ("wide", str(wide_bert)))
    ]
    offline = {
        "narrow": tiny_llm("bert"),
        "wide": LLM(str(wide_bert), device="cpu", dtype="float32"),
    }
    with _app_client(engines, embedding_calibration=str(calibration)) as client:
        for name in ("wide", "narrow", "wide"):  # the wide model asks first
            answers = {}
            for dtype in ("int8", "uint8"):
                body = {"model": name, "input": TEXTS, "embed_dtype": dtype}
                answer = client.post("/v1/embeddings", json=body)
                assert answer.status_code == 200, answer.text
                llm = offline[name]
                vectors = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
                own = [o.outputs.embedding for o in llm.embed(CALIBRATION, use_tqdm=False)]
                expected = quantize_embeddings(vectors, dtype, calibration_embeddings=own)
                got = [d["embedding"] for d in answer.json()["data"]]
                answers[dtype] = got
                assert len(got[0]) == (48 if name == "wide" else 32)
                # Rounding at a bucket edge may move a value by one step; no more, and rarely.
                diff = abs(torch.tensor(got) - torch.tensor(expected.astype(int)))
                assert diff.max() <= 1 and (diff > 0).float().mean() < 0.02, name
            cohere = client.post(
                "/v2/embed", json={"model": name, "texts": TEXTS, "embedding_types": ["int8"]}
            )
            assert cohere.status_code == 200, cohere.text
            assert cohere.json()["embeddings"]["int8"] == answers["int8"]


def test_npy_ranges_of_one_width_refuse_the_other_clearly(tiny_model_path, wide_bert, tmp_path):
    import numpy as np

    from tidepool.engine.async_engine import AsyncEngine

    ranges = tmp_path / "ranges.npy"
    np.save(ranges, np.vstack((-np.ones(32), np.ones(32))).astype(np.float32))
    engines = [
        (name, AsyncEngine.from_args(path, device="cpu", dtype="float32"))
        for name, path in (("narrow", str(tiny_model_path("bert"))), ("wide", str(wide_bert)))
    ]
    with _app_client(engines, embedding_calibration=str(ranges)) as client:
        body = {"input": "a text", "embed_dtype": "int8"}
        assert client.post("/v1/embeddings", json={**body, "model": "narrow"}).status_code == 200
        answer = client.post("/v1/embeddings", json={**body, "model": "wide"})
        assert answer.status_code == 400
        message = answer.json()["error"]["message"]
        assert "ranges have 32 dimensions, the embedding has 48" in message
        assert "a file of texts gives each model its own" in message


def test_tei_embed_sparse_honours_the_model_query(tiny_model_path, minilm_path, tmp_path) -> None:
    from sparse_models import save_splade

    from tidepool.engine.async_engine import AsyncEngine

    splade = save_splade(tmp_path / "splade", minilm_path, seed=5, pooling_strategy="max")
    engines = [
        ("dense", AsyncEngine.from_args(str(tiny_model_path("bert")), device="cpu")),
        ("sparse", AsyncEngine.from_args(str(splade), device="cpu")),
    ]
    with _app_client(engines) as client:
        body = {"inputs": "a tide pool"}
        by_task = client.post("/embed_sparse", json=body)  # no model: the one that serves it
        by_query = client.post("/embed_sparse?model=sparse", json=body)
        assert by_task.status_code == by_query.status_code == 200, by_query.text
        assert by_task.json() == by_query.json() and by_query.json()[0]
        dense = client.post("/embed_sparse?model=dense", json=body)
        assert dense.status_code == 400 and "does not support" in dense.text
        assert client.post("/embed_sparse?model=nope", json=body).status_code == 404
        both = client.post("/embed_sparse?model=sparse", json={**body, "model": "dense"})
        assert both.status_code == 400 and "give one" in both.text


@pytest.mark.parametrize("name", ["", " ", " padded "])
def test_unusable_served_names_are_refused_at_start(tiny_model_path, name: str) -> None:
    from tidepool.engine.async_engine import AsyncEngine

    argv = ["serve", str(tiny_model_path("bert")), "--served-model-name", name]
    args = build_parser().parse_args(argv)
    with pytest.raises(ValueError, match="served model name"):
        _served_names(args, _model_args(args))
    engine = AsyncEngine.from_args(str(tiny_model_path("bert")), device="cpu")
    with pytest.raises(ValueError, match="served model name"):
        _app_client([(name, engine)])
