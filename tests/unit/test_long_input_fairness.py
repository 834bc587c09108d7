"""Fairness for long inputs (issue 26): a long input's chunks take a share of each encoder
step, so requests arriving behind them run in the next step, not after every chunk; an input
over max_embed_len (by default DEFAULT_MAX_EMBED_LEN) is refused up front."""

from __future__ import annotations

import pytest

from tidepool.config import SchedulerConfig
from tidepool.core.scheduler import LONG_INPUT_SHARE, EncoderScheduler
from tidepool.engine.chunked import DEFAULT_MAX_EMBED_LEN
from tidepool.outputs import BatchInputError
from tidepool.params import PoolingParams
from tidepool.request import Request

BUDGET = 4096


def _request(name: str, num_tokens: int, chunk: bool = False) -> Request:
    return Request(
        name, list(range(num_tokens)), PoolingParams(task="embed"), long_input_chunk=chunk
    )


def _scheduler() -> EncoderScheduler:
    return EncoderScheduler(SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=64))


def _steps(scheduler: EncoderScheduler) -> list[list[str]]:
    steps = []
    while scheduler.waiting:
        out = scheduler.schedule()
        assert out.scheduled, "a step with nothing scheduled while requests wait"
        steps.append([r.request_id for r in out.scheduled])
        for request in out.scheduled:
            del scheduler.requests[request.request_id]
    return steps


def test_short_requests_behind_a_long_input_run_in_the_next_step() -> None:
    scheduler = _scheduler()
    for i in range(40):  # a 10,240-token input in 256-token chunks, queued first
        scheduler.add_request(_request(f"chunk{i:02d}", 256, chunk=True))
    for i in range(3):
        scheduler.add_request(_request(f"short{i}", 12))
    steps = _steps(scheduler)
    share = BUDGET // LONG_INPUT_SHARE // 256
    assert share >= 2
    assert steps[0] == [f"chunk{i:02d}" for i in range(share)] + ["short0", "short1", "short2"]
    chunks = [name for step in steps for name in step if name.startswith("chunk")]
    assert chunks == [f"chunk{i:02d}" for i in range(40)]  # in order, a share of each step
    assert all(len(step) == share for step in steps[1:-1])


def test_short_requests_arriving_mid_input_wait_one_step_at_most() -> None:
    scheduler = _scheduler()
    for i in range(20):
        scheduler.add_request(_request(f"chunk{i:02d}", 256, chunk=True))
    share = BUDGET // LONG_INPUT_SHARE // 256
    assert len(scheduler.schedule().scheduled) == share
    scheduler.add_request(_request("late", 30))
    scheduled = [r.request_id for r in scheduler.schedule().scheduled]
    assert scheduled == [f"chunk{i:02d}" for i in range(share, 2 * share)] + ["late"]


def test_a_chunk_larger_than_the_share_still_runs_and_plain_requests_stay_fcfs() -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("big chunk", 2000, chunk=True))
    scheduler.add_request(_request("big chunk 2", 2000, chunk=True))
    assert _steps(scheduler) == [["big chunk"], ["big chunk 2"]]
    for i in range(12):  # no chunks: first come, first served, the whole budget per step
        scheduler.add_request(_request(f"r{i:02d}", 1000))
    assert _steps(scheduler) == [[f"r{i:02d}" for i in range(k, k + 4)] for k in (0, 4, 8)]


def test_the_default_max_embed_len_refuses_up_front(tiny_model_path) -> None:
    from tidepool import LLM

    llm = LLM(
        str(tiny_model_path("bert")),
        device="cpu",
        pooler_config={"enable_chunked_processing": True},
    )
    text = "tide " * (DEFAULT_MAX_EMBED_LEN + 100)
    with pytest.raises(BatchInputError) as refused:
        llm.embed(["a short text", text], use_tqdm=False)
    (error,) = refused.value.errors
    assert error.index == 1 and f"max_embed_len={DEFAULT_MAX_EMBED_LEN}" in error.message
    assert llm.embed("tide " * 500, use_tqdm=False)[0].outputs.embedding  # long, within it
