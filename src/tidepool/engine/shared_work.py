"""Shared work: identical pooling requests of concurrent callers computed once, and an optional
bounded LRU cache of results.

Two requests are identical when they have the same token ids, the same token type ids and the
same PoolingParams (every field: task, dimensions, normalize, activation, ...): the output stage
reads nothing else, so their outputs are equal. The engine serves one model, so the model is part
of the key by construction (one SharedWork per AsyncEngine).

    caller A: [k1, k2]  ── k1, k2 new ──▶ flight F (one engine group: k1, k2), waiters {A}
    caller B: [k1, k3]  ── k1 in F: join; k3 new ──▶ flight G (k3), waiters F {A, B}, G {B}
    A cancelled          ── F waiters {B}: F keeps running (B still needs k1)
    B cancelled          ── F, G waiters {}: both aborted in the engine

A flight is the engine's own future for its group, not a caller's task: cancelling one caller
cannot cancel the computation the others wait for (callers wait through asyncio.shield / wait);
the last waiter to leave a flight cancels it (which aborts its requests in the engine). No task
is made per flight: a one-text request costs one future. Finished flights fill the cache (when it
has room: `cache_size` > 0).

Everything here runs on the event loop's thread: no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

from tidepool.outputs import BatchInputError, PoolingOutput, PoolingRequestOutput, RequestError
from tidepool.params import PoolingParams
from tidepool.request import Request

__all__ = ["SharedWork", "SharedWorkOptions", "SharedWorkStats", "work_key"]

WorkKey = tuple[Hashable, ...]


class Submission(Protocol):
    """Pooling requests handed to the engine (AsyncEngine's PoolingSubmission)."""

    future: asyncio.Future[list[PoolingRequestOutput]]
    """Their outputs, in order, or the failure."""

    def cancel(self) -> None:
        """Abort the unfinished requests in the engine; the future ends cancelled."""


Submit = Callable[[list[Request]], Submission]
"""Hands requests to the engine now; may raise (admission refused, engine closed)."""


@dataclass(frozen=True)
class SharedWorkOptions:
    """How the server shares pooling work between requests."""

    share_in_flight: bool = True
    """Identical requests waiting or running at the same time are computed once."""
    cache_size: int = 0
    """Finished results kept (LRU, one entry per distinct request); 0 = no cache."""

    def __post_init__(self) -> None:
        if self.cache_size < 0:
            raise ValueError(f"the embedding cache size must be >= 0, got {self.cache_size}")

    @property
    def enabled(self) -> bool:
        return self.share_in_flight or self.cache_size > 0


@dataclass
class SharedWorkStats:
    """Counters per request (one prompt), written on the event loop."""

    num_cache_hits: int = 0
    """Answered from the cache."""
    num_cache_misses: int = 0
    """Looked up in the cache (when there is one) and not found: shared or computed."""
    num_shared: int = 0
    """Joined an identical request already waiting or running (in-flight or in the same call)."""
    num_computed: int = 0
    """Sent to the engine."""
    num_cache_evictions: int = 0
    """Cache entries dropped at the bound (least recently used first)."""


def params_key(params: PoolingParams | None) -> tuple[Hashable, ...]:
    """Every field of the parameters, by name: a new field is part of the key without an edit."""
    if params is None:
        return ()
    return tuple((f.name, getattr(params, f.name)) for f in dataclasses.fields(params))


def work_key(request: Request) -> WorkKey:
    """The canonical, hashable form of what decides a pooling request's output."""
    token_type_ids = None if request.token_type_ids is None else tuple(request.token_type_ids)
    return (
        tuple(request.prompt_token_ids),
        token_type_ids,
        request.num_attended_tokens,
        params_key(request.pooling_params),
    )


class _Flight:
    """One engine group computing distinct new keys; resolved by its submission's future."""

    def __init__(self, keys: list[WorkKey], submission: Submission):
        self.keys = keys
        self.submission = submission
        self.future = submission.future
        self.num_waiters = 0


class SharedWork:
    """Runs pooling requests through `run_requests`, sharing identical ones; see the module doc."""

    def __init__(self, submit: Submit, options: SharedWorkOptions) -> None:
        self._submit = submit
        self.options = options
        self.stats = SharedWorkStats()
        self._in_flight: dict[WorkKey, _Flight] = {}
        self._cache: OrderedDict[WorkKey, PoolingOutput] = OrderedDict()

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    async def run(self, requests: list[Request]) -> list[PoolingRequestOutput]:
        """One output per request, in order, each under the caller's own request id."""
        keys = [work_key(r) for r in requests]
        found: dict[WorkKey, PoolingOutput] = {}
        joined: dict[_Flight, None] = {}  # ordered set
        new: dict[WorkKey, Request] = {}
        for key, request in zip(keys, requests, strict=True):
            if key in found or key in new:
                self.stats.num_shared += 1
            elif (hit := self._cache_get(key)) is not None:
                found[key] = hit
            elif (flight := self._in_flight.get(key)) is not None:
                self.stats.num_shared += 1
                joined[flight] = None
            else:
                new[key] = request
        if new:
            joined[self._launch(new)] = None
        if joined:
            await self._wait_for(list(joined), keys, found)
        return [
            PoolingRequestOutput(r.request_id, r.prompt_token_ids, found[k], True)
            for k, r in zip(keys, requests, strict=True)
        ]

    def _cache_get(self, key: WorkKey) -> PoolingOutput | None:
        if not self.options.cache_size:
            return None
        hit = self._cache.get(key)
        if hit is None:
            self.stats.num_cache_misses += 1
            return None
        self._cache.move_to_end(key)
        self.stats.num_cache_hits += 1
        return hit

    def _cache_put(self, key: WorkKey, output: PoolingOutput) -> None:
        if not self.options.cache_size:
            return
        data = output.data
        if data.untyped_storage().nbytes() > data.nbytes:
            # A view into the step's whole output batch: kept as is, one entry would hold the
            # memory of every row of its step.
            output = PoolingOutput(data.clone())
        self._cache[key] = output
        self._cache.move_to_end(key)
        while len(self._cache) > self.options.cache_size:
            self._cache.popitem(last=False)
            self.stats.num_cache_evictions += 1

    def _launch(self, new: dict[WorkKey, Request]) -> _Flight:
        requests = list(new.values())
        self.stats.num_computed += len(requests)
        flight = _Flight(list(new), self._submit(requests))
        if self.options.share_in_flight:
            for key in flight.keys:
                self._in_flight[key] = flight
        flight.future.add_done_callback(lambda _: self._land(flight))
        return flight

    def _abandon(self, flight: _Flight) -> None:
        """The last waiter left: abort the flight's engine requests, and let no newcomer join
        it (its future ends cancelled; one arriving now computes its keys again)."""
        for key in flight.keys:
            if self._in_flight.get(key) is flight:
                del self._in_flight[key]
        flight.submission.cancel()

    def _land(self, flight: _Flight) -> None:
        """The flight's future is done: it leaves the in-flight table, its results the cache."""
        for key in flight.keys:
            if self._in_flight.get(key) is flight:
                del self._in_flight[key]
        future = flight.future
        if future.cancelled() or future.exception() is not None:
            return
        for key, out in zip(flight.keys, future.result(), strict=True):
            self._cache_put(key, out.outputs)

    async def _wait_for(
        self, flights: list[_Flight], keys: list[WorkKey], found: dict[WorkKey, PoolingOutput]
    ) -> None:
        for flight in flights:
            flight.num_waiters += 1
        try:
            # shield / wait, not the future itself or gather: cancelling this caller must not
            # cancel the flights (the others' work); the last waiter's leaving does, below.
            if len(flights) == 1:
                with contextlib.suppress(Exception):  # its outcome is read below
                    await asyncio.shield(flights[0].future)
            else:
                await asyncio.wait([f.future for f in flights])
        finally:
            for flight in flights:
                flight.num_waiters -= 1
                if not flight.num_waiters and not flight.future.done():
                    self._abandon(flight)
        for flight in flights:
            if flight.future.cancelled():  # only abandoned flights are: none of ours
                raise asyncio.CancelledError
            error = flight.future.exception()
            if error is not None:
                raise _for_caller(error, flight, keys)
            for key, out in zip(flight.keys, flight.future.result(), strict=True):
                found[key] = out.outputs


def _for_caller(error: BaseException, flight: _Flight, keys: list[WorkKey]) -> BaseException:
    """A BatchInputError names indexes in the flight's group: re-index it to the caller's."""
    if not isinstance(error, BatchInputError):
        return error
    failed = {flight.keys[e.index]: e.message for e in error.errors if e.index < len(flight.keys)}
    mine = [RequestError(i, failed[k]) for i, k in enumerate(keys) if k in failed]
    return BatchInputError(mine) if mine else error
