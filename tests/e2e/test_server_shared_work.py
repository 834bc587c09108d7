"""Shared work (engine/shared_work.py) on all-MiniLM-L6-v2: identical concurrent inputs run the
model once, the result cache never mixes parameters, a cancelled waiter cancels nothing for the
others, the cache stays within its bound.

A gate on the model runner holds the engine thread in its first forward pass until every caller
has arrived, so "at the same time" is certain, not a race; the gate also counts the rows (requests)
each forward pass computes.
"""

from __future__ import annotations

import asyncio
import gc
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
    for output, _ in cached_engine.shared_work._cache.values():  # not a whole step's memory
        assert output.data.untyped_storage().nbytes() == output.data.nbytes


# ---------------------------------------------------------------------- the byte bound (issue 26)

CACHE_BYTES = 16 << 20
PER_TOKEN = PoolingParams(task="token_embed")


@pytest.fixture(scope="module")
def wide_per_token_model(tmp_path_factory, minilm_path):
    """A one-layer random BERT 256 wide: a ~50-token text's per-token output is ~50 KiB, so
    2,000 of them (~100 MiB) stand far above the allocator's noise."""
    from conftest import copy_bert_tokenizer
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("wide_per_token")
    torch.manual_seed(3)
    config = BertConfig(
        vocab_size=30522, type_vocab_size=2, hidden_size=256, num_hidden_layers=1,
        num_attention_heads=4, intermediate_size=256, max_position_embeddings=128,
    )  # fmt: skip
    BertModel(config).save_pretrained(folder)
    copy_bert_tokenizer(minilm_path, folder)
    return folder


def _resident_bytes() -> int | None:
    """Resident memory after returning freed heap pages to the OS (None without glibc)."""
    import ctypes
    import ctypes.util
    import gc

    from tidepool.entrypoints.openai.served_models import rss_bytes

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    gc.collect()
    trim(0)
    return rss_bytes()


def test_a_per_token_cache_stays_within_its_byte_bound(wide_per_token_model) -> None:
    """2,000 distinct per-token results (~100 MiB unbounded) through a 16 MiB cache: its
    accounted bytes, the bytes its tensors really hold and the process's resident memory stay
    within the bound (issue 26: 2,000 /embed_all entries took 790 MiB)."""
    engine = AsyncEngine.from_args(
        str(wide_per_token_model),
        device="cpu",
        dtype="float32",
        shared_work=SharedWorkOptions(cache_bytes=CACHE_BYTES),
    )
    shared = engine.shared_work
    texts = [
        f"text {i} " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(40)) for i in range(2100)
    ]

    async def run() -> int | None:
        engine.start()
        await engine.encode(texts[2000:], [PER_TOKEN] * 100)  # warm up: steps, tokenizer
        # What the process holds so far (torch, transformers, the model: millions of objects)
        # leaves the collector's view, so the 21 full collections below scan only what the
        # loop makes (they took ~17 s of this test's 30 s, and a tensor is freed by its count).
        gc.freeze()
        try:
            before, peak = _resident_bytes(), 0
            for start in range(0, 2000, 100):
                outputs = await engine.encode(texts[start : start + 100], [PER_TOKEN] * 100)
                assert outputs[0].outputs.data.shape[1] == 256
                del outputs
                assert shared.cached_bytes <= CACHE_BYTES
                now = _resident_bytes()
                peak = None if before is None or now is None else max(peak, now - before)
        finally:
            gc.unfreeze()
        await engine.shutdown()
        return peak

    peak = asyncio.run(run())
    held = sum(output.data.untyped_storage().nbytes() for output, _ in shared._cache.values())
    assert 0.5 * CACHE_BYTES < held <= shared.cached_bytes <= CACHE_BYTES
    assert shared.num_cached < 2000 and shared.stats.num_cache_evictions > 0
    if peak is not None:
        # The bound plus the allocator's and the server's noise (a loaded 2-core run measured
        # 85 MiB of growth once): still well below the ~220 MiB an unbounded cache grows by.
        assert peak < CACHE_BYTES + (112 << 20), peak >> 20


def test_cache_occupancy_in_metrics(tiny_model_path) -> None:
    from fastapi.testclient import TestClient

    from tidepool.entrypoints.openai.server import ServerArgs, build_app

    options = SharedWorkOptions(cache_bytes=1 << 20)
    engine = AsyncEngine.from_args(str(tiny_model_path("bert")), device="cpu", shared_work=options)
    with TestClient(build_app(engine, ServerArgs())) as client:
        body = {"input": ["one text", "another text"], "task": "token_embed"}
        assert client.post("/pooling", json=body).status_code == 200
        metrics = client.get("/metrics").text
        size = metric_value(metrics, "tidepool:shared_work_cache_bytes")
        bound = metric_value(metrics, "tidepool:shared_work_cache_max_bytes")
        assert 0 < size == engine.shared_work.cached_bytes <= bound == 1 << 20
        assert metric_value(metrics, "tidepool:shared_work_cache_entries") == 2
        hits = engine.shared_work.stats.num_cache_hits
        assert client.post("/pooling", json=body).status_code == 200
        assert engine.shared_work.stats.num_cache_hits == hits + 2


def test_the_entry_bound_maps_to_a_byte_bound_too() -> None:
    from tidepool.engine.shared_work import DEFAULT_CACHE_BYTES

    assert SharedWorkOptions(cache_size=10).max_cache_bytes == DEFAULT_CACHE_BYTES
    assert SharedWorkOptions(cache_size=10).max_cache_entries == 10
    assert SharedWorkOptions(cache_bytes=1000).max_cache_entries is None
    assert (
        not SharedWorkOptions().caches and not SharedWorkOptions(cache_size=5, cache_bytes=0).caches
    )


def test_an_entry_larger_than_the_bound_is_not_cached(tiny_model_path) -> None:
    engine = AsyncEngine.from_args(
        str(tiny_model_path("bert")), device="cpu", shared_work=SharedWorkOptions(cache_bytes=4096)
    )
    engine.start()
    try:
        asyncio.run(engine.encode(["a text of several tokens " * 4], [PER_TOKEN]))
        assert engine.shared_work.num_cached == 0 and engine.shared_work.cached_bytes == 0
        assert engine.shared_work.stats.num_cache_too_large == 1
    finally:
        asyncio.run(engine.shutdown())
