"""Every failure of a request → its HTTP status and OpenAI's error JSON, in one place for the
routes (a JSON answer) and the streams (an error event).

    ApiError (a client mistake or a refusal, with its status and headers) │ BatchInputError 400
    MediaError 400 (an image refused: multimodal/media.py) │ EngineClosedError 503 │ EngineStepError 500 (503 once the server is stopping) │ else 500
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from starlette.responses import Response

from tidepool.engine.async_engine import EngineClosedError, EngineStepError
from tidepool.entrypoints.openai import protocol as p
from tidepool.multimodal.media import MediaError
from tidepool.outputs import BatchInputError

logger = logging.getLogger("tidepool")

# By type, most specific first; ApiError carries its own status.
_STATUS_OF_EXCEPTION: tuple[tuple[type[BaseException], int], ...] = (
    (BatchInputError, 400),
    (MediaError, 400),
    (EngineClosedError, 503),
    (EngineStepError, 500),
)


class ApiError(Exception):
    """A request the server refuses, with its HTTP status, a message for the client and the
    headers its answer carries (Retry-After on a 429 / 503)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = dict(headers or {})


@dataclass
class ServerState:
    """What the error mapping must know of the server's life; the app's lifespan sets it."""

    stopping: bool = False
    """Shutdown has begun: requests the engine drops now failed for that, not for a fault."""


@dataclass(frozen=True)
class HttpError:
    """An exception as the client sees it."""

    status: int
    message: str
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    """Extra response headers (Retry-After)."""


def http_error(exc: BaseException, state: ServerState | None = None) -> HttpError:
    """The status and message a failure answers with (500s of unknown errors are logged)."""
    if isinstance(exc, ApiError):
        return HttpError(exc.status, exc.message, exc.param, exc.headers)
    for exc_type, status in _STATUS_OF_EXCEPTION:
        if isinstance(exc, exc_type):
            if status == 500 and state is not None and state.stopping:
                # The engine dropped the request because shutdown's --shutdown-timeout ran out.
                status = 503
            return HttpError(status, str(exc))
    logger.error("unhandled error in a request", exc_info=exc)
    return HttpError(500, f"internal server error: {type(exc).__name__}: {exc}")


MAPPED_ERRORS: tuple[type[BaseException], ...] = (
    ApiError,
    *(exc_type for exc_type, _ in _STATUS_OF_EXCEPTION),
)
"""What `http_error` knows beyond "internal error" (the app's exception handlers)."""


def error_json(status: int, message: str, param: str | None = None) -> bytes:
    """OpenAI's error body. ASCII-escaped: a message may quote client text, and a lone
    surrogate in it would make UTF-8 encoding (and so the answer itself) fail."""
    body = p.error_body(status, message, param).model_dump()
    return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    body = error_json(status, message, param)
    return Response(body, status, headers=dict(headers or {}), media_type="application/json")


def exception_response(exc: BaseException, state: ServerState | None = None) -> Response:
    error = http_error(exc, state)
    return error_response(error.status, error.message, error.param, error.headers)


def error_event(exc: BaseException, state: ServerState | None = None) -> str:
    """An error inside a started stream: OpenAI's error JSON as one event (vLLM does the same)."""
    error = http_error(exc, state)
    return f"data: {error_json(error.status, error.message, error.param).decode('ascii')}\n\n"
