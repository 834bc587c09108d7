"""Shared work: identical pooling requests of concurrent callers computed once, and an optional
bounded LRU cache of results.

Two requests are identical when they have the same token ids, the same token type ids and the
same PoolingParams (every field: task, dimensions, normalize, activation, ...): the output stage
reads nothing else, so their outputs are equal. The engine serves one model, so the model is part
of the key by construction (one SharedWork per AsyncEngine). The cache is bounded in bytes (each
entry priced by its real tensors and key: `entry_bytes`) and, optionally, in entries.

    caller A: [k1, k2]  ── k1, k2 new ──▶ flight F (one engine group: k1, k2), waiters {A}
    caller B: [k1, k3]  ── k1 in F: join; k3 new ──▶ flight G (k3), waiters F {A, B}, G {B}
    A cancelled          ── F waiters {B}: F keeps running (B still needs k1)
    B cancelled          ── F, G waiters {}: both aborted in the engine

A flight is the engine's own future for its group, not a caller's task: cancelling one caller
cannot cancel the computation the others wait for (callers wait through asyncio.shield / wait);
the last waiter to leave a flight cancels it (which aborts its requests in the engine). No task
is made per flight: a one-text request costs one future. Finished flights fill the cache (when
there is one: `SharedWorkOptions.caches`).

Everything here runs on the event loop's thread: no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sized
from dataclasses import dataclass
from typing import Protocol, cast

import torch

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


DEFAULT_CACHE_BYTES = 256 << 20
"""The result cache's byte bound when only its entry count is given: one entry's size ranges
from ~2 KiB (a 384-float embedding) to megabytes (a long text's per-token vectors)."""
ENTRY_OVERHEAD_BYTES = 512
"""What an entry holds besides its tensors and key: the tensor and output objects, the LRU's
node and the key tuple's header."""
KEY_BYTES_PER_TOKEN = 36
"""The key's cost per token id: a pointer in the tuple and (ids above 256) an int object."""


@dataclass(frozen=True)
class SharedWorkOptions:
    """How the server shares pooling work between requests."""

    share_in_flight: bool = True
    """Identical requests waiting or running at the same time are computed once."""
    cache_size: int = 0
    """Most finished results kept (LRU, one entry per distinct request); 0 = no entry bound."""
    cache_bytes: int | None = None
    """Most bytes the kept results take, each priced by its real tensors and key (LRU: the
    least recently used leave first); None = DEFAULT_CACHE_BYTES when `cache_size` is set, else
    no cache; 0 = no cache."""

    def __post_init__(self) -> None:
        if self.cache_size < 0:
            raise ValueError(f"the embedding cache size must be >= 0, got {self.cache_size}")
        if self.cache_bytes is not None and self.cache_bytes < 0:
            raise ValueError(f"the embedding cache bytes must be >= 0, got {self.cache_bytes}")

    @property
    def max_cache_bytes(self) -> int:
        """The cache's byte bound; 0 = no cache."""
        if self.cache_bytes is not None:
            return self.cache_bytes
        return DEFAULT_CACHE_BYTES if self.cache_size > 0 else 0

    @property
    def max_cache_entries(self) -> int | None:
        """The cache's entry bound (None: bytes only)."""
        return self.cache_size or None

    @property
    def caches(self) -> bool:
        return self.max_cache_bytes > 0

    @property
    def enabled(self) -> bool:
        return self.share_in_flight or self.caches


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
    """Cache entries dropped at a bound (least recently used first)."""
    num_cache_too_large: int = 0
    """Results not cached: larger alone than the cache's byte bound."""


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
        request.first_position,
        params_key(request.pooling_params),
    )


def tensor_bytes(tensor: torch.Tensor) -> int:
    """The memory a tensor holds: its storage (a sparse tensor: its indices' and values')."""
    if tensor.is_sparse:
        return tensor_bytes(tensor._indices()) + tensor_bytes(tensor._values())
    return tensor.untyped_storage().nbytes()


def entry_bytes(key: WorkKey, output: PoolingOutput) -> int:
    """A cache entry's price: its output's tensors, its key's token ids, a fixed overhead."""
    first, second = cast(Sized, key[0]), cast("Sized | None", key[1])  # the token ids
    num_key_tokens = len(first) + (len(second) if second is not None else 0)
    return ENTRY_OVERHEAD_BYTES + KEY_BYTES_PER_TOKEN * num_key_tokens + tensor_bytes(output.data)


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
        self._cache: OrderedDict[WorkKey, tuple[PoolingOutput, int]] = OrderedDict()
        self.cached_bytes = 0
        """What the cache's entries take, as priced by `entry_bytes`."""

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
        if not self.options.caches:
            return None
        hit = self._cache.get(key)
        if hit is None:
            self.stats.num_cache_misses += 1
            return None
        self._cache.move_to_end(key)
        self.stats.num_cache_hits += 1
        return hit[0]

    def _cache_put(self, key: WorkKey, output: PoolingOutput) -> None:
        max_bytes = self.options.max_cache_bytes
        if not max_bytes:
            return
        data = output.data
        if not data.is_sparse and data.untyped_storage().nbytes() > data.nbytes:
            # A view into the step's whole output batch: kept as is, one entry would hold the
            # memory of every row of its step.
            output = PoolingOutput(data.clone())
        size = entry_bytes(key, output)
        if size > max_bytes:
            self.stats.num_cache_too_large += 1
            return
        previous = self._cache.pop(key, None)
        if previous is not None:
            self.cached_bytes -= previous[1]
        self._cache[key] = (output, size)
        self.cached_bytes += size
        max_entries = self.options.max_cache_entries
        while self.cached_bytes > max_bytes or (max_entries and len(self._cache) > max_entries):
            _, (_, dropped) = self._cache.popitem(last=False)
            self.cached_bytes -= dropped
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
