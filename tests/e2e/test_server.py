"""A real `tidepool serve` (all-MiniLM-L6-v2) on 127.0.0.1, called with the official `openai`
client and with httpx: every route, results equal to the offline `LLM`, bad inputs, many
concurrent clients, client disconnects.

The server runs with a small step budget (--max-num-batched-tokens 2048) so that a big request
spans several engine steps: that is what makes a disconnect observable (the steps after it are
aborted) and dynamic batching measurable.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import socket
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from serverlib import ServerProcess, metric_value, start_server

from tidepool import LLM, PoolingParams

MINILM_ID = "sentence-transformers/all-MiniLM-L6-v2"
SERVED_NAME = "minilm"
MAX_INPUTS = 64
MAX_BODY_BYTES = 200_000
COSINE_MIN = 0.99999

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "hi",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "Ünïcödé àccénts, emoji 🙂 and 中文 in one line",
    "tokens " * 60,
]


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("minilm_server") / "server.log"
    args = [
        "--served-model-name", SERVED_NAME, MINILM_ID,
        "--max-num-batched-tokens", "2048",
        "--max-inputs-per-request", str(MAX_INPUTS),
        "--max-request-body-bytes", str(MAX_BODY_BYTES),
    ]  # fmt: skip
    srv = start_server(args, log)
    yield srv
    assert srv.stop_gracefully(), srv.log()


@pytest.fixture(scope="session")
def offline() -> LLM:
    return LLM(MINILM_ID)


@pytest.fixture(scope="session")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="session")
def openai_client(server: ServerProcess):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def offline_embeddings(llm: LLM, prompts: list, **kwargs) -> torch.Tensor:
    outs = llm.embed(prompts, use_tqdm=False, **kwargs)
    return torch.tensor([o.outputs.embedding for o in outs])


def assert_close(actual, expected: torch.Tensor) -> None:
    actual = torch.as_tensor(np.asarray(actual, dtype=np.float32))
    assert actual.shape == expected.shape
    cos = F.cosine_similarity(actual.double(), expected.double(), dim=-1)
    assert float(cos.min()) >= COSINE_MIN, cos


# ---------------------------------------------------------------------- embeddings


def test_embeddings_openai_client_float_and_base64(openai_client, offline: LLM) -> None:
    expected = offline_embeddings(offline, TEXTS)
    # The client asks for base64 unless told otherwise, and decodes little-endian float32.
    default = openai_client.embeddings.create(model=SERVED_NAME, input=TEXTS)
    floats = openai_client.embeddings.create(
        model=SERVED_NAME, input=TEXTS, encoding_format="float", user="ignored"
    )
    for response in (default, floats):
        assert response.model == SERVED_NAME
        assert [d.index for d in response.data] == list(range(len(TEXTS)))
        assert_close([d.embedding for d in response.data], expected)
    num_tokens = sum(len(o.prompt_token_ids) for o in offline.embed(TEXTS, use_tqdm=False))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == num_tokens


def test_embeddings_json_shape_and_base64(http: httpx.Client, offline: LLM) -> None:
    body = http.post("/v1/embeddings", json={"input": "hello there"}).json()
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}
    assert body["object"] == "list" and body["id"].startswith("embd-")
    assert body["model"] == SERVED_NAME  # no model given: the first served name
    assert body["data"][0].keys() == {"index", "object", "embedding"}
    assert body["data"][0]["object"] == "embedding"
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    b64 = http.post("/v1/embeddings", json={"input": "hello there", "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(b64.json()["data"][0]["embedding"]), dtype="<f4")
    assert_close([decoded], offline_embeddings(offline, ["hello there"]))
    # The hub id is served too.
    assert http.post("/v1/embeddings", json={"input": "x", "model": MINILM_ID}).status_code == 200


def test_embeddings_token_id_inputs(http: httpx.Client, offline: LLM) -> None:
    tokenizer = offline.get_tokenizer()
    ids = [tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    expected = offline_embeddings(offline, TEXTS[:3])
    one = http.post("/v1/embeddings", json={"input": ids[0]}).json()
    assert_close([one["data"][0]["embedding"]], expected[:1])
    many = http.post("/v1/embeddings", json={"input": ids}).json()
    assert_close([d["embedding"] for d in many["data"]], expected)


def test_embeddings_dimensions_and_truncation(http: httpx.Client, offline: LLM) -> None:
    body = http.post("/v1/embeddings", json={"input": TEXTS, "dimensions": 64}).json()
    expected = offline_embeddings(offline, TEXTS, pooling_params=PoolingParams(dimensions=64))
    assert_close([d["embedding"] for d in body["data"]], expected)
    long_text = "word " * 400  # 402 tokens > max_model_len 256
    body = http.post("/v1/embeddings", json={"input": long_text, "truncate_prompt_tokens": 16})
    expected = offline_embeddings(offline, [long_text], truncate_prompt_tokens=16)
    assert_close([body.json()["data"][0]["embedding"]], expected)
    assert body.json()["usage"]["prompt_tokens"] == 16
    body = http.post("/v1/embeddings", json={"input": long_text, "truncate_prompt_tokens": -1})
    assert body.json()["usage"]["prompt_tokens"] == 256


def test_pooling(http: httpx.Client, offline: LLM) -> None:
    body = http.post("/pooling", json={"input": TEXTS[:2]}).json()
    assert body["object"] == "list" and body["data"][0]["object"] == "pooling"
    assert_close([d["data"] for d in body["data"]], offline_embeddings(offline, TEXTS[:2]))
    tokens = http.post("/pooling", json={"input": "a b c", "task": "token_embed"}).json()
    assert np.asarray(tokens["data"][0]["data"]).shape == (5, 384)  # [CLS] a b c [SEP]


# ---------------------------------------------------------------------- score / rerank


def test_score_falls_back_to_embedding_cosine(http: httpx.Client, offline: LLM) -> None:
    query, docs = TEXTS[2], TEXTS[:4]
    expected = [o.outputs.score for o in offline.score(query, docs, use_tqdm=False)]
    for path in ("/score", "/v1/score"):
        body = http.post(path, json={"text_1": query, "text_2": docs, "model": SERVED_NAME}).json()
        assert body["object"] == "list" and body["id"].startswith("score-")
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
        assert all(d["object"] == "score" for d in body["data"])
        assert np.allclose([d["score"] for d in body["data"]], expected, atol=1e-5)
    pairs = http.post("/score", json={"text_1": docs[:2], "text_2": docs[2:4]}).json()
    expected_pairs = offline.score(docs[:2], docs[2:4], use_tqdm=False)
    assert np.allclose([d["score"] for d in pairs["data"]], [o.outputs.score for o in expected_pairs],
                       atol=1e-5)  # fmt: skip


def test_rerank_routes(http: httpx.Client, offline: LLM) -> None:
    query, docs = TEXTS[2], TEXTS[:5]
    expected = [o.outputs.score for o in offline.score(query, docs, use_tqdm=False)]
    order = sorted(range(len(docs)), key=lambda i: -expected[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = http.post(path, json={"query": query, "documents": docs, "top_n": 3}).json()
        assert set(body) == {"id", "model", "usage", "results"}
        assert [r["index"] for r in body["results"]] == order[:3]
        for r in body["results"]:
            assert r["document"] == {"text": docs[r["index"]]}
            assert abs(r["relevance_score"] - expected[r["index"]]) < 1e-5
        assert body["usage"]["total_tokens"] > 0
    # Cohere v1 / Jina style: document objects, no documents echoed back, top_n 0 = all.
    objects = [{"text": d} for d in docs]
    body = http.post(
        "/v2/rerank", json={"query": query, "documents": objects, "return_documents": False}
    ).json()
    assert [r["index"] for r in body["results"]] == order
    assert all("document" not in r for r in body["results"])


# ---------------------------------------------------------------------- other routes


def test_tokenize_detokenize(http: httpx.Client, offline: LLM) -> None:
    expected = offline.get_tokenizer()("Hello world")["input_ids"]
    body = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert body == {
        "count": len(expected),
        "max_model_len": 256,
        "tokens": expected,
        "token_strs": ["[CLS]", "hello", "world", "[SEP]"],
    }
    plain = http.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False})
    assert plain.json()["tokens"] == expected[1:-1]
    text = http.post("/detokenize", json={"tokens": expected[1:-1]}).json()
    assert text == {"prompt": "hello world"}


def test_models_health_version_metrics(http: httpx.Client, openai_client) -> None:
    ids = [m.id for m in openai_client.models.list().data]
    assert ids == [SERVED_NAME, MINILM_ID]
    card = http.get("/v1/models").json()["data"][0]
    assert card["object"] == "model" and card["max_model_len"] == 256
    assert http.get("/health").status_code == 200
    assert http.get("/version").json() == {"version": __import__("tidepool").__version__}
    metrics = http.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    labels = {"route": "/v1/embeddings", "status": "200"}
    assert metric_value(text, "tidepool:http_requests_total", labels) >= 1
    assert metric_value(text, "tidepool:prompt_tokens_total", {"route": "/v1/embeddings"}) > 0
    for name in (
        "tidepool:http_request_duration_seconds_bucket",
        "tidepool:num_requests_waiting",
        "tidepool:num_requests_unfinished",
        "tidepool:step_num_requests_bucket",
        "tidepool:engine_steps_total",
        "tidepool:requests_aborted_total",
    ):
        assert name in text, name


def test_generation_routes_say_the_model_does_not_generate(http: httpx.Client) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = http.post(path, json={"model": SERVED_NAME, "prompt": "hi", "messages": []})
        assert response.status_code == 400
        assert "does not generate" in response.json()["error"]["message"]


# ---------------------------------------------------------------------- bad inputs

LONG = "word " * 400
BAD_REQUESTS = [
    # (id, method, path, json body, status, words the message must contain)
    ("empty-string", "POST", "/v1/embeddings", {"input": ""}, 400, "empty string"),
    ("empty-list", "POST", "/v1/embeddings", {"input": []}, 400, "empty list"),
    ("one-empty-of-two", "POST", "/v1/embeddings", {"input": ["ok", ""]}, 400, "input[1]"),
    ("number", "POST", "/v1/embeddings", {"input": 5}, 400, "got int"),
    ("object", "POST", "/v1/embeddings", {"input": {"text": "x"}}, 400, "got object"),
    ("mixed-types", "POST", "/v1/embeddings", {"input": ["a", 3.5]}, 400, "input[1] has type float"),
    ("bad-token-id", "POST", "/v1/embeddings", {"input": [[101, -1]]}, 400, "outside the vocabulary"),
    ("empty-token-ids", "POST", "/v1/embeddings", {"input": [[]]}, 400, "empty"),
    ("too-long", "POST", "/v1/embeddings", {"input": LONG}, 400, "402 tokens|256"),
    ("dimensions-0", "POST", "/v1/embeddings", {"input": "x", "dimensions": 0}, 400, "dimensions"),
    ("dimensions-big", "POST", "/v1/embeddings", {"input": "x", "dimensions": 1000}, 400, "384"),
    ("truncate-0", "POST", "/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 0}, 400,
     "truncate_prompt_tokens"),
    ("truncate-big", "POST", "/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 999}, 400,
     "larger than max_model_len"),
    ("bad-format", "POST", "/v1/embeddings", {"input": "x", "encoding_format": "xml"}, 422,
     "encoding_format"),
    ("missing-input", "POST", "/v1/embeddings", {"inputs": "x"}, 422, "input: Field required"),
    ("dimensions-type", "POST", "/v1/embeddings", {"input": "x", "dimensions": "many"}, 422,
     "dimensions"),
    ("unknown-model", "POST", "/v1/embeddings", {"input": "x", "model": "gpt-4"}, 404,
     "`gpt-4` does not exist"),
    ("too-many-inputs", "POST", "/v1/embeddings", {"input": ["x"] * (MAX_INPUTS + 1)}, 413,
     f"{MAX_INPUTS + 1} items"),
    ("body-too-big", "POST", "/v1/embeddings", {"input": "x" * MAX_BODY_BYTES}, 413,
     "--max-request-body-bytes"),
    ("score-n-to-m", "POST", "/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, 400,
     "1-to-N"),
    ("score-type", "POST", "/score", {"text_1": 5, "text_2": "a"}, 400, "text_1"),
    ("rerank-no-docs", "POST", "/rerank", {"query": "q", "documents": []}, 400, "documents"),
    ("rerank-empty-query", "POST", "/rerank", {"query": "", "documents": ["d"]}, 400, "query"),
    ("rerank-top-n", "POST", "/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, 400,
     "top_n"),
    ("classify-embedder", "POST", "/classify", {"input": "x"}, 400, "embedding model"),
    ("detokenize-range", "POST", "/detokenize", {"tokens": [999999]}, 400, "vocabulary"),
    ("tokenize-nothing", "POST", "/tokenize", {}, 400, "prompt"),
    ("unknown-route", "POST", "/v1/nowhere", {}, 404, "Not Found"),
    ("wrong-method", "GET", "/v1/embeddings", None, 405, "Method Not Allowed"),
]  # fmt: skip


@pytest.mark.parametrize(
    "method,path,body,status,words", [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)  # fmt: skip
def test_bad_input_answers_error_and_server_keeps_serving(
    http: httpx.Client, method: str, path: str, body, status: int, words: str
) -> None:
    response = http.request(method, path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert any(w in error["message"] for w in words.split("|")), error["message"]
    assert http.post("/v1/embeddings", json={"input": "still alive"}).status_code == 200


def test_invalid_json_and_chunked_oversize_body(http: httpx.Client) -> None:
    headers = {"content-type": "application/json"}
    response = http.post("/v1/embeddings", content=b'{"input": ', headers=headers)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while reading
        yield b'{"input": "'
        for _ in range(MAX_BODY_BYTES // 10_000 + 1):
            yield b"x" * 10_000
        yield b'"}'

    response = http.post("/v1/embeddings", content=chunks(), headers=headers)
    assert response.status_code == 413
    assert http.get("/health").status_code == 200


def test_openai_client_raises_typed_errors(openai_client) -> None:
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError, match="empty string"):
        openai_client.embeddings.create(model=SERVED_NAME, input="")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        openai_client.embeddings.create(model="nope", input="x")


# ---------------------------------------------------------------------- concurrency


def _load_texts(num: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = "tide pool engine batch token vector ocean river query answer fast slow".split()
    return [
        f"request {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(3, 40)))
        for i in range(num)
    ]


def test_many_concurrent_clients_share_steps_and_lose_nothing(
    server: ServerProcess, http: httpx.Client, offline: LLM
) -> None:
    num_requests = 240
    texts = _load_texts(num_requests + 40, seed=1)
    # Most requests carry one text; every 10th carries three (several inputs per request).
    payloads = [
        texts[i : i + 3] if i % 10 == 0 else texts[i] for i in range(num_requests)
    ]  # fmt: skip
    steps_before = metric_value(http.get("/metrics").text, "tidepool:engine_steps_total")

    async def run_all() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=num_requests, max_keepalive_connections=num_requests)
        async with httpx.AsyncClient(base_url=server.url, timeout=120.0, limits=limits) as client:
            return await asyncio.gather(
                *(client.post("/v1/embeddings", json={"input": p}) for p in payloads)
            )

    responses = asyncio.run(run_all())
    assert [r.status_code for r in responses] == [200] * num_requests
    unique = sorted({t for p in payloads for t in ([p] if isinstance(p, str) else p)})
    reference = dict(zip(unique, offline_embeddings(offline, unique), strict=True))
    for payload, response in zip(payloads, responses, strict=True):
        inputs = [payload] if isinstance(payload, str) else payload
        data = response.json()["data"]
        assert [d["index"] for d in data] == list(range(len(inputs)))
        assert_close([d["embedding"] for d in data], torch.stack([reference[t] for t in inputs]))
    num_steps = (
        metric_value(http.get("/metrics").text, "tidepool:engine_steps_total") - steps_before
    )
    assert num_steps < num_requests / 4, f"{num_steps} steps for {num_requests} requests"


# ---------------------------------------------------------------------- disconnects


def _raw_post(port: int, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def _wait_until_idle(http: httpx.Client, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if metric_value(http.get("/metrics").text, "tidepool:num_requests_unfinished") == 0:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"the engine still had requests after {timeout_s} s")


def test_client_disconnect_aborts_its_requests(server: ServerProcess, http: httpx.Client) -> None:
    before = http.get("/metrics").text
    aborted_before = metric_value(before, "tidepool:requests_aborted_total")
    finished_before = metric_value(before, "tidepool:requests_finished_total")
    # 60 texts of 250 tokens = 15k tokens: ~8 steps of 2048 tokens, several seconds of work.
    texts = [f"{i} " + "lorem ipsum " * 124 for i in range(60)]
    body = {"input": texts, "truncate_prompt_tokens": 250}
    sock = _raw_post(server.port, "/v1/embeddings", body)
    deadline = time.monotonic() + 10
    while not metric_value(http.get("/metrics").text, "tidepool:num_requests_unfinished"):
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.02)
    sock.close()  # the client goes away while the first step runs
    _wait_until_idle(http, timeout_s=10.0)
    after = http.get("/metrics").text
    num_aborted = metric_value(after, "tidepool:requests_aborted_total") - aborted_before
    num_finished = metric_value(after, "tidepool:requests_finished_total") - finished_before
    assert num_aborted + num_finished == len(texts)  # every input either ran or was aborted
    assert num_aborted >= len(texts) / 2, (num_aborted, num_finished)
    labels = {"route": "/v1/embeddings", "status": "499"}
    assert metric_value(after, "tidepool:http_requests_total", labels) >= 1
    # The engine goes on serving.
    assert http.post("/v1/embeddings", json={"input": "after the disconnect"}).status_code == 200


def test_log_has_no_tracebacks(server: ServerProcess) -> None:
    assert "Traceback" not in server.log()
