"""The engine routes' fast path (fast_routes.py): it answers the bodies it takes as FastAPI did,
hands every other body to FastAPI (same status, same error JSON), and follows FastAPI's rule
for a path two routes share (the first added answers)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidepool.entrypoints.openai.fast_routes import FAST_ROUTE, FastRoute, FastRoutesMiddleware
from tidepool.entrypoints.openai.server import ServerArgs, build_app

JSON = {"Content-Type": "application/json"}

# Bodies FastAPI answers itself (the fast path declines them) and bodies it takes.
DECLINED = [
    b"",
    b"{not json",
    b"[1, 2]",
    b'"a string"',
    b'{"input": "a", "dimensions": NaN}',  # the json module reads NaN, orjson does not
    b'{"input": "a", "dimensions": 123456789012345678901234567890}',
    b'{"input": "a", "dimensions": "8"}',
    b'{"input": "a", "normalize": "yes"}',
    b'{"dimensions": 8}',
    '{"input": "caf\u00e9"}'.encode("utf-16"),
]
TAKEN = [
    b'{"input": "a short text"}',
    b'{"input": ["one", "two three"], "encoding_format": "base64", "extra": 1}',
    b'{"input": "", "model": "nope"}',  # taken, then refused by the route (400 / 404)
    b'{"input": "x", "dimensions": 100000}',
]


def _app(engine_path: str, fast: bool, **args):
    from tidepool.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_args(engine_path, device="cpu", dtype="float32")
    app = build_app(engine, ServerArgs(**args))
    if not fast:
        app.user_middleware = [m for m in app.user_middleware if m.cls is not FastRoutesMiddleware]
    return app


def _fast_table(app) -> dict[str, FastRoute]:
    (middleware,) = [m for m in app.user_middleware if m.cls is FastRoutesMiddleware]
    return middleware.kwargs["routes"]


@pytest.fixture(scope="module")
def clients(tiny_model_path) -> Iterator[tuple[TestClient, TestClient, list[str]]]:
    path = str(tiny_model_path("bert"))
    fast_app, slow_app = _app(path, fast=True), _app(path, fast=False)
    taken: list[str] = []
    table = _fast_table(fast_app)
    for route_path, route in list(table.items()):

        async def counted(request, route=route, route_path=route_path):
            try:
                response = await route.handler(request)
            except Exception:  # taken, then refused by the route (an ApiError → 400 / 404)
                taken.append(route_path)
                raise
            if response is not None:
                taken.append(route_path)
            return response

        table[route_path] = FastRoute(counted)
    with TestClient(fast_app) as fast, TestClient(slow_app) as slow:
        yield fast, slow, taken


def _comparable(response) -> tuple[int, object]:
    body = response.json()
    if response.status_code == 200:
        body = {k: v for k, v in body.items() if k not in ("id", "created")}
    return response.status_code, body


@pytest.mark.parametrize("body", DECLINED + TAKEN)
def test_fast_path_answers_as_fastapi(clients, body: bytes) -> None:
    fast, slow, taken = clients
    before = len(taken)
    fast_answer = fast.post("/v1/embeddings", content=body, headers=JSON)
    slow_answer = slow.post("/v1/embeddings", content=body, headers=JSON)
    assert _comparable(fast_answer) == _comparable(slow_answer)
    assert fast_answer.headers["content-type"] == slow_answer.headers["content-type"]
    assert (len(taken) > before) == (body in TAKEN), "the fast path took / declined the body"


def test_fast_path_on_tei_embed_and_errors(clients) -> None:
    fast, slow, taken = clients
    for body in (b'{"inputs": "a text"}', b'{"inputs": 5}', b"{"):
        fast_answer = fast.post("/embed", content=body, headers=JSON)
        slow_answer = slow.post("/embed", content=body, headers=JSON)
        assert fast_answer.status_code == slow_answer.status_code
        assert fast_answer.json() == slow_answer.json()
    assert "/embed" in taken
    assert fast.get("/v1/embeddings").status_code == slow.get("/v1/embeddings").status_code == 405


def test_fast_table_follows_the_first_route(tiny_model_path) -> None:
    """With --api-style tei, TEI's /rerank is added first and answers /rerank: the fast path
    must run that route's handler too, not vLLM's."""
    app = _app(str(tiny_model_path("bert")), fast=True, api_style="tei")
    table = _fast_table(app)
    post_routes = [r for r in app.routes if getattr(r, "path", "") == "/rerank"]
    assert len(post_routes) == 2
    assert table["/rerank"] is getattr(post_routes[0].endpoint, FAST_ROUTE)
    assert table["/v1/rerank"] is getattr(
        next(r for r in app.routes if getattr(r, "path", "") == "/v1/rerank").endpoint, FAST_ROUTE
    )
    assert {"/v1/embeddings", "/embed", "/v2/embed", "/v1/completions"} <= set(table)
    assert json.dumps(sorted(table))  # every key a plain path


# ---------------------------------------------------------------------- both paths, any body
#
# Issue 26: the fast path and FastAPI answered 4 of 159 bodies differently (integers above
# 2^64, which orjson reads as floats) and a body nested ~1,000 deep was a 500 on the fast path.
# Every body below goes through both apps: the same status, the same JSON, never a 5xx.

COMPARED_ROUTES = [
    "/v1/embeddings", "/pooling", "/classify", "/score", "/rerank", "/tokenize", "/detokenize",
    "/v2/embed", "/embed", "/embed_all", "/embed_sparse", "/v1/completions",
    "/v1/chat/completions",
]  # fmt: skip
FIELDS = [
    "input", "inputs", "texts", "text_1", "text_2", "queries", "documents", "data_1", "data_2",
    "query", "messages", "prompt", "tokens", "model", "dimensions", "output_dimension",
    "encoding_format", "embedding_types", "embed_dtype", "truncate", "normalize", "top_n",
    "seed", "max_tokens", "chat_template_kwargs", "prompt_name",
]  # fmt: skip
EDGE_NUMBERS = [
    0, -1, 1, 7, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**19,
    10**30, -(10**30), 2**70, 0.5, -0.0, 1e308, 1e-300, float("nan"), float("inf"), -float("inf"),
]  # fmt: skip
DEPTHS = [2, 16, 63, 64, 65, 100, 200, 989, 990, 1000, 1023, 1024, 1025, 1500]
DEEP = "\x00deep\x00"
"""Placeholder for a nested value written as bytes (json.dumps itself stops near 1,000)."""

strings = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", " ", "a", "\ud800", "[[[", '{"a": [', "caf\u00e9", "x" * 300]),
    st.sampled_from(["float", "base64", "int8", "ubinary", "END", "NONE", "query", "embed"]),
)
scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(EDGE_NUMBERS), st.integers(), strings)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(strings, inner, max_size=3),
    max_leaves=8,
)


@st.composite
def deep_value(draw) -> bytes:
    """An array / object nested `depth` levels (a short pattern of both, repeated) around a
    scalar or a list of token ids."""
    depth = draw(st.sampled_from(DEPTHS))
    pattern = draw(st.lists(st.sampled_from(["[", '{"k":']), min_size=1, max_size=3))
    kinds = [pattern[i % len(pattern)] for i in range(depth)]
    inner = draw(st.sampled_from([b"1", b'"text"', b"[1, 2, 3]", b"null", b"[]"]))
    closing = b"".join(b"]" if k == "[" else b"}" for k in reversed(kinds))
    return "".join(kinds).encode() + inner + closing


CONTENT = {
    "/v1/embeddings": ["input"], "/pooling": ["input"], "/classify": ["input"],
    "/score": ["text_1", "text_2", "queries", "documents", "data_1", "data_2"],
    "/rerank": ["query", "documents"], "/tokenize": ["prompt", "messages"],
    "/detokenize": ["tokens"], "/v2/embed": ["texts"], "/embed": ["inputs"],
    "/embed_all": ["inputs"], "/embed_sparse": ["inputs"], "/v1/completions": ["prompt"],
    "/v1/chat/completions": ["messages"],
}  # fmt: skip
"""The fields each route reads loosely (the checks walk them): where deep or odd values go."""
token_lists = st.lists(
    st.one_of(st.integers(0, 500), st.sampled_from(EDGE_NUMBERS)), min_size=1, max_size=4
)


@st.composite
def any_body(draw, route: str) -> bytes:
    if draw(st.integers(0, 9)) == 0:  # a top-level array, number, string or nesting
        return draw(deep_value()) if draw(st.booleans()) else json.dumps(draw(values)).encode()
    content = draw(st.sampled_from(CONTENT[route]))
    body, deep = {}, None
    kind = draw(st.integers(0, 4))  # the content field: mostly nesting or numbers at the edges
    if kind <= 1:
        body[content], deep = DEEP, draw(deep_value())
    elif kind <= 3:
        body[content] = draw(token_lists | st.lists(token_lists, min_size=1, max_size=2))
    else:
        body[content] = draw(values)
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=2, unique=True)):
        body.setdefault(name, draw(values))
    raw = json.dumps(body).encode()
    return raw.replace(json.dumps(DEEP).encode(), deep) if deep is not None else raw


def _answer(response) -> tuple[int, object]:
    try:
        body = response.json()
    except ValueError:
        body = response.text
    if response.status_code == 200 and isinstance(body, dict):
        body = {k: v for k, v in body.items() if k not in ("id", "created")}
    return response.status_code, body


@pytest.mark.slow
@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_both_paths_answer_every_body_alike(clients, data) -> None:
    fast, slow, _ = clients
    route = data.draw(st.sampled_from(COMPARED_ROUTES), label="route")
    raw = data.draw(any_body(route), label="body")
    fast_answer = _answer(fast.post(route, content=raw, headers=JSON))
    slow_answer = _answer(slow.post(route, content=raw, headers=JSON))
    assert fast_answer == slow_answer, raw[:300]
    assert fast_answer[0] < 500, (fast_answer, raw[:300])


@pytest.mark.parametrize("route", ["/score", "/v1/embeddings", "/v2/embed", "/embed"])
@pytest.mark.parametrize("depth", [63, 64, 990, 1000, 1024, 1025])
def test_deep_bodies_are_refused_alike(clients, route: str, depth: int) -> None:
    fast, slow, _ = clients
    field = {"/score": "text_1", "/v2/embed": "texts", "/embed": "inputs"}.get(route, "input")
    raw = f'{{"{field}": {"[" * depth}"a"{"]" * depth}, "text_2": "b"}}'.encode()
    fast_answer, slow_answer = (
        _answer(fast.post(route, content=raw, headers=JSON)),
        _answer(slow.post(route, content=raw, headers=JSON)),
    )
    assert fast_answer == slow_answer
    if depth + 1 > 64:  # the body's own object is a level too
        assert fast_answer[0] == 400
        assert f"nests arrays and objects {depth + 1} levels deep" in json.dumps(fast_answer[1])
    else:
        assert fast_answer[0] < 500


@pytest.mark.parametrize(
    "raw",
    [
        b'{"input": [1, 18446744073709551616]}',
        b'{"input": [1, -9223372036854775809]}',
        b'{"input": [[5, 100000000000000000000000]]}',
        b'{"input": "a", "dimensions": 18446744073709551616}',
        b'{"input": [1, NaN]}',
    ],
)
def test_big_integers_and_nan_answer_alike(clients, raw: bytes) -> None:
    fast, slow, _ = clients
    fast_answer = _answer(fast.post("/v1/embeddings", content=raw, headers=JSON))
    assert fast_answer == _answer(slow.post("/v1/embeddings", content=raw, headers=JSON))
    assert fast_answer[0] in (400, 422), fast_answer
    if b"NaN" in raw:  # the item that is wrong, not the good one before it
        assert fast_answer[1]["error"]["message"].startswith("input[1] is NaN")
