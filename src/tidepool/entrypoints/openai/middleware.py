"""The server's pure-ASGI middlewares, outermost first:

metrics ─▶ api key (401) ─▶ admission (429, admission.py) ─▶ body size (413) ─▶ JSON body
        ─▶ internal errors (500) ─▶ routes
"""

from __future__ import annotations

import hmac
import logging
import time

import numpy as np
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tidepool.entrypoints.openai.errors import error_response
from tidepool.entrypoints.openai.metrics import ServerMetrics

logger = logging.getLogger("tidepool")

# Routes anyone may call when --api-key is set (probes and scrapers carry no key).
PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})
STATUS_CLIENT_CLOSED = 499  # nginx's code for "client closed the request"; only seen in metrics
DECLARED_CONTENT_TYPE = "tidepool.declared_content_type"
"""Scope key: the content type a client declared for a body the server reads as JSON anyway."""
_JSON_SUBTYPES = (b"application/json",)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


class MetricsMiddleware:
    """Counts every request by route template and status, and times it."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, known_paths: set[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.known_paths = known_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = STATUS_CLIENT_CLOSED

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        except Exception:
            status = 500
            raise
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or scope.get("path", "")
            label = path if path in self.known_paths else "other"  # bounded label values
            self.metrics.observe_request(label, status, time.perf_counter() - start)


def check_api_key(key: str, source: str) -> str:
    """A key a client can send: ValueError for an empty one (which would serve every route
    unauthenticated) or one with whitespace around it (the header's value is stripped, so it
    could never match); `source` names where it came from (--api-key, TIDEPOOL_API_KEY)."""
    if not key.strip():
        raise ValueError(
            f"{source} is empty: give a key, or leave it out to serve without authentication"
        )
    if key != key.strip():
        raise ValueError(
            f"{source} has whitespace around it ({len(key) - len(key.lstrip())} before, "
            f"{len(key) - len(key.rstrip())} after): clients send the key without it, so it could "
            "never match; remove it"
        )
    return key


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches (the scheme in any case, as RFC 7235
    says; the key compared in constant time)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, credentials = (_header(scope, b"authorization") or b"").partition(b" ")
        given = credentials.strip(b" ")
        # Compare even when the scheme is wrong, so that the time taken says nothing.
        key_matches = hmac.compare_digest(given, self.expected)
        return scheme.lower() == b"bearer" and key_matches

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            message = "Unauthorized: give the server's API key as 'Authorization: Bearer <key>'"
            await error_response(401, message)(scope, receive, send)
            return
        await self.app(scope, receive, send)


MAX_JSON_DEPTH = 64
"""Most levels of arrays and objects a request body may nest. Real bodies nest a few (a chat
message's content parts: 4); without a limit a ~1,000-deep body ran into the recursion limits
of parsers and of code walking it, differently on each path (a 500 on one, a 400 on another)."""
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
_NESTING_STEP = np.zeros(256, np.int8)
_NESTING_STEP[[ord("["), ord("{")]] = 1
_NESTING_STEP[[ord("]"), ord("}")]] = -1


def json_depth(raw: bytes) -> int:
    """How deep `raw` nests arrays and objects (brackets in strings not counted), for bodies
    with more brackets than MAX_JSON_DEPTH; fewer cannot nest deeper, and are not scanned."""
    if b"\\" in raw:
        # Escaped backslashes, then escaped quotes, are text: dropped, left to right as JSON
        # pairs each backslash with the byte after it, no quote left can be one of them.
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    raw = raw.translate(None, _NOT_STRUCTURE)  # only brackets and quotes are left
    array = np.frombuffer(raw, np.uint8)
    steps = _NESTING_STEP[array]
    if b'"' in raw:
        # A byte after an odd number of quotes is inside a string (its closing quote excluded).
        steps[np.cumsum(array == ord('"'), dtype=np.int64) % 2 == 1] = 0
    steps = steps[steps != 0]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0)) if len(steps) else 0


def _nesting_error(depth: int) -> HTTPException:
    return HTTPException(
        400,
        f"the request body nests arrays and objects {depth} levels deep; this server reads at "
        f"most {MAX_JSON_DEPTH}",
    )


class BodyLimitMiddleware:
    """413 for bodies over the limit: by Content-Length up front, else while streaming in; 400
    for a body nesting deeper than MAX_JSON_DEPTH, once it is in (every route, on every path:
    the check is in the body's stream, before any parser reads it)."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_depth = max_depth

    def _message(self, num_bytes: int | None) -> str:
        size = f"{num_bytes} bytes" if num_bytes is not None else "more"
        return (
            f"the request body has {size}; this server accepts at most {self.max_bytes} bytes "
            "(--max-request-body-bytes, alias --max-input-bytes)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await error_response(413, self._message(int(length)))(scope, receive, send)
            return
        num_received = num_brackets = 0
        chunks: list[bytes] = []

        async def checking_receive() -> Message:
            nonlocal num_received, num_brackets
            message = await receive()
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                num_received += len(chunk)
                if num_received > self.max_bytes:  # chunked upload without a Content-Length
                    raise HTTPException(413, self._message(None))
                chunks.append(chunk)
                num_brackets += chunk.count(b"[") + chunk.count(b"{")
                if not message.get("more_body", False) and num_brackets > self.max_depth:
                    depth = json_depth(b"".join(chunks))
                    if depth > self.max_depth:
                        raise _nesting_error(depth)
            return message

        await self.app(scope, checking_receive, send)


class JsonBodyMiddleware:
    """Every request body is read as JSON, whatever its Content-Type: curl sends
    `application/x-www-form-urlencoded` unless told otherwise, and a JSON body sent that way is
    still the JSON the client meant. The declared type is kept for the error message of a body
    that is not JSON."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "PATCH"):
            declared = _header(scope, b"content-type")
            media_type = (declared or b"").split(b";", 1)[0].strip().lower()
            if media_type not in _JSON_SUBTYPES and not media_type.endswith(b"+json"):
                headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                headers.append((b"content-type", b"application/json"))
                scope = {**scope, "headers": headers}
                if declared:
                    scope[DECLARED_CONTENT_TYPE] = declared.decode("latin-1")
        await self.app(scope, receive, send)


class InternalErrorMiddleware:
    """An exception no handler took → OpenAI's JSON 500, and the connection stays usable.

    Starlette's own last-resort handler re-raises after answering, and uvicorn then closes the
    keep-alive connection (the client's next request on it fails with a reset): this one answers
    and returns. A response already started (a stream) is ended cleanly instead."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = finished = False

        async def tracking_send(message: Message) -> None:
            nonlocal started, finished
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.error("unhandled error in a request", exc_info=exc)
            if not started:
                message = f"internal server error: {type(exc).__name__}: {exc}"
                await error_response(500, message)(scope, receive, send)
            elif not finished:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
