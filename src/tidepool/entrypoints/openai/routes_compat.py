"""The routes of other APIs (Cohere's /v2/embed, TEI's native routes), each answering its errors
in its own API's shape:

    OpenAI / vLLM routes   {"error": {"message", "type", "param", "code"}}   (errors.py)
    Cohere /v2/embed       {"message": ...}
    TEI routes             {"error": ..., "error_type": "Validation" | "Overloaded" | ...}

These routes parse their own body (so that a schema error, 422, is in their shape too); what the
middlewares answer before a route runs (401, a body over --max-request-body-bytes) keeps OpenAI's
shape. TEI's /rerank and /tokenize share their paths with vLLM's: they take those paths only with
`--api-style tei` (docs/server.md, "TEI routes").
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from tidepool.entrypoints.openai.errors import ApiError, HttpError, http_error
from tidepool.entrypoints.openai.fast_routes import mark_fast
from tidepool.entrypoints.openai.protocol_cohere import CohereEmbedRequest
from tidepool.entrypoints.openai.served_models import ServedModels
from tidepool.entrypoints.openai.serving_tei import TEI_ROUTES, TeiRoute, TeiServing

Serve = Callable[[Request, Coroutine[Any, Any, Response]], Awaitable[Response]]
"""Runs a route's work, cancelling it if the client disconnects (server.serve_until_disconnect)."""
ErrorShape = Callable[[HttpError], dict[str, Any]]

API_STYLES = ("openai", "tei")
"""--api-style: who owns the paths two APIs share (/rerank, /tokenize)."""

_TEI_ERROR_TYPES = {429: "Overloaded", 503: "Unhealthy", 500: "Backend", 424: "Backend"}


def cohere_error(error: HttpError) -> dict[str, Any]:
    return {"message": error.message}


def tei_error(error: HttpError) -> dict[str, Any]:
    return {"error": error.message, "error_type": _TEI_ERROR_TYPES.get(error.status, "Validation")}


def _dumps(value: Any) -> bytes:
    # ASCII-escaped, as errors.py: a message may quote client text.
    return json.dumps(value, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _schema_error(error: ValidationError) -> ApiError:
    """A body that is not JSON (or none): 400; JSON of the wrong shape: 422 naming the field."""
    errors = error.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return ApiError(400, "the request body is not valid JSON")
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ())) or "body"
        parts.append(f"{loc}: {e.get('msg', 'invalid')}")
    return ApiError(422, "; ".join(parts))


def parse_body(body_type: type[BaseModel], raw: bytes) -> BaseModel:
    if not raw.strip():
        raise ApiError(400, "the request body is empty: send a JSON object")
    try:
        return body_type.model_validate_json(raw)
    except ValidationError as e:
        raise _schema_error(e) from e


Handler = Callable[[Any, Request], Awaitable[Any]]
"""The parsed body and the HTTP request (for its query) → the answer."""


def add_route(
    app: FastAPI,
    path: str,
    handler: Handler,
    body_type: type[BaseModel],
    error_shape: ErrorShape,
    serve: Serve,
) -> None:
    """POST `path`: the body parsed as `body_type`, `handler`'s result as JSON (a pydantic model,
    or lists and dicts), every failure in `error_shape`."""

    def answer_error(exc: BaseException) -> Response:
        error = http_error(exc)
        return Response(_dumps(error_shape(error)), error.status, media_type="application/json")

    async def route(raw_request: Request) -> Response:
        try:
            body = parse_body(body_type, await raw_request.body())
        except ApiError as e:
            return answer_error(e)

        async def work() -> Response:
            try:
                result = await handler(body, raw_request)
            except Exception as exc:  # every failure answers in this API's shape
                return answer_error(exc)
            if isinstance(result, BaseModel):
                return Response(result.model_dump_json(), media_type="application/json")
            return Response(_dumps(result), media_type="application/json")

        return await serve(raw_request, work())

    route.__name__ = "route_" + path.strip("/").replace("/", "_")
    mark_fast(route, route)  # it reads its own body: FastAPI adds nothing to it
    app.post(path)(route)


def add_compat_routes(app: FastAPI, models: ServedModels, api_style: str, serve: Serve) -> None:
    """Cohere's /v2/embed and TEI's routes, over every model of the server. Call it before the
    OpenAI routes are added: where two routes share a path, the first added answers."""
    if api_style not in API_STYLES:
        raise ValueError(f"api_style must be one of {API_STYLES}, got {api_style!r}")

    async def cohere_embed(body: CohereEmbedRequest, _: Request) -> Any:
        return await models.resolve(body.model).cohere.embed(body)

    add_route(app, "/v2/embed", cohere_embed, CohereEmbedRequest, cohere_error, serve)
    for path, route in TEI_ROUTES.items():
        if api_style == "tei" or path not in TeiServing.shared_paths:
            add_route(app, path, _tei_handler(models, route), route.body_type, tei_error, serve)


def _tei_handler(models: ServedModels, route: TeiRoute) -> Handler:
    """TEI's bodies name no model: `?model=NAME` picks one (our extension, 404 for a name not
    served), else the first model that serves the route's task."""

    async def handler(body: Any, raw_request: Request) -> Any:
        requested = raw_request.query_params.get("model")
        model = models.resolve(requested) if requested else models.serving_task(route.task)
        return await route.handler(model.tei, body)

    return handler
