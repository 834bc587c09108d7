"""The OpenAI-compatible HTTP server: thin FastAPI routes over `OpenAIServing` and one AsyncEngine.

    client ─▶ metrics ─▶ api key (401) ─▶ body size (413) ─▶ route ─▶ OpenAIServing ─▶ AsyncEngine

Routes and JSON mirror `vllm serve`: pooling routes, and /v1/completions and /v1/chat/completions
(JSON, or server-sent events with `stream`) on a generating model. Every error answers OpenAI's shape:
{"error": {"message", "type", "param", "code"}} with `code` = the HTTP status, as vLLM does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, fields
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tidepool
from tidepool.engine.async_engine import AsyncEngine, EngineClosedError, EngineStepError
from tidepool.entrypoints.openai import protocol as p
from tidepool.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from tidepool.entrypoints.openai.serving import ApiError, OpenAIServing, ServingLimits
from tidepool.entrypoints.openai.serving_generate import OpenAIServingGeneration

logger = logging.getLogger("tidepool")

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}
# Routes anyone may call when --api-key is set (probes and scrapers carry no key).
PUBLIC_PATHS = frozenset({"/health", "/version", "/metrics"})
STATUS_CLIENT_CLOSED = 499  # nginx's code for "client closed the request"; only seen in metrics


@dataclass(frozen=True)
class ServerArgs:
    served_model_name: list[str] | None = None
    """Names clients may put in `model`; the first is echoed back. None = the model argument."""
    api_key: str | None = None
    """When set, requests need `Authorization: Bearer <api_key>` (except PUBLIC_PATHS)."""
    max_request_body_bytes: int = 32 * 1024 * 1024
    """Larger request bodies are refused with 413 before they are read."""
    max_inputs_per_request: int = 2048
    """More inputs (texts, documents, pairs) in one request → 413."""
    shutdown_timeout_s: float = 30.0
    """How long shutdown waits for in-flight requests to finish."""

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerArgs:
        values = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}
        return cls(**values)


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    error = p.ErrorInfo(
        message=message, type=ERROR_TYPES.get(status, "Error"), param=param, code=status
    )
    return JSONResponse(p.ErrorResponse(error=error).model_dump(), status_code=status)


def _json(body: BaseModel, exclude_none: bool = False) -> Response:
    return Response(body.model_dump_json(exclude_none=exclude_none), media_type="application/json")


# ---------------------------------------------------------------------- middlewares (pure ASGI)


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
    """401 unless `Authorization: Bearer <key>` matches (compared in constant time)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
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
            "(--max-request-body-bytes)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
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


# ---------------------------------------------------------------------- disconnects


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def serve_until_disconnect(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """Run `work`; if the client disconnects first, cancel it (which aborts its engine requests)."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    if work_task in done:
        watch_task.cancel()
        return work_task.result()
    work_task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await work_task
    return Response(status_code=STATUS_CLIENT_CLOSED)


# ---------------------------------------------------------------------- app


def build_app(engine: AsyncEngine, args: ServerArgs | argparse.Namespace | None = None) -> FastAPI:
    """The FastAPI app over `engine`; the app's lifespan starts and drains the engine."""
    if isinstance(args, argparse.Namespace):
        args = ServerArgs.from_namespace(args)
    args = args or ServerArgs()
    names = list(args.served_model_name or [engine.model_config.model])
    serving = OpenAIServing(engine, names, ServingLimits(args.max_inputs_per_request))
    metrics = ServerMetrics(engine)
    engine.add_step_listener(metrics.on_step)
    generation = OpenAIServingGeneration(engine, serving, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown(args.shutdown_timeout_s)

    app = FastAPI(title="tidepool", version=tidepool.__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.serving = serving
    app.state.metrics = metrics
    _add_exception_handlers(app)
    _add_routes(app, serving, metrics)
    _add_generation_routes(app, generation)
    known_paths = {getattr(r, "path", "") for r in app.routes}
    # Added last = outermost: metrics sees the 401s and 413s of the inner layers.
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_body_bytes)
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    app.add_middleware(MetricsMiddleware, metrics=metrics, known_paths=known_paths)
    return app


def _count_tokens(metrics: ServerMetrics, route: str, body: BaseModel) -> None:
    usage = getattr(body, "usage", None)
    num_tokens = getattr(usage, "prompt_tokens", None) or getattr(usage, "total_tokens", 0)
    if num_tokens:
        metrics.prompt_tokens.labels(route).inc(num_tokens)


def _add_routes(app: FastAPI, serving: OpenAIServing, metrics: ServerMetrics) -> None:
    def engine_route(
        path: str,
        handler: Callable[[Any], Awaitable[BaseModel]],
        body_type: type,
        exclude_none: bool = False,
    ) -> None:
        async def route(body: body_type, raw_request: Request) -> Response:  # type: ignore[valid-type]
            async def work() -> Response:
                result = await handler(body)
                _count_tokens(metrics, path, result)
                return _json(result, exclude_none)

            return await serve_until_disconnect(raw_request, work())

        # Real types, not the strings of `from __future__ import annotations`: FastAPI reads
        # them to parse and validate the body, and `body_type` is local to this function.
        route.__annotations__ = {"body": body_type, "raw_request": Request, "return": Response}
        route.__name__ = "route_" + path.strip("/").replace("/", "_")
        app.post(path)(route)

    engine_route("/v1/embeddings", serving.embed, p.EmbeddingRequest)
    engine_route("/pooling", serving.pool, p.PoolingRequest)
    engine_route("/classify", serving.classify, p.ClassificationRequest)
    for path in ("/score", "/v1/score"):
        engine_route(path, serving.score, p.ScoreRequest)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        engine_route(path, serving.rerank, p.RerankRequest, exclude_none=True)
    engine_route("/tokenize", serving.tokenize, p.TokenizeRequest)
    engine_route("/detokenize", serving.detokenize, p.DetokenizeRequest)

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(serving.models())

    @app.get("/health")
    async def health() -> Response:
        if not serving.engine.is_running:
            return error_response(503, "the engine is not running")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> Response:
        return _json(p.VersionResponse(version=tidepool.__version__))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)


def _add_generation_routes(app: FastAPI, generation: OpenAIServingGeneration) -> None:
    """JSON, or a text/event-stream when the body asks for `stream` (checks and tokenization
    happen before the stream starts, so their errors keep their HTTP status)."""

    async def answer(result: BaseModel | AsyncIterator[str]) -> Response:
        if isinstance(result, BaseModel):
            return _json(result)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(result, media_type="text/event-stream", headers=headers)

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, raw_request: Request) -> Response:
        async def work() -> Response:
            return await answer(await generation.completions(body))

        return await serve_until_disconnect(raw_request, work())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, raw_request: Request) -> Response:
        async def work() -> Response:
            return await answer(await generation.chat(body))

        return await serve_until_disconnect(raw_request, work())


def _validation_message(exc: RequestValidationError) -> str:
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            reason = (error.get("ctx") or {}).get("error", "")
            return f"the request body is not valid JSON: {reason}".rstrip(": ")
    parts = []
    for error in exc.errors()[:5]:
        where = ".".join(str(x) for x in error.get("loc", ()) if x != "body") or "body"
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return "; ".join(parts)


def _add_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # A body that is not JSON at all is a bad request; JSON of the wrong shape is a 422.
        is_json_error = any(e.get("type") == "json_invalid" for e in exc.errors())
        return error_response(400 if is_json_error else 422, _validation_message(exc))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(EngineClosedError)
    async def engine_closed(_: Request, exc: EngineClosedError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(EngineStepError)
    async def engine_step_error(_: Request, exc: EngineStepError) -> JSONResponse:
        return error_response(500, str(exc))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request", exc_info=exc)
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")
