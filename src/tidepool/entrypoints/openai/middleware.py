"""The server's pure-ASGI middlewares, outermost first:

metrics ─▶ api key (401) ─▶ admission (429, admission.py) ─▶ body size (413) ─▶ JSON body
        ─▶ internal errors (500) ─▶ routes
"""

from __future__ import annotations

import hmac
import logging
import time

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


class BodyLimitMiddleware:
    """413 for bodies over the limit: by Content-Length up front, else while streaming in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

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
        num_received = 0

        async def counting_receive() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_bytes:  # chunked upload without a Content-Length
                    raise HTTPException(413, self._message(None))
            return message

        await self.app(scope, counting_receive, send)


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
