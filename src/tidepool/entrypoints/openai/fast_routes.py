"""The engine routes' POSTs answered without FastAPI's per-request machinery, same answers.

    middlewares (metrics, 401, 429, 413, JSON body, 500) ─▶ FastRoutesMiddleware
        POST to a path whose first route is marked (mark_fast) ─▶ the route's own handler
            its body: orjson, then the same pydantic validation FastAPI runs (python mode)
            anything the fast path does not take as is (not JSON for orjson, not an object,
            an integer orjson would read as a float, fails validation, the client left while
            it was sent) ─▶ declined
        declined, or any other request ─▶ FastAPI (the body it read replayed), as before

Why: on one-text requests FastAPI's routing, dependency solving, body parsing (the standard
json module) and its wrappers were ~15-20% of the event loop's CPU, on the same two cores as the
model. What FastAPI still does for a taken request is done here the same way: its exception
handlers' mapping (ApiError and the engine's errors → errors.py; an HTTPException, e.g. the body
limit's 413 raised while the body streams in → its status). A body the fast path declines gets
FastAPI's own answer (its 400 / 422 wording), so every error keeps its shape.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tidepool.entrypoints.openai.errors import (
    MAPPED_ERRORS,
    ServerState,
    error_response,
    exception_response,
)


def _orjson() -> ModuleType | None:
    try:
        import orjson
    except ImportError:  # every request then goes through FastAPI
        return None
    return orjson


orjson = _orjson()

FAST_ROUTE = "tidepool_fast_route"
"""The attribute of a route's endpoint that holds its FastRoute."""

FastHandler = Callable[[Request], Awaitable[Response | None]]
"""The request (its body unread) → the answer, or None: declined, FastAPI answers instead."""


@dataclass(frozen=True)
class FastRoute:
    handler: FastHandler


def mark_fast(endpoint: Callable[..., Any], handler: FastHandler) -> None:
    """Let FastRoutesMiddleware answer `endpoint`'s route with `handler`."""
    setattr(endpoint, FAST_ROUTE, FastRoute(handler))


_DIGITS_AS_ZEROS = bytes(ord("0") if chr(b).isdigit() else ord(" ") for b in range(128)) + bytes(
    [ord(" ")] * 128
)
_NINETEEN_DIGITS = b"0" * 19


def may_hold_a_big_integer(raw: bytes) -> bool:
    """Whether `raw` has a run of 19 digits: every integer orjson cannot hold (above 2^64 - 1,
    below -2^63: it reads them as floats, where the json module FastAPI uses keeps them
    exact) has one. A run inside a string or a long fraction declines a body needlessly, and
    costs only FastAPI's answer instead of the fast path's."""
    return _NINETEEN_DIGITS in raw.translate(_DIGITS_AS_ZEROS)


def validated_body(body_type: type[BaseModel]) -> Callable[[Request], Awaitable[Any]]:
    """Reads a request's body as FastAPI does for a `body: body_type` parameter; None for any
    body it should answer itself (FastAPI's 400 / 422 are then its own)."""

    async def read(request: Request) -> Any:
        if orjson is None:
            return None
        try:
            raw = await request.body()
        except ClientDisconnect:
            return None
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError:  # also what json.loads would read and orjson not
            return None
        if may_hold_a_big_integer(raw):  # orjson made a float of it, json.loads an int
            return None
        if not isinstance(value, dict):
            return None
        try:
            return body_type.model_validate(value, from_attributes=True)
        except ValidationError:
            return None

    return read


def fast_table(routes: Sequence[BaseRoute]) -> dict[str, FastRoute]:
    """Path → FastRoute, for each marked route that is the one FastAPI's router runs for a POST
    to its path (the first that matches in full: where two share a path, the first added)."""
    table: dict[str, FastRoute] = {}
    for route in routes:
        fast = getattr(getattr(route, "endpoint", None), FAST_ROUTE, None)
        path = getattr(route, "path", None)
        if fast is not None and path is not None and _first_match(routes, path) is route:
            table.setdefault(path, fast)
    return table


def _first_match(routes: Sequence[BaseRoute], path: str) -> BaseRoute | None:
    scope = {"type": "http", "path": path, "method": "POST", "root_path": ""}
    return next((r for r in routes if r.matches(scope)[0] is Match.FULL), None)


class FastRoutesMiddleware:
    """The innermost of the server's middlewares (see the module docstring)."""

    def __init__(self, app: ASGIApp, routes: dict[str, FastRoute], state: ServerState) -> None:
        self.app = app
        self.routes = routes
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = None
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self.routes.get(scope["path"])
        if route is None:
            await self.app(scope, receive, send)
            return
        received: list[Message] = []

        async def recording_receive() -> Message:
            message = await receive()
            received.append(message)
            return message

        try:
            response = await route.handler(Request(scope, recording_receive))
        except HTTPException as exc:  # FastAPI's handler of it (server.py) answers so
            response = error_response(exc.status_code, str(exc.detail))
        except MAPPED_ERRORS as exc:
            response = exception_response(exc, self.state)
        if response is None:
            await self.app(scope, _replay(received, receive), send)
            return
        await response(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """`receive`, the messages already taken from it given again first."""
    pending = list(messages)

    async def replaying_receive() -> Message:
        return pending.pop(0) if pending else await receive()

    return replaying_receive
