"""The OpenAI-compatible HTTP server: thin FastAPI routes over the services of each model.

    client ─▶ middleware.py (metrics, 401, 429 admission, 413, JSON body, 500) ─▶ route
           ─▶ ServedModels.resolve(body.model) ─▶ OpenAIServing… of that model ─▶ its AsyncEngine

Routes and JSON mirror `vllm serve`: pooling routes, and /v1/completions and /v1/chat/completions
(JSON, or server-sent events with `stream`) on a generating model. Every error answers OpenAI's shape:
{"error": {"message", "type", "param", "code"}} with `code` = the HTTP status, as vLLM does
(errors.py maps each failure to its status). Admission control (429, 413, 503 at a deadline) is
admission.py's; several models in one server, served_models.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
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
from tidepool.entrypoints.openai import protocol_tei as pt
from tidepool.entrypoints.openai.admission import (
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    Admission,
    AdmissionLimits,
    AdmissionMiddleware,
    default_max_queued_tokens,
    seconds_left,
    within_deadline,
)
from tidepool.entrypoints.openai.encodings import EmbeddingCalibration
from tidepool.entrypoints.openai.errors import (
    MAPPED_ERRORS,
    ServerState,
    error_response,
    exception_response,
)
from tidepool.entrypoints.openai.fast_routes import (
    FastRoutesMiddleware,
    fast_table,
    mark_fast,
    validated_body,
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
    check_api_key,
)
from tidepool.entrypoints.openai.routes_compat import add_compat_routes
from tidepool.entrypoints.openai.routes_vllm import InvocationsMiddleware, add_cors, add_vllm_routes
from tidepool.entrypoints.openai.served_models import NamedEngine, ServedModel, ServedModels
from tidepool.entrypoints.openai.serving import ServingLimits

SHUTDOWN_MESSAGE = (
    "the server is shutting down and the request did not finish within its --shutdown-timeout"
)


@dataclass(frozen=True)
class ServerArgs:
    served_model_name: list[str] | None = None
    """Names clients may put in `model` for a single engine; the first is echoed back. None = the
    model argument. (Several engines: each NamedEngine carries its names.)"""
    api_key: str | None = None
    """When set, requests need `Authorization: Bearer <api_key>` (except PUBLIC_PATHS)."""
    max_request_body_bytes: int = 32 * 1024 * 1024
    """Larger request bodies are refused with 413 before they are read."""
    max_inputs_per_request: int = 2048
    """More inputs (texts, documents, pairs) in one request → 413."""
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    """Requests to engine routes in flight at once; more → 429."""
    max_queued_tokens: int | None = None
    """Prompt tokens admitted and not finished, all models together; more → 429. None = sized
    for the machine (admission.default_max_queued_tokens)."""
    request_timeout_s: float | None = None
    """A request still queued or running this long after it arrived is aborted → 503."""
    shutdown_timeout_s: float = 30.0
    """How long shutdown waits for in-flight requests to finish."""
    embedding_calibration: str | None = None
    """int8 / uint8 ranges: a .npy [2, dim], or a file of texts, one per line (encodings.py)."""
    api_style: str = "openai"
    """"tei": TEI's /rerank and /tokenize take those paths from vLLM's (routes_compat.py)."""
    root_path: str | None = None
    """The path prefix a proxy serves this server under (FastAPI's root_path)."""
    disable_fastapi_docs: bool = False
    """No /docs, /redoc, /openapi.json."""
    allowed_origins: list[str] | None = None
    """CORS (routes_vllm.add_cors): None = no CORS headers."""
    allow_credentials: bool = False
    allowed_methods: list[str] | None = None
    allowed_headers: list[str] | None = None
    enable_log_requests: bool = False
    """Log each POST's route and body (cut to max_log_len characters)."""
    max_log_len: int | None = None
    trust_request_chat_template: bool = False
    """A request's own `chat_template` is accepted (else 400 naming the flag, as vLLM)."""
    enable_prompt_tokens_details: bool = False
    """Generation usage carries prompt_tokens_details.cached_tokens (the prefix-cache hit)."""

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerArgs:
        values = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}
        return cls(**values)

    def admission_limits(self) -> AdmissionLimits:
        max_queued_tokens = self.max_queued_tokens
        if max_queued_tokens is None:
            max_queued_tokens = default_max_queued_tokens()
        return AdmissionLimits(
            self.max_concurrent_requests, max_queued_tokens, self.request_timeout_s
        )


def _json(body: BaseModel, exclude_none: bool = False) -> Response:
    return Response(body.model_dump_json(exclude_none=exclude_none), media_type="application/json")


# ---------------------------------------------------------------------- disconnects, deadlines


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Watch:
    """Why serve_until_disconnect cancelled the work: the client left, or the deadline passed;
    None while it has not (a cancellation then came from outside: uvicorn's shutdown)."""

    def __init__(self, work_task: asyncio.Task[Response]) -> None:
        self.work_task = work_task
        self.reason: str | None = None

    def stop(self, reason: str) -> None:
        if self.reason is None and not self.work_task.done():
            self.reason = reason
            self.work_task.cancel()

    def watcher_done(self, watcher: asyncio.Future[None]) -> None:
        if not watcher.cancelled():
            watcher.exception()  # retrieved: a receive that failed means the client is gone too
            self.stop("disconnect")


async def serve_until_disconnect(
    request: Request, work: Coroutine[Any, Any, Response], admission: Admission | None = None
) -> Response:
    """Run `work`; if the client disconnects first, or the request's deadline passes (503),
    cancel it (which aborts its engine requests, freeing their KV blocks).

    uvicorn cancels the handlers still running when a graceful shutdown's --shutdown-timeout is
    over: the work is cancelled too (its engine requests aborted) and the client gets a 503.

    The work runs in a task of its own: its many awaits then resume a short chain of coroutines,
    not this handler's, which sits under every middleware (measured slower in the handler's
    task: docs/performance.md, 'Choices elsewhere in the code'). The watcher task and the deadline's timer cancel the work task by a
    callback, so this handler awaits once (asyncio.wait would cost as much again)."""
    work_task = asyncio.ensure_future(work)
    watch = _Watch(work_task)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    watcher.add_done_callback(watch.watcher_done)
    timeout_s = seconds_left(request.scope)
    timer = None
    if timeout_s is not None:
        loop = asyncio.get_running_loop()
        timer = loop.call_later(max(0.0, timeout_s), watch.stop, "deadline")
    try:
        return await work_task
    except asyncio.CancelledError:
        if watch.reason is None:  # from outside (the server's shutdown): the work is cancelled
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()  # the answer below is how this cancellation ends
            return error_response(503, SHUTDOWN_MESSAGE)
        if watch.reason == "deadline" and admission is not None:
            return exception_response(admission.timed_out())
        return Response(status_code=STATUS_CLIENT_CLOSED)
    finally:
        if timer is not None:
            timer.cancel()
        watcher.cancel()


# ---------------------------------------------------------------------- app


def freeze_startup_heap() -> None:
    """Take every object alive now (torch, transformers, the models, the app: ~340,000 with
    all-MiniLM-L6-v2) out of the cyclic garbage collector's passes. They live as long as the
    server, and each full collection walked them all again (~0.1-0.3 s): under load that was
    ~30% of the event loop's CPU (perf, one text per request). Garbage made later is collected
    as before; `thaw_heap` undoes it when the app stops (a test process runs many apps)."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    gc.unfreeze()


def build_app(
    engines: AsyncEngine | Sequence[NamedEngine],
    args: ServerArgs | argparse.Namespace | None = None,
) -> FastAPI:
    """The FastAPI app over one engine, or several (each NamedEngine a model, the first the
    default); the app's lifespan starts and drains the engines."""
    if isinstance(args, argparse.Namespace):
        args = ServerArgs.from_namespace(args)
    args = args or ServerArgs()
    if isinstance(engines, AsyncEngine):
        names = tuple(args.served_model_name or [engines.model_config.model])
        engines = [NamedEngine(engines, names)]
    state = ServerState()
    metrics = ServerMetrics({named.names[0]: named.engine for named in engines})
    admission = Admission(args.admission_limits(), metrics)
    limits = ServingLimits(
        args.max_inputs_per_request,
        args.trust_request_chat_template,
        args.enable_prompt_tokens_details,
    )
    calibration = EmbeddingCalibration(args.embedding_calibration)
    models = ServedModels(engines, limits, metrics, state, calibration)
    for model in models:
        model.engine.set_token_budget(admission)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for model in models:
            model.engine.start()
        freeze_startup_heap()
        try:
            yield
            state.stopping = True
            await asyncio.gather(*(m.engine.shutdown(args.shutdown_timeout_s) for m in models))
        finally:
            thaw_heap()

    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(
        title="tidepool",
        version=tidepool.__version__,
        lifespan=lifespan,
        root_path=args.root_path or "",
        **(docs if args.disable_fastapi_docs else {}),
    )
    app.state.models = models
    app.state.engine = models.default.engine
    app.state.serving = models.default.serving
    app.state.metrics = metrics
    app.state.admission = admission
    _add_exception_handlers(app, state)
    serve = functools.partial(serve_until_disconnect, admission=admission)
    # Cohere's and TEI's routes (first: see routes_compat.py), routed to a model as they can.
    add_compat_routes(app, models, args.api_style, serve)
    _add_routes(app, models, metrics, admission)
    _add_info_routes(app, models, metrics)
    known_paths = {getattr(r, "path", "") for r in app.routes}
    # Each one added wraps the ones before: metrics, outermost, sees every status.
    app.add_middleware(
        InvocationsMiddleware,
        models=models,
        log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len,
    )
    app.add_middleware(FastRoutesMiddleware, routes=fast_table(app.routes), state=state)
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(JsonBodyMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_body_bytes)
    app.add_middleware(AdmissionMiddleware, admission=admission)
    if args.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=check_api_key(args.api_key, "api_key"))
    app.add_middleware(MetricsMiddleware, metrics=metrics, known_paths=known_paths)
    add_cors(app, args)
    return app


def _count_tokens(metrics: ServerMetrics, route: str, body: BaseModel) -> None:
    usage = getattr(body, "usage", None)
    num_tokens = getattr(usage, "prompt_tokens", None) or getattr(usage, "total_tokens", 0)
    if num_tokens:
        metrics.prompt_tokens.labels(route).inc(num_tokens)


Handler = Callable[[Any], Awaitable[BaseModel | AsyncIterator[str]]]
"""A service method: the checked body → the answer (JSON), or server-sent events."""


def _event_stream(events: AsyncIterator[str]) -> Response:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


def _add_routes(
    app: FastAPI, models: ServedModels, metrics: ServerMetrics, admission: Admission
) -> None:
    """Every route that runs a model: the body's `model` picks the model (none: the default),
    `service` the method of that model's services that answers."""

    def engine_route(
        path: str,
        service: Callable[[ServedModel], Handler],
        body_type: type,
        exclude_none: bool = False,
        count_tokens: bool = True,
        tei_task: str | None = None,
    ) -> None:
        """`tei_task`: a TEI route, whose model may also come from `?model=` (none named: the
        first model serving that task, as TEI's other routes)."""

        async def answer(body: Any, raw_request: Request) -> Response:
            async def work() -> Response:
                requested = getattr(body, "model", None)
                if tei_task is not None:
                    model = models.resolve_tei(requested, raw_request.query_params, tei_task)
                else:
                    model = models.resolve(requested)
                result = await service(model)(body)
                if isinstance(result, Response):  # a binary answer (encoding_format bytes)
                    return result
                if not isinstance(result, BaseModel):  # checks passed: the 200 goes out now
                    return _event_stream(within_deadline(result, raw_request.scope, admission))
                if count_tokens:
                    _count_tokens(metrics, path, result)
                return _json(result, exclude_none)

            return await serve_until_disconnect(raw_request, work(), admission)

        async def route(body: body_type, raw_request: Request) -> Response:  # type: ignore[valid-type]
            return await answer(body, raw_request)

        read_body = validated_body(body_type)

        async def fast(raw_request: Request) -> Response | None:
            body = await read_body(raw_request)
            return None if body is None else await answer(body, raw_request)

        # Real types, not the strings of `from __future__ import annotations`: FastAPI reads
        # them to parse and validate the body, and `body_type` is local to this function.
        route.__annotations__ = {"body": body_type, "raw_request": Request, "return": Response}
        route.__name__ = "route_" + path.strip("/").replace("/", "_")
        mark_fast(route, fast)
        app.post(path)(route)

    engine_route("/v1/embeddings", lambda m: m.serving.embed, p.EmbeddingRequest)
    engine_route("/pooling", lambda m: m.serving.pool, p.PoolingRequest)
    engine_route("/classify", lambda m: m.serving.classify, p.ClassificationRequest)
    engine_route(
        "/embed_sparse",
        lambda m: m.sparse.embed_sparse,
        pt.EmbedSparseRequest,
        tei_task="embed_sparse",
    )
    for path in ("/score", "/v1/score"):
        engine_route(path, lambda m: m.serving.score, p.ScoreRequest)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        engine_route(path, lambda m: m.serving.rerank, p.RerankRequest, exclude_none=True)
    engine_route("/tokenize", lambda m: m.tokenization.tokenize, p.TokenizeRequest)
    engine_route("/detokenize", lambda m: m.tokenization.detokenize, p.DetokenizeRequest)
    # Generation counts its own tokens (a stream's too); JSON, or events when `stream` is set
    # (checks and tokenization happen before the stream starts: their errors keep their status).
    engine_route(
        "/v1/completions",
        lambda m: m.generation.completions,
        p.CompletionRequest,
        count_tokens=False,
    )
    engine_route(
        "/v1/chat/completions",
        lambda m: m.generation.chat,
        p.ChatCompletionRequest,
        count_tokens=False,
    )


def _add_info_routes(app: FastAPI, models: ServedModels, metrics: ServerMetrics) -> None:
    @app.get("/v1/models")
    async def list_models() -> Response:
        return _json(models.model_list())

    @app.get("/health")
    async def health() -> Response:  # /ping answers the same (routes_vllm.py)
        """200 with each model's state; 503 (OpenAI's error shape) while one is not running."""
        report = models.health()
        stopped = [name for name, s in report["models"].items() if s != "running"]
        if stopped:
            names = ", ".join(f"`{name}`" for name in stopped)
            return error_response(503, f"the engine is not running for the model(s) {names}")
        return Response(json.dumps(report), media_type="application/json")

    add_vllm_routes(app, health)

    @app.get("/version")
    async def version() -> Response:
        return _json(p.VersionResponse(version=tidepool.__version__))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)


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
