"""The engine routes' fast path (fast_routes.py): it answers the bodies it takes as FastAPI did,
hands every other body to FastAPI (same status, same error JSON), and follows FastAPI's rule
for a path two routes share (the first added answers)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

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
