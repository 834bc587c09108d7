"""A pooling call's results crossing from the engine thread to the event loop: one future per
call (PoolingGroup, a driver's output sink), resolved when all its requests have finished or one
failed; a step's answers are delivered to each event loop in one wake-up (`deliver`).

    engine thread                                       event loop (the caller's task)
    PoolingGroup.add_output(out) × the call's outputs
    (last one) → outbox ── deliver: call_soon_threadsafe ──▶ future.set_result(outputs)

The engine thread owns the group (async_engine.py); the caller holds a PoolingSubmission.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tidepool.outputs import PoolingRequestOutput, RequestOutput
from tidepool.request import Request

Resolution = tuple[asyncio.AbstractEventLoop, asyncio.Future, Any, BaseException | None]
"""A PoolingGroup's answer waiting for its delivery: the loop, the future, result, failure."""


class PoolingGroup:
    """The requests of one caller, resolved once: when all have finished, or when one failed.

    With an `outbox` (the AsyncEngine's), the answer is appended there and the engine thread
    delivers a step's answers together (`deliver`: one wake-up of the event loop, not one per
    caller); without, it is handed to the loop at once."""

    def __init__(
        self,
        requests: list[Request],
        loop: asyncio.AbstractEventLoop,
        outbox: list[Resolution] | None = None,
    ) -> None:
        self.requests = requests
        self.loop = loop
        self.future: asyncio.Future[list[PoolingRequestOutput]] = loop.create_future()
        self.outputs: dict[str, PoolingRequestOutput] = {}
        self.done = False
        self.outbox = outbox

    # The methods below run on the engine thread (the driver's OutputSink).

    def add_output(self, out: PoolingRequestOutput | RequestOutput) -> None:
        self.outputs[out.request_id] = out  # type: ignore[assignment]
        if len(self.outputs) == len(self.requests):
            self._resolve([self.outputs[r.request_id] for r in self.requests], None)

    def flush(self) -> None:
        pass  # resolved at once when its last request finished

    def fail(self, exc: BaseException) -> None:
        self._resolve(None, exc)

    def _resolve(
        self, result: list[PoolingRequestOutput] | None, exc: BaseException | None
    ) -> None:
        if self.done:
            return
        self.done = True
        if self.outbox is not None:
            self.outbox.append((self.loop, self.future, result, exc))
            return
        try:
            self.loop.call_soon_threadsafe(_set_future, self.future, result, exc)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass


def deliver(outbox: list[Resolution]) -> None:
    """Hand the answers in `outbox` to their event loops, one call per loop; empties it."""
    if not outbox:
        return
    by_loop: dict[asyncio.AbstractEventLoop, list[Resolution]] = {}
    for resolution in outbox:
        by_loop.setdefault(resolution[0], []).append(resolution)
    outbox.clear()
    for loop, resolutions in by_loop.items():
        try:
            loop.call_soon_threadsafe(_set_futures, resolutions)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass


def _set_futures(resolutions: list[Resolution]) -> None:
    for _, future, result, exc in resolutions:
        _set_future(future, result, exc)


class PoolingSubmission:
    """A PoolingGroup handed to the engine thread, as its caller holds it: `future` resolves with
    the outputs (or the failure); `cancel()` aborts the unfinished requests in the engine."""

    def __init__(self, group: PoolingGroup, abort: Callable[[], None]) -> None:
        self.future = group.future
        self._abort = abort
        """Tells the engine thread to abort the group's unfinished requests."""

    def cancel(self) -> None:
        self.future.cancel()
        self._abort()


def _set_future(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():  # cancelled: the caller went away
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
