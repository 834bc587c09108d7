"""The server's edges (issue 18): strict field types (422 naming the field), JSON bodies whatever
their Content-Type, an empty body (400), `bearer` in any case, lone surrogates (400 naming the
input), a 500 that leaves the keep-alive connection usable, the 503 of a request that shutdown
cut, and `--port` checked.

uvicorn runs in a thread over an app on a tiny random BERT embedder, so each test reaches the
engine and every request goes over a real keep-alive connection.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from serverlib import ThreadedServer, request_on, start_threaded_server

from tidepool.engine.async_engine import EngineClosedError, EngineStepError
from tidepool.entrypoints.openai.errors import ServerState, http_error

API_KEY = "sk-strict-test"
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from tidepool.engine.async_engine import AsyncEngine

    return AsyncEngine.from_args(str(tiny_model_path("bert")), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def server(engine) -> Iterator[ThreadedServer]:
    from tidepool.entrypoints.openai.server import ServerArgs, build_app

    srv = start_threaded_server(build_app(engine, ServerArgs(api_key=API_KEY)))
    yield srv
    srv.stop()


@pytest.fixture
def conn(server: ThreadedServer):
    connection = server.connection()
    yield connection
    connection.close()


def post(conn, path: str, body, headers: dict[str, str] | None = None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request_on(conn, "POST", path, data, {**AUTH, **(headers or {})})


def assert_error(answer, status: int, *words: str) -> dict:
    assert answer.status == status, answer.body
    error = answer.json()["error"]
    assert set(error) == ERROR_KEYS and error["code"] == status
    for word in words:
        assert word in error["message"], error["message"]
    return error


# ---------------------------------------------------------------------- strict types

NOT_COERCED = [
    # (path, body, the field the error must name)
    ("/v1/embeddings", {"input": "x", "dimensions": True}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "dimensions": "8"}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "dimensions": 8.0}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "normalize": "yes"}, "normalize"),
    ("/v1/embeddings", {"input": "x", "normalize": 1}, "normalize"),
    ("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": "4"}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": "x", "model": 5}, "model"),
    ("/pooling", {"input": "x", "activation": "false"}, "activation"),
    ("/classify", {"input": "x", "truncate_prompt_tokens": 2.5}, "truncate_prompt_tokens"),
    ("/score", {"text_1": "a", "text_2": "b", "activation": 0}, "activation"),
    ("/rerank", {"query": "q", "documents": ["d"], "top_n": "1"}, "top_n"),
    ("/rerank", {"query": "q", "documents": ["d"], "return_documents": "no"}, "return_documents"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "false"}, "add_special_tokens"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [101.0]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4.0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": "x", "stream": "true"}, "stream"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": ["1"]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "echo": 1}, "echo"),
    ("/v1/chat/completions", {"messages": [], "logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"messages": [], "stream_options": {"include_usage": 1}},
     "stream_options"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "field"), NOT_COERCED)
def test_wrong_types_are_refused_not_coerced(conn, path: str, body: dict, field: str) -> None:
    error = assert_error(post(conn, path, body), 422, field)
    assert error["param"] == field


def test_nan_and_infinity_are_refused(conn) -> None:
    # Python's JSON reader takes NaN and Infinity; no sampling value can mean them.
    for raw in (b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}'):
        assert_error(post(conn, "/v1/completions", raw), 422)


def test_right_types_still_pass(conn) -> None:
    body = {"input": "x", "dimensions": 8, "normalize": True, "truncate_prompt_tokens": -1}
    answer = post(conn, "/v1/embeddings", body)
    assert answer.status == 200, answer.body
    assert len(answer.json()["data"][0]["embedding"]) == 8


# ---------------------------------------------------------------------- body and content type


@pytest.mark.parametrize(
    "content_type",
    ["application/x-www-form-urlencoded", "text/plain", "application/json; charset=utf-8", None],
)
def test_json_body_is_read_whatever_its_content_type(conn, content_type) -> None:
    headers = {"Authorization": AUTH["Authorization"]}
    if content_type is not None:
        headers["Content-Type"] = content_type
    body = json.dumps({"input": ["a b", "c"]}).encode()
    answer = request_on(conn, "POST", "/v1/embeddings", body, headers)
    assert answer.status == 200, answer.body
    assert len(answer.json()["data"]) == 2


def test_form_body_says_what_is_expected(conn) -> None:
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    answer = post(conn, "/v1/embeddings", b"input=hello", form)
    assert_error(answer, 400, "not valid JSON", "application/x-www-form-urlencoded")


@pytest.mark.parametrize("path", ["/v1/embeddings", "/tokenize", "/v1/chat/completions"])
def test_empty_body_is_a_bad_request(conn, path: str) -> None:
    assert_error(post(conn, path, b""), 400, "empty")
    assert post(conn, "/tokenize", {"prompt": "still serving"}).status == 200


# ---------------------------------------------------------------------- api key


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_bearer_scheme_in_any_case(conn, scheme: str) -> None:
    answer = post(conn, "/tokenize", {"prompt": "x"}, {"Authorization": f"{scheme} {API_KEY}"})
    assert answer.status == 200, answer.body


@pytest.mark.parametrize("value", [f"Basic {API_KEY}", API_KEY, f"Bearer {API_KEY}x", "Bearer"])
def test_wrong_authorization_is_refused(conn, value: str) -> None:
    assert_error(post(conn, "/tokenize", {"prompt": "x"}, {"Authorization": value}), 401)


# ---------------------------------------------------------------------- lone surrogates

SURROGATE = "abc \\ud800"  # as JSON text: valid JSON, but no UTF-8 can carry it
SURROGATE_BODIES = [
    # (path, the raw JSON body, words the message must contain)
    ("/v1/embeddings", f'{{"input": "{SURROGATE}"}}', ["input", "surrogate"]),
    ("/v1/embeddings", f'{{"input": ["ok", "{SURROGATE}"]}}', ["input[1]", "surrogate"]),
    ("/pooling", f'{{"input": ["{SURROGATE}"]}}', ["input[0]"]),
    ("/classify", f'{{"input": ["ok", "{SURROGATE}"]}}', []),  # an embedder: 400 either way
    ("/score", f'{{"text_1": "ok", "text_2": ["ok", "{SURROGATE}"]}}', ["text_2[1]"]),
    ("/score", f'{{"text_1": "{SURROGATE}", "text_2": "ok"}}', ["text_1"]),
    ("/rerank", f'{{"query": "q", "documents": ["ok", "ok", "{SURROGATE}"]}}', ["documents[2]"]),
    ("/rerank", f'{{"query": "{SURROGATE}", "documents": ["ok"]}}', ["query"]),
    ("/tokenize", f'{{"prompt": "{SURROGATE}"}}', ["prompt", "surrogate"]),
    ("/tokenize", f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}',
     ["messages[0].content"]),
    ("/v1/embeddings", f'{{"input": "x", "model": "{SURROGATE}"}}', ["does not exist"]),
]  # fmt: skip


@pytest.mark.parametrize(("path", "raw", "words"), SURROGATE_BODIES)
def test_lone_surrogate_is_a_bad_request_naming_the_input(conn, path: str, raw: str, words):
    status = 404 if "model" in raw else 400
    assert_error(post(conn, path, raw.encode()), status, *words)
    assert post(conn, "/v1/embeddings", {"input": "next request"}).status == 200


# ---------------------------------------------------------------------- 500 and 503


def test_internal_error_keeps_the_connection(conn, engine, monkeypatch) -> None:
    async def broken_encode(*args, **kwargs):
        raise RuntimeError("injected bug")

    monkeypatch.setattr(engine, "encode", broken_encode)
    # request_on fails if the server closes the socket: the next request must reuse it.
    assert_error(post(conn, "/v1/embeddings", {"input": "x"}), 500, "injected bug")
    assert_error(post(conn, "/v1/embeddings", {"input": "x"}), 500, "injected bug")
    monkeypatch.undo()
    answer = post(conn, "/v1/embeddings", {"input": "x"})
    assert answer.status == 200, answer.body


def test_engine_errors_map_to_their_status() -> None:
    running, stopping = ServerState(), ServerState(stopping=True)
    assert http_error(EngineStepError("step failed"), running).status == 500
    # Shutdown's timeout cut the request: the service is going away, not broken.
    assert http_error(EngineStepError("stopped before finishing"), stopping).status == 503
    assert http_error(EngineClosedError("closed"), running).status == 503


# ---------------------------------------------------------------------- --port


@pytest.mark.parametrize("port", ["99999", "-1", "65536", "http"])
def test_port_out_of_range_is_an_argparse_error(port: str, capsys) -> None:
    from tidepool.entrypoints.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--port", port])
    assert exit_info.value.code == 2
    assert "--port" in capsys.readouterr().err


@pytest.mark.parametrize("port", [0, 1, 8000, 65535])
def test_valid_ports_are_taken(port: int) -> None:
    from tidepool.entrypoints.cli import build_parser

    assert build_parser().parse_args(["serve", "--port", str(port)]).port == port
