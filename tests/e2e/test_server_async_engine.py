"""AsyncEngine in-process (all-MiniLM-L6-v2): a failing step fails only its requests, a cancelled
caller aborts its requests in the engine, shutdown drains what is in flight.

The step budget is 256 tokens, so each ~200-token text runs in a step of its own: that makes the
step boundaries (and therefore which requests a failure or an abort touches) predictable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from tidepool import BatchInputError, PoolingParams
from tidepool.engine.async_engine import AsyncEngine, EngineClosedError, EngineStepError

EMBED = PoolingParams(task="embed")
POISON = "poisonous"


def long_text(i: int) -> str:
    return f"text {i} " + "lorem ipsum dolor " * 40  # ~200 tokens: one per step


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    eng = AsyncEngine.from_args(max_num_batched_tokens=256)
    eng.start()
    yield eng
    asyncio.run(eng.shutdown())


async def _wait_for(predicate, timeout_s: float = 20.0) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout_s)


def test_concurrent_callers_share_steps(engine: AsyncEngine) -> None:
    async def run() -> list:
        texts = [f"short text number {i}" for i in range(40)]
        return await asyncio.gather(*(engine.encode([t], [EMBED]) for t in texts))

    steps_before = engine.stats.num_steps
    results = asyncio.run(run())
    assert all(len(r) == 1 and r[0].outputs.data.shape == (384,) for r in results)
    assert engine.stats.num_steps - steps_before < 20


def test_failed_step_fails_only_its_requests(engine: AsyncEngine, monkeypatch) -> None:
    runner = engine._core.model_runner
    poison_ids = set(engine.tokenizer(POISON, add_special_tokens=False)["input_ids"])
    execute = runner.execute

    def failing_execute(sched_out):
        if any(poison_ids & set(r.prompt_token_ids) for r in sched_out.scheduled):
            raise RuntimeError("injected failure")
        return execute(sched_out)

    monkeypatch.setattr(runner, "execute", failing_execute)

    async def run() -> list:
        bad = engine.encode([long_text(0) + POISON], [EMBED])
        goods = [engine.encode([long_text(i)], [EMBED]) for i in range(1, 4)]
        return await asyncio.gather(bad, *goods, return_exceptions=True)

    failures_before = engine.stats.num_failed_steps
    bad, *goods = asyncio.run(run())
    assert isinstance(bad, EngineStepError) and "injected failure" in str(bad)
    assert all(isinstance(g, list) and len(g) == 1 for g in goods), goods
    assert engine.stats.num_failed_steps == failures_before + 1
    assert engine.is_running  # the loop survived and serves the next caller
    assert len(asyncio.run(engine.encode(["after"], [EMBED]))) == 1


def test_rejected_request_fails_alone(engine: AsyncEngine) -> None:
    async def run() -> list:
        bad = engine.encode(["x"], [PoolingParams(task="embed", dimensions=1000)])
        good = engine.encode(["y"], [EMBED])
        return await asyncio.gather(bad, good, return_exceptions=True)

    bad, good = asyncio.run(run())
    assert isinstance(bad, BatchInputError) and "384" in str(bad)
    assert isinstance(good, list) and len(good) == 1


def test_cancelled_caller_aborts_in_engine(engine: AsyncEngine) -> None:
    async def run() -> None:
        aborted_before = engine.stats.num_aborted_requests
        steps_before = engine.stats.num_steps
        texts = [long_text(i) for i in range(16)]
        task = asyncio.ensure_future(engine.encode(texts, [EMBED] * len(texts)))
        await _wait_for(lambda: engine.stats.num_steps >= steps_before + 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_for(lambda: engine.stats.num_unfinished_requests == 0)
        # Two or three steps ran before the cancel was seen; the rest never ran.
        assert engine.stats.num_aborted_requests - aborted_before >= 6
        assert engine.stats.num_steps - steps_before <= 10
        out = await engine.encode(["still serving"], [EMBED])
        assert len(out) == 1

    asyncio.run(run())


def test_shutdown_drains_in_flight_requests() -> None:
    engine = AsyncEngine.from_args(max_num_batched_tokens=256)
    engine.start()

    async def run() -> None:
        tasks = [asyncio.ensure_future(engine.encode([long_text(i)], [EMBED])) for i in range(4)]
        await asyncio.sleep(0.05)  # handed over (tokenized) before the shutdown starts
        await engine.shutdown(timeout_s=60)
        results = await asyncio.gather(*tasks)
        assert all(len(r) == 1 and torch.isfinite(r[0].outputs.data).all() for r in results)
        with pytest.raises(EngineClosedError):
            await engine.encode(["too late"], [EMBED])
        assert not engine.is_running

    asyncio.run(run())
