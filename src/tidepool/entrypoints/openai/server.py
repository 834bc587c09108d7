"""The OpenAI-compatible HTTP server: thin FastAPI routes over `OpenAIServing` and one AsyncEngine.

    client ─▶ middleware.py (metrics, 401, 413, JSON body, 500) ─▶ route ─▶ OpenAIServing…
           ─▶ AsyncEngine

Routes and JSON mirror `vllm serve`: pooling routes, and /v1/completions and /v1/chat/completions
(JSON, or server-sent events with `stream`) on a generating model. Every error answers OpenAI's shape:
{"error": {"message", "type", "param", "code"}} with `code` = the HTTP status, as vLLM does
(errors.py maps each failure to its status).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, fields
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

import tidepool
from tidepool.engine.async_engine import AsyncEngine
from tidepool.entrypoints.openai import protocol as p
from tidepool.entrypoints.openai.encodings import EmbeddingCalibration
from tidepool.entrypoints.openai.errors import (
    MAPPED_ERRORS,
    ServerState,
    error_response,
    exception_response,
)
from tidepool.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from tidepool.entrypoints.openai.middleware import (
    DECLARED_CONTENT_TYPE,
    STATUS_CLIENT_CLOSED,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    InternalErrorMiddleware,
    JsonBodyMiddleware,
    MetricsMiddleware,
)
from tidepool.entrypoints.openai.routes_compat import add_compat_routes
from tidepool.entrypoints.openai.serving import OpenAIServing, ServingLimits
from tidepool.entrypoints.openai.serving_generate import OpenAIServingGeneration
from tidepool.entrypoints.openai.serving_sparse import OpenAIServingSparse
from tidepool.entrypoints.openai.serving_tokenize import OpenAIServingTokenization

SHUTDOWN_MESSAGE = (
    "the server is shutting down and the request did not finish within its --shutdown-timeout"
)


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
    embedding_calibration: str | None = None
    """int8 / uint8 ranges: a .npy [2, dim], or a file of texts, one per line (encodings.py)."""
    api_style: str = "openai"
    """"tei": TEI's /rerank and /tokenize take those paths from vLLM's (routes_compat.py)."""

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerArgs:
        values = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}
        return cls(**values)


def _json(body: BaseModel, exclude_none: bool = False) -> Response:
    return Response(body.model_dump_json(exclude_none=exclude_none), media_type="application/json")


# ---------------------------------------------------------------------- disconnects


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel(task: asyncio.Future[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


async def serve_until_disconnect(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """Run `work`; if the client disconnects first, cancel it (which aborts its engine requests).

    uvicorn cancels the handlers still running when a graceful shutdown's --shutdown-timeout is
    over: the work is cancelled too (its engine requests aborted) and the client gets a 503."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await _cancel(watch_task)
        await _cancel(work_task)
        current = asyncio.current_task()
        if current is not None:
            current.uncancel()  # the answer below is how this cancellation ends
        return error_response(503, SHUTDOWN_MESSAGE)
    if work_task in done:
        watch_task.cancel()
        return work_task.result()
    await _cancel(work_task)
    return Response(status_code=STATUS_CLIENT_CLOSED)


# ---------------------------------------------------------------------- app


def build_app(engine: AsyncEngine, args: ServerArgs | argparse.Namespace | None = None) -> FastAPI:
    """The FastAPI app over `engine`; the app's lifespan starts and drains the engine."""
    if isinstance(args, argparse.Namespace):
        args = ServerArgs.from_namespace(args)
    args = args or ServerArgs()
    names = list(args.served_model_name or [engine.model_config.model])
    state = ServerState()
    calibration = EmbeddingCalibration(args.embedding_calibration)
    serving = OpenAIServing(engine, names, ServingLimits(args.max_inputs_per_request), calibration)
    tokenization = OpenAIServingTokenization(serving)
    metrics = ServerMetrics(engine)
    engine.add_step_listener(metrics.on_step)
    generation = OpenAIServingGeneration(engine, serving, tokenization, metrics, state)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        state.stopping = True
        await engine.shutdown(args.shutdown_timeout_s)

    app = FastAPI(title="tidepool", version=tidepool.__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.serving = serving
    app.state.metrics = metrics
    _add_exception_handlers(app, state)
    add_compat_routes(app, serving, args.api_style, serve_until_disconnect)  # first: see there
    _add_routes(app, serving, tokenization, metrics)
    _add_generation_routes(app, generation)
    known_paths = {getattr(r, "path", "") for r in app.routes}
    # Each one added wraps the ones before: metrics, outermost, sees every status.
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(JsonBodyMiddleware)
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


def _add_routes(
    app: FastAPI,
    serving: OpenAIServing,
    tokenization: OpenAIServingTokenization,
    metrics: ServerMetrics,
) -> None:
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
    engine_route("/embed_sparse", OpenAIServingSparse(serving).embed_sparse, p.EmbedSparseRequest)
    for path in ("/score", "/v1/score"):
        engine_route(path, serving.score, p.ScoreRequest)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        engine_route(path, serving.rerank, p.RerankRequest, exclude_none=True)
    engine_route("/tokenize", tokenization.tokenize, p.TokenizeRequest)
    engine_route("/detokenize", tokenization.detokenize, p.DetokenizeRequest)

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


# ---------------------------------------------------------------------- schema errors


def _is_empty_body(error: dict[str, Any]) -> bool:
    return error.get("type") == "missing" and tuple(error.get("loc", ())) == ("body",)


def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    """A body that is not JSON (or none) is a bad request, 400; JSON of the wrong shape, 422."""
    errors = exc.errors()
    for error in errors:
        if error.get("type") == "json_invalid":
            reason = (error.get("ctx") or {}).get("error", "")
            message = f"the request body is not valid JSON: {reason}".rstrip(": ")
            declared = request.scope.get(DECLARED_CONTENT_TYPE)
            if declared:
                message += f" (it was sent as {declared}; the server reads every body as JSON)"
            return error_response(400, message)
    if any(_is_empty_body(error) for error in errors):
        message = "the request body is empty: send a JSON object (Content-Type: application/json)"
        return error_response(400, message)
    parts, fields_named = [], []
    for error in errors[:5]:
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        fields_named += loc[:1]
        parts.append(f"{'.'.join(loc) or 'body'}: {error.get('msg', 'invalid')}")
    return error_response(422, "; ".join(parts), fields_named[0] if fields_named else None)


def _add_exception_handlers(app: FastAPI, state: ServerState) -> None:
    """Errors raised in a route; anything else is InternalErrorMiddleware's 500."""

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _validation_error(request, exc)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail))

    async def mapped_error(_: Request, exc: Exception) -> Response:
        return exception_response(exc, state)

    for exc_type in MAPPED_ERRORS:
        app.add_exception_handler(exc_type, mapped_error)
