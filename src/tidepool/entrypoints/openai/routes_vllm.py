"""vLLM's server extras: /ping and /invocations (SageMaker's routes), request logging
(--enable-log-requests, --max-log-len) and CORS (--allowed-origins ...).

/invocations answers as the route its body is for: `messages` → chat completions (a generating
model) or embeddings; `prompt` → completions; `query` + `documents` → rerank; `queries`,
`text_1` or `data_1` → score; `input` → embeddings, classify or pooling by the model's task.
The request is handed on with its path rewritten (an ASGI middleware right outside the router),
so every check, error and metric is that route's.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from tidepool.entrypoints.openai.errors import error_response

logger = logging.getLogger("tidepool.requests")

Scope = dict[str, Any]


def invocation_path(body: Any, task: str, generates: bool) -> str | None:
    """The route an /invocations body is for; None when its fields tell none."""
    if not isinstance(body, dict):
        return None
    if "messages" in body:
        if generates:
            return "/v1/chat/completions"
        return "/v1/embeddings" if task == "embed" else "/pooling"
    if "prompt" in body:
        return "/v1/completions"
    if "query" in body and "documents" in body:
        return "/rerank"
    if any(key in body for key in ("queries", "text_1", "data_1")):
        return "/score"
    if "input" in body:
        return {"embed": "/v1/embeddings", "classify": "/classify"}.get(task, "/pooling")
    return None


async def _read_body(receive) -> tuple[bytes, list[dict[str, Any]]]:
    chunks, messages = [], []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks), messages


def _replay(body: bytes, receive):
    sent = False

    async def replayed() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


class InvocationsMiddleware:
    """POST /invocations → the route its body is for (by `invocation_path`), and the request log."""

    def __init__(
        self, app, models: Any, log_requests: bool = False, max_log_len: int | None = None
    ):
        self.app = app
        self.models = models
        self.log_requests = log_requests
        self.max_log_len = max_log_len

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        is_invocation = scope["path"] == "/invocations"
        if not (is_invocation or self.log_requests):
            await self.app(scope, receive, send)
            return
        body, _ = await _read_body(receive)
        receive = _replay(body, receive)
        if self.log_requests:
            text = body.decode("utf-8", "replace")
            if self.max_log_len is not None:
                text = text[: self.max_log_len]
            logger.info("request %s %s: %s", scope["method"], scope["path"], text)
        if is_invocation:
            try:
                parsed = json.loads(body or b"null")
            except json.JSONDecodeError:
                parsed = None
            requested = parsed.get("model") if isinstance(parsed, dict) else None
            try:  # an unknown model: the route it goes to answers the 404
                engine = self.models.resolve(
                    requested if isinstance(requested, str) else None
                ).engine
            except Exception:
                engine = self.models.default.engine
            path = invocation_path(
                parsed, engine.model_config.default_pooling_task, engine.can_generate
            )
            if path is not None:
                scope = {**scope, "path": path, "raw_path": path.encode()}
        await self.app(scope, receive, send)


def add_vllm_routes(app: FastAPI, health) -> None:
    """/ping (GET and POST: /health's answer) and /invocations (reached only when its body
    names no route: 400)."""

    async def ping() -> Response:
        return await health()

    app.get("/ping")(ping)
    app.post("/ping")(ping)

    @app.post("/invocations")
    async def invocations() -> Response:
        return error_response(
            400,
            "/invocations could not tell the API from the body: give `input` (embeddings, "
            "classify, pooling), `messages`, `prompt`, `query` + `documents` (rerank) or "
            "`queries` / `text_1` / `data_1` (score)",
        )


def add_cors(app: FastAPI, args: Any) -> None:
    """CORS when --allowed-origins (or another CORS flag) is given."""
    origins = getattr(args, "allowed_origins", None)
    if origins is None:
        return
    from fastapi.middleware.cors import CORSMiddleware

    app.add_middleware(
        CORSMiddleware,
        allow_origins=origins,
        allow_credentials=bool(getattr(args, "allow_credentials", False)),
        allow_methods=getattr(args, "allowed_methods", None) or ["*"],
        allow_headers=getattr(args, "allowed_headers", None) or ["*"],
    )
