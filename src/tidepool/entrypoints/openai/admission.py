"""Admission control: which requests the server takes on, and for how long.

    client ─▶ AdmissionMiddleware: in flight >= --max-concurrent-requests → 429 + Retry-After;
              │ else a permit, held until the response has ended (a stream: its last event, or
              │ the client gone), and a deadline (now + --request-timeout) in the scope
              ▼
           route ─▶ AsyncEngine: after tokenization, Admission.reserve(prompt tokens):
              │ queued + these > --max-queued-tokens → 429 (more than the whole budget → 413);
              │ given back when the engine call ends, however it ends
              ▼
           past the deadline: the work is cancelled, its engine requests aborted (their KV blocks
           and scheduler rows freed) → 503 + Retry-After (in a started stream: an error event
           with code 503, then [DONE])

The 413s of a body too big (--max-request-body-bytes, BodyLimitMiddleware: refused before it is
read) and of too many inputs (--max-inputs-per-request, OpenAIServing.check_count) stay where the
size is first known; docs/server.md lists all of them in one table.

Why here and not in AsyncEngine: the limits are HTTP policy (a permit per HTTP request, which may
carry many inputs; 429 / 503 with Retry-After; one budget for every model of the server). The
engine only reports what it alone sees: a call's prompt tokens once tokenized, and the end of the
call (AsyncEngine's TokenBudget hook, the same place that counts calls in flight for shutdown).
The concurrency permit is a middleware so that every engine route, present and future, is covered
without a line in the route, and so that a refusal costs nothing: the body is never read.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from tidepool.entrypoints.openai.errors import ApiError, error_event, error_response
from tidepool.entrypoints.openai.metrics import ServerMetrics
from tidepool.entrypoints.openai.middleware import PUBLIC_PATHS

RETRY_AFTER_S = 1
"""What a 429 / 503 asks the client to wait: the queue moves in engine steps of milliseconds."""
DEADLINE = "tidepool.deadline"
"""Scope key: the time.monotonic() by which the request must have finished (absent: none)."""
DEFAULT_MAX_CONCURRENT_REQUESTS = 512
"""TEI's default. An admitted request costs a coroutine and its body; the token budget bounds the
work behind them."""
_BYTES_PER_QUEUED_TOKEN = 1024
"""Host memory a waiting token may hold: its id in Python lists, its share of the text and of the
tokenizer's encodings (activations are bounded by the step budget, not by the queue)."""
_MEMORY_FRACTION = 8
"""The queue may hold 1/8 of the machine's memory."""
_MIN_QUEUED_TOKENS = 65536
_SSE_DONE = "data: [DONE]\n\n"
_EXEMPT_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
"""Model lists, health, metrics, version: cheap, and a probe must not be refused."""


def default_max_queued_tokens() -> int:
    """Sized for the machine: 1/8 of its memory at ~1 KiB per queued token (a 16 GiB machine:
    2M tokens, ~1,000 full 2,048-token prompts)."""
    try:
        memory_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume 8 GiB
        memory_bytes = 8 << 30
    return max(_MIN_QUEUED_TOKENS, memory_bytes // _MEMORY_FRACTION // _BYTES_PER_QUEUED_TOKEN)


@dataclass(frozen=True)
class AdmissionLimits:
    """The server's admission limits (flags of `tidepool serve`)."""

    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    """HTTP requests to engine routes in flight at once; above it → 429."""
    max_queued_tokens: int = field(default_factory=default_max_queued_tokens)
    """Prompt tokens admitted and not finished, all models together; above it → 429."""
    request_timeout_s: float | None = None
    """A request not finished this long after it arrived is aborted → 503; None = no deadline."""

    def __post_init__(self) -> None:
        if self.max_concurrent_requests < 1:
            raise ValueError(
                f"--max-concurrent-requests must be >= 1, got {self.max_concurrent_requests}"
            )
        if self.max_queued_tokens < 1:
            raise ValueError(f"--max-queued-tokens must be >= 1, got {self.max_queued_tokens}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {self.request_timeout_s}")


class Admission:
    """The server's admission state, on the event loop's thread only. It is the TokenBudget of
    every engine of the server (AsyncEngine.set_token_budget)."""

    def __init__(self, limits: AdmissionLimits, metrics: ServerMetrics | None = None) -> None:
        self.limits = limits
        self.metrics = metrics
        self.num_in_flight = 0
        """HTTP requests holding a permit."""
        self.num_queued_tokens = 0
        """Prompt tokens reserved by engine calls not yet ended."""
        if metrics is not None:
            metrics.requests_in_flight.set_function(lambda: self.num_in_flight)
            metrics.queued_tokens.set_function(lambda: self.num_queued_tokens)

    def _refused(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.requests_refused.labels(reason).inc()

    # ------------------------------------------------------------------ requests in flight

    def try_enter(self) -> bool:
        if self.num_in_flight >= self.limits.max_concurrent_requests:
            self._refused("concurrency")
            return False
        self.num_in_flight += 1
        return True

    def leave(self) -> None:
        self.num_in_flight -= 1

    # ------------------------------------------------------------------ tokens (TokenBudget)

    def reserve(self, num_tokens: int) -> None:
        limit = self.limits.max_queued_tokens
        if num_tokens > limit:
            self._refused("request_tokens")
            raise ApiError(
                413,
                f"the request has {num_tokens} prompt tokens, more than this server queues at "
                f"once ({limit}, --max-queued-tokens); split the request",
            )
        if self.num_queued_tokens + num_tokens > limit:
            self._refused("queued_tokens")
            raise ApiError(
                429,
                f"the server is overloaded: {self.num_queued_tokens} prompt tokens are queued and "
                f"this request's {num_tokens} would pass its limit of {limit} "
                "(--max-queued-tokens); retry later",
                headers=_retry_after(),
            )
        self.num_queued_tokens += num_tokens

    def release(self, num_tokens: int) -> None:
        self.num_queued_tokens -= num_tokens

    # ------------------------------------------------------------------ deadlines

    def deadline(self) -> float | None:
        timeout_s = self.limits.request_timeout_s
        return None if timeout_s is None else time.monotonic() + timeout_s

    def timed_out(self) -> ApiError:
        """The answer to a request aborted at its deadline (counted)."""
        if self.metrics is not None:
            self.metrics.requests_timed_out.inc()
        return ApiError(
            503,
            f"the request did not finish within this server's --request-timeout of "
            f"{self.limits.request_timeout_s:g} s and was aborted; retry later or send less",
            headers=_retry_after(),
        )


def _retry_after() -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)}


def seconds_left(scope: Scope) -> float | None:
    """Time left before the request's deadline (may be <= 0); None: it has none."""
    deadline = scope.get(DEADLINE)
    return None if deadline is None else deadline - time.monotonic()


def within_deadline(
    events: AsyncIterator[str], scope: Scope, admission: Admission
) -> AsyncIterator[str]:
    """A server-sent event stream cut at the request's deadline (without one: `events` itself,
    nothing added per event)."""
    if scope.get(DEADLINE) is None:
        return events
    return _cut_at_deadline(events, scope, admission)


async def _cut_at_deadline(
    events: AsyncIterator[str], scope: Scope, admission: Admission
) -> AsyncIterator[str]:
    """Waiting for the next event is cancelled at the deadline (the stream's own cleanup aborts
    its engine requests), then a 503 error event and [DONE] end the stream."""
    while True:
        try:
            async with asyncio.timeout(seconds_left(scope)):
                event = await anext(events)
        except StopAsyncIteration:
            return
        except TimeoutError:
            await events.aclose()  # type: ignore[attr-defined]
            yield error_event(admission.timed_out())
            yield _SSE_DONE
            return
        yield event


class AdmissionMiddleware:
    """429 above --max-concurrent-requests (before the body is read); stamps the deadline."""

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] in _EXEMPT_METHODS
            or scope["path"] in PUBLIC_PATHS
        ):
            await self.app(scope, receive, send)
            return
        if not self.admission.try_enter():
            limit = self.admission.limits.max_concurrent_requests
            message = (
                f"the server is overloaded: {limit} requests are in flight "
                "(--max-concurrent-requests); retry later"
            )
            await error_response(429, message, headers=_retry_after())(scope, receive, send)
            return
        deadline = self.admission.deadline()
        if deadline is not None:
            scope = {**scope, DEADLINE: deadline}
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.leave()
