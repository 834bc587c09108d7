"""Generation's results crossing from the engine thread to the event loop: one stream per
generating call (StreamGroup), a driver's output sink. (A pooling call's future is
engine/pooling_future.py's.)

    engine thread                                     event loop (the caller's task)
    StreamGroup.add_output(out) × outputs of a step
    StreamGroup.flush() ── call_soon_threadsafe ────▶ asyncio.Queue ──▶ GenerationStream.__anext__
                            (one put per caller and step)             → list[RequestOutput]

The engine thread owns the group (async_engine.py); the caller only sees the GenerationStream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from tidepool.outputs import RequestOutput
from tidepool.request import Request


@dataclass(frozen=True)
class GenerationInput:
    """One generating request of a call, and how its outputs are labelled."""

    request: Request
    prompt: str | None = None
    """Echoed in RequestOutput.prompt."""
    index: int = 0
    """CompletionOutput.index of its outputs (the server's choice index)."""


class StreamGroup:
    """The generating requests of one caller: outputs go to an asyncio.Queue, one list per step;
    a failure goes there as the exception."""

    def __init__(
        self, inputs: list[GenerationInput], loop: asyncio.AbstractEventLoop, stream: bool
    ) -> None:
        self.inputs = inputs
        self.requests = [i.request for i in inputs]
        self.loop = loop
        self.stream = stream
        self.queue: asyncio.Queue[list[RequestOutput] | BaseException] = asyncio.Queue()
        self.pending: list[RequestOutput] = []
        self.num_unfinished = len(inputs)
        self.done = False

    # The methods below run on the engine thread.

    def add_output(self, out: RequestOutput) -> None:
        self.pending.append(out)
        if out.finished:
            self.num_unfinished -= 1

    def flush(self) -> None:
        if not self.pending or self.done:
            return
        outputs, self.pending = self.pending, []
        self.done = self.num_unfinished == 0
        self._put(outputs)

    def fail(self, exc: BaseException) -> None:
        if self.done:
            return
        self.done = True
        self._put(exc)

    def _put(self, item: list[RequestOutput] | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass


class GenerationStream:
    """What `AsyncEngine.generate` returns: iterate it for lists of RequestOutputs, each the
    outputs one engine step produced for this call (deltas when streamed, else each request's
    final output once); it ends when every request has finished.

    A failure raises from the iteration (EngineStepError, EngineClosedError, BatchInputError).
    Cancelling the iterating task, or `abort()`, aborts the unfinished requests in the engine;
    call `abort()` when you stop iterating early (it does nothing once the stream has ended).
    """

    def __init__(
        self, group: StreamGroup, abort: Callable[[], None], release: Callable[[], None]
    ) -> None:
        self._group = group
        self._abort = abort
        """Tells the engine thread to abort the group's unfinished requests."""
        self._release = release
        """Tells the engine the call has ended (shutdown waits for every call in flight)."""
        self._num_unfinished = len(group.requests)
        self._ended = False

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self._group.requests]

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        if self._ended:
            raise StopAsyncIteration
        try:
            item = await self._group.queue.get()
        except asyncio.CancelledError:
            self.abort()
            raise
        if isinstance(item, BaseException):
            self._end()
            raise item
        self._num_unfinished -= sum(out.finished for out in item)
        if self._num_unfinished == 0:
            self._end()
        return item

    def abort(self) -> None:
        """Abort the unfinished requests in the engine (client gone, or stopped reading)."""
        if not self._ended:
            self._end()
            self._abort()

    def _end(self) -> None:
        self._ended = True
        self._release()
