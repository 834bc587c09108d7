"""Shared work (engine/shared_work.py) on all-MiniLM-L6-v2: identical concurrent inputs run the
model once, the result cache never mixes parameters, a cancelled waiter cancels nothing for the
others, the cache stays within its bound.

A gate on the model runner holds the engine thread in its first forward pass until every caller
has arrived, so "at the same time" is certain, not a race; the gate also counts the rows (requests)
each forward pass computes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest
import torch
from serverlib import metric_value, start_threaded_server

from tidepool import BatchInputError, PoolingParams
from tidepool.engine.async_engine import AsyncEngine
from tidepool.engine.shared_work import SharedWorkOptions
from tidepool.entrypoints.openai.server import build_app

EMBED = PoolingParams(task="embed")
TEXT = "the same query, sent by many services at once"


class Gate:
    """Wraps the runner's execute: counts computed rows, and (while closed) blocks the engine
    thread in execute until `open()`."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.runner = engine._core.model_runner
        self.execute = self.runner.execute
        self.released = threading.Event()
        self.released.set()
        self.num_rows = 0
        self.runner.execute = self._execute

    def _execute(self, sched_out):
        self.num_rows += len(sched_out.scheduled)
        assert self.released.wait(60), "the gate was never opened"
        return self.execute(sched_out)

    def close(self) -> None:
        self.released.clear()

    def open(self) -> None:
        self.released.set()

    def remove(self) -> None:
        self.released.set()
        self.runner.execute = self.execute


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    """In-flight sharing (the default), no cache."""
    eng = AsyncEngine.from_args()
    eng.start()
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def cached_engine() -> Iterator[AsyncEngine]:
    eng = AsyncEngine.from_args(shared_work=SharedWorkOptions(cache_size=3))
    eng.start()
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture
def gate(engine: AsyncEngine) -> Iterator[Gate]:
    g = Gate(engine)
    yield g
    g.remove()


async def _until(predicate, timeout_s: float = 30.0) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout_s)


def test_100_concurrent_identical_requests_run_the_model_once(minilm_llm) -> None:
    engine = AsyncEngine.from_args()  # its own: the app's lifespan starts and shuts it down
    gate = Gate(engine)
    server = start_threaded_server(build_app(engine))
    stats = engine.shared_work.stats
    shared_before = stats.num_shared

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as http:
            sends = [http.post("/v1/embeddings", json={"input": TEXT}) for _ in range(100)]
            answers = asyncio.gather(*sends)
            await _until(lambda: stats.num_shared - shared_before >= 99)
            gate.open()
            return await answers

    try:
        gate.close()
        responses = asyncio.run(run())
        metrics = httpx.get(server.url + "/metrics").text
    finally:
        gate.open()
        server.stop()
    assert [r.status_code for r in responses] == [200] * 100
    expected = torch.tensor(minilm_llm.embed([TEXT], use_tqdm=False)[0].outputs.embedding)
    for response in responses:
        got = torch.tensor(response.json()["data"][0]["embedding"])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert gate.num_rows == 1  # one forward row for the 100 requests
    assert stats.num_shared - shared_before == 99
    assert metric_value(metrics, "tidepool:shared_work_shared_total") >= 99


def test_duplicates_inside_one_request_are_computed_once(engine, gate) -> None:
    outs = asyncio.run(engine.encode(["dup a", "dup b", "dup a", "dup a"], [EMBED] * 4))
    assert gate.num_rows == 2
    assert len({o.request_id for o in outs}) == 4  # each answer under its own request id
    assert torch.equal(outs[0].outputs.data, outs[2].outputs.data)
    assert not torch.equal(outs[0].outputs.data, outs[1].outputs.data)


def test_a_cancelled_waiter_does_not_cancel_the_others(engine, gate) -> None:
    stats = engine.shared_work.stats

    async def run() -> None:
        aborted_before = engine.stats.num_aborted_requests
        shared_before = stats.num_shared
        gate.close()
        first = asyncio.ensure_future(engine.encode([TEXT + " cancel"], [EMBED]))
        second = asyncio.ensure_future(engine.encode([TEXT + " cancel"], [EMBED]))
        await _until(lambda: stats.num_shared > shared_before and gate.num_rows == 1)
        first.cancel()  # it launched the computation; the second still waits for it
        with pytest.raises(asyncio.CancelledError):
            await first
        gate.open()
        outs = await second
        assert outs[0].outputs.data.shape == (384,)
        assert engine.stats.num_aborted_requests == aborted_before
        assert gate.num_rows == 1

        # The last waiter to leave aborts the computation in the engine: held back while
        # another request occupies the (gated) step, it is still waiting when it is cancelled.
        gate.close()
        blocker = asyncio.ensure_future(engine.encode([TEXT + " blocker"], [EMBED]))
        await _until(lambda: gate.num_rows == 2)
        computed_before = stats.num_computed
        lonely = asyncio.ensure_future(engine.encode([TEXT + " alone"], [EMBED]))
        await _until(lambda: stats.num_computed == computed_before + 1)
        await asyncio.sleep(0.05)  # the flight's task hands its group to the engine's inbox
        lonely.cancel()
        with pytest.raises(asyncio.CancelledError):
            await lonely
        gate.open()
        await blocker
        await _until(lambda: engine.stats.num_unfinished_requests == 0)
        assert engine.stats.num_aborted_requests == aborted_before + 1
        assert gate.num_rows == 2  # the cancelled one never ran
        again = await engine.encode([TEXT + " alone"], [EMBED])  # computed afresh
        assert again[0].outputs.data.shape == (384,)

    asyncio.run(run())


def test_cache_never_mixes_dimensions_or_normalize(cached_engine, minilm_llm) -> None:
    variants = [
        PoolingParams(task="embed"),
        PoolingParams(task="embed", dimensions=64),
        PoolingParams(task="embed", normalize=False),
        PoolingParams(task="embed", dimensions=64, normalize=False),
    ]
    stats = cached_engine.shared_work.stats

    async def each_variant(order: list[PoolingParams]) -> list[torch.Tensor]:
        return [(await cached_engine.encode([TEXT], [v]))[0].outputs.data for v in order]

    hits_before = stats.num_cache_hits
    # The second pass, in reverse, finds the last three in the cache (it holds 3 entries).
    for order in (variants, variants[::-1]):
        got = dict(zip(map(id, order), asyncio.run(each_variant(order)), strict=True))
        got = [got[id(v)] for v in variants]
        for params, data in zip(variants, got, strict=True):
            offline = minilm_llm.embed([TEXT], pooling_params=params, use_tqdm=False)[0]
            torch.testing.assert_close(
                data, torch.tensor(offline.outputs.embedding), atol=1e-5, rtol=0
            )
    assert [g.shape[0] for g in got] == [384, 64, 384, 64]
    assert abs(float(got[2].norm()) - 1.0) > 1e-3  # normalize=False really is a different entry
    assert stats.num_cache_hits - hits_before == 3


def test_cache_evicts_least_recently_used_at_its_bound(cached_engine) -> None:
    stats = cached_engine.shared_work.stats
    gate = Gate(cached_engine)

    async def embed(text: str) -> None:
        await cached_engine.encode([text], [EMBED])

    try:

        async def run(texts: tuple[str, ...]) -> None:
            for text in texts:
                await embed(text)

        asyncio.run(run(("evict a", "evict b", "evict c")))  # the cache holds just these now
        evictions_before, hits_before = stats.num_cache_evictions, stats.num_cache_hits
        asyncio.run(run(("evict a", "evict d")))  # a is used again before d: b is dropped
        assert cached_engine.shared_work.num_cached == 3
        assert stats.num_cache_evictions - evictions_before == 1
        assert stats.num_cache_hits - hits_before == 1
        rows_before = gate.num_rows
        asyncio.run(embed("evict a"))
        asyncio.run(embed("evict c"))
        asyncio.run(embed("evict d"))
        assert gate.num_rows == rows_before  # all three still cached
        asyncio.run(embed("evict b"))
        assert gate.num_rows == rows_before + 1  # evicted: computed again
    finally:
        gate.remove()


def test_a_rejected_request_names_the_callers_own_index(engine) -> None:
    wrong = PoolingParams(task="embed", dimensions=1000)
    with pytest.raises(BatchInputError) as info:
        asyncio.run(engine.encode(["fine", "also fine"], [EMBED, wrong]))
    assert [e.index for e in info.value.errors] == [1]


def test_cached_results_hold_only_their_own_row(cached_engine) -> None:
    asyncio.run(cached_engine.encode(["row a", "row b", "row c"], [EMBED] * 3))
    for output in cached_engine.shared_work._cache.values():  # not the memory of a whole step
        assert output.data.untyped_storage().nbytes() == output.data.nbytes
