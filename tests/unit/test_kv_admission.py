"""Admission with reservations: a pooling prompt starts only when the blocks it may hold up to its
end are free outside what the prompts in progress may still take. Scheduler and KV manager are
real, the runner is a fake; nothing is timed.

Block size 4; a full-attention and a sliding-window layer (window 8). Hybrid: two groups drawing
from one pool; uniform (`group_layers(uniform=True)`): one group that keeps every block.
"""

from __future__ import annotations

import random

import pytest
import torch

from tidepool.config import SchedulerConfig
from tidepool.core.causal_scheduler import CausalScheduler
from tidepool.core.sched_output import ModelRunnerOutput, SampledToken, SchedulerOutput
from tidepool.kv_cache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheManager,
    SlidingWindowSpec,
    group_layers,
)
from tidepool.params import PoolingParams, SamplingParams
from tidepool.request import Request

BLOCK_SIZE, WINDOW = 4, 8


def _layers(window: int = WINDOW, block_size: int = BLOCK_SIZE) -> dict:
    return {
        "full.0": FullAttentionSpec(block_size, 1, 8, torch.float32),
        "swa.0": SlidingWindowSpec(block_size, 1, 8, torch.float32, sliding_window=window),
    }


def _kv(uniform: bool, num_blocks: int, window: int = WINDOW, block_size: int = BLOCK_SIZE):
    """`num_blocks` counts the null block (so 21 = 20 usable blocks)."""
    groups = tuple(group_layers(_layers(window, block_size), uniform=uniform))
    return KVCacheManager(KVCacheConfig(num_blocks, groups))


def _scheduler(
    uniform: bool, num_blocks: int, budget: int, chunk: int, max_num_seqs: int = 64
) -> CausalScheduler:
    config = SchedulerConfig(budget, max_num_seqs, long_prefill_token_threshold=chunk)
    return CausalScheduler(config, _kv(uniform, num_blocks), max_model_len=10_000)


def _pool(request_id: str, num_prompt: int, first: int) -> Request:
    return Request(request_id, list(range(first, first + num_prompt)), PoolingParams(task="embed"))


def _step(sched: CausalScheduler) -> tuple[SchedulerOutput, list]:
    """One step with a fake runner: requests whose tokens reach their end get an output."""
    out = sched.schedule()
    runner_out = ModelRunnerOutput()
    for request in out.scheduled:
        end = request.num_computed_tokens + out.num_scheduled_tokens[request.request_id]
        if end < request.num_tokens:
            continue
        if request.pooling_params is not None:
            runner_out.pooled[request.request_id] = torch.zeros(2)
        else:
            runner_out.sampled[request.request_id] = SampledToken(7)
    return out, sched.update(out, runner_out)


def _num_reserved(sched: CausalScheduler) -> int:
    return sched._num_blocks_reserved()


@pytest.mark.parametrize("uniform", [True, False])
def test_a_prompt_waits_until_its_peak_fits_beside_the_prompts_in_progress(uniform: bool) -> None:
    """Prompts of 32 tokens in chunks of 8. Uniform: 8 blocks at the peak, 20 usable, so a and b
    reserve 16 and c waits, though its first chunk (2 blocks) would fit 4 times over. Hybrid: 8
    full + 5 window blocks (13) at the peak, 26 usable: the same. Without reservations c started
    at once and, a few chunks later, someone was preempted."""
    sched = _scheduler(uniform, num_blocks=21 if uniform else 27, budget=24, chunk=8)
    kv = sched.kv_cache_manager
    assert kv is not None
    assert kv.get_num_blocks_at_peak(32, 8) == (8 if uniform else 13)
    for index, name in enumerate("abc"):
        sched.add_request(_pool(name, 32, first=100 * index))
    for _ in range(3):
        out, outputs = _step(sched)
        assert out.num_scheduled_tokens == {"a": 8, "b": 8}  # budget left for c: 8
        assert sched.num_waiting == 1 and not outputs
        assert kv.get_num_free_blocks() - _num_reserved(sched) < kv.get_num_blocks_at_peak(32, 8)
    out, outputs = _step(sched)
    assert out.num_scheduled_tokens == {"a": 8, "b": 8}
    assert [o.request_id for o in outputs] == ["a", "b"]
    out, _ = _step(sched)  # a and b gave their blocks back: c starts
    assert out.num_scheduled_tokens == {"c": 8} and out.restarted_req_ids == {"c"}
    while sched.has_unfinished_requests():
        _step(sched)
    assert sched.stats.num_preemptions == 0


def _run_all(sched: CausalScheduler, requests: list[Request]) -> tuple[set[str], list[int]]:
    """Run every request to its end; (ids that produced an output, running count per step).
    Checks after every step that the reservations fit in the free blocks, that a step that
    admits nobody does not lower the free blocks outside them, and that no request holds more
    than its peak."""
    kv = sched.kv_cache_manager
    assert kv is not None
    for request in requests:
        sched.add_request(request)
    finished: set[str] = set()
    num_running = []
    num_unreserved = kv.get_num_free_blocks()
    for _ in range(10_000):
        if not sched.has_unfinished_requests():
            break
        out, outputs = _step(sched)
        assert not out.is_empty
        num_running.append(len(out.scheduled))
        for request in sched.running:
            assert kv.get_num_blocks_held(request.request_id) <= kv.get_num_blocks_at_peak(
                request.num_prompt_tokens, sched._max_prefill_chunk
            )
        assert _num_reserved(sched) <= kv.get_num_free_blocks()
        if not out.restarted_req_ids:
            assert kv.get_num_free_blocks() - _num_reserved(sched) >= num_unreserved
        num_unreserved = kv.get_num_free_blocks() - _num_reserved(sched)
        for output in outputs:
            assert output.request_id not in finished
            finished.add(output.request_id)
    assert not sched.has_unfinished_requests()
    assert kv.get_num_free_blocks() == kv.config.num_blocks - 1
    return finished, num_running


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize(
    "budget, chunk",
    [(24, 8), (30, 12), (13, 0), (40, 7), (64, 0)],  # unaligned chunk starts included
)
def test_chunked_prompts_under_a_tight_budget_are_never_preempted(
    uniform: bool, budget: int, chunk: int
) -> None:
    """40 pooling prompts of 9 to 60 tokens, a fifth of them repeating an earlier prompt's first
    half (prefix hits, shared blocks), on the bytes of 24 uniform blocks (48 hybrid ones): a
    60-token prompt's peak is 15 uniform blocks, or 15 + 5 to 15 hybrid ones (window blocks,
    by chunk size), so few fit at a time."""
    rng = random.Random(budget * 100 + chunk)
    requests = []
    for index in range(40):
        num_prompt = rng.randrange(9, 61)
        first = 1000 * index
        if index >= 5 and rng.random() < 0.2:
            first = 1000 * rng.randrange(index)  # shares a prefix with an earlier prompt
        requests.append(_pool(str(index), num_prompt, first))
    sched = _scheduler(uniform, num_blocks=25 if uniform else 49, budget=budget, chunk=chunk)
    finished, num_running = _run_all(sched, requests)
    assert finished == {str(index) for index in range(40)}
    assert sched.stats.num_preemptions == 0
    assert max(num_running) >= 2  # it does not simply run one prompt at a time


def test_hybrid_runs_more_prompts_at_once_on_the_same_bytes() -> None:
    """Uniform blocks hold both layers, hybrid blocks one: the same bytes are 2 x 24 hybrid
    blocks. Prompts of 64 tokens in chunks of 8: uniform peak 16 (1 at a time), hybrid 16 + 5."""
    uniform = _scheduler(True, num_blocks=25, budget=64, chunk=8)
    hybrid = _scheduler(False, num_blocks=49, budget=64, chunk=8)
    prompts = [(str(index), 1000 * index) for index in range(8)]
    _, running_uniform = _run_all(uniform, [_pool(name, 64, first) for name, first in prompts])
    _, running_hybrid = _run_all(hybrid, [_pool(name, 64, first) for name, first in prompts])
    assert max(running_uniform) == 1 and max(running_hybrid) == 2  # 24 // 16, 48 // 21
    assert uniform.stats.num_preemptions == hybrid.stats.num_preemptions == 0


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize(
    "window, block_size, chunk, num_prompt",
    [
        (8, 4, 8, 32),
        (8, 4, 5, 33),
        (7, 4, 16, 61),
        (1, 4, 4, 17),
        (16, 4, 3, 50),
        (64, 16, 128, 512),
        (64, 16, 100, 300),
        (5, 2, 9, 40),
        (8, 4, 64, 30),  # one chunk: the whole prompt
    ],
)
def test_the_reservation_covers_the_real_peak(
    uniform: bool, window: int, block_size: int, chunk: int, num_prompt: int
) -> None:
    """Per group, the blocks the manager really holds during a step that starts at any token
    never exceed get_num_blocks_at_peak, and some start reaches it (the bound is exact). Then
    random chunk schedules: the free blocks never drop below what they were, less the
    reservation, until the prompt ends."""
    num_blocks = 2 * (num_prompt // block_size + 2) + 1
    probe = _kv(uniform, num_blocks, window, block_size)
    peaks = [m.get_num_blocks_at_peak(num_prompt, chunk) for m in probe.managers]
    real_peaks = [0] * len(peaks)
    for start in range(num_prompt):
        kv = _kv(uniform, num_blocks, window, block_size)
        request = _pool("a", num_prompt, first=0)
        if start:
            assert kv.allocate_slots(request, start) is not None
            request.num_computed_tokens = start
            kv.remove_skipped_blocks(request)
        assert kv.allocate_slots(request, min(chunk, num_prompt - start)) is not None
        for group_id, manager in enumerate(kv.managers):
            held = sum(not block.is_null for block in manager.get_blocks("a"))
            real_peaks[group_id] = max(real_peaks[group_id], held)
    assert real_peaks == peaks
    if uniform:
        assert peaks == [-(-num_prompt // block_size)]

    rng = random.Random(window * 1000 + chunk)
    for _ in range(20):
        kv = _kv(uniform, num_blocks, window, block_size)
        request = _pool("a", num_prompt, first=0)
        floors = []  # free blocks before each step, less the reservation then
        while request.num_computed_tokens < num_prompt:
            free = kv.get_num_free_blocks()
            floors.append(free - kv.get_num_blocks_to_reserve(request, chunk))
            num_new = min(rng.randint(1, chunk), num_prompt - request.num_computed_tokens)
            assert kv.allocate_slots(request, num_new) is not None
            assert all(kv.get_num_free_blocks() >= floor for floor in floors)
            request.num_computed_tokens += num_new
            kv.remove_skipped_blocks(request)


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("chunk", [8, 6])
def test_prefix_hits_on_blocks_in_use_keep_the_reservations_whole(
    uniform: bool, chunk: int
) -> None:
    """b repeats a's prompt from a's fourth chunk on: its hit is on blocks a holds (it is taken
    in the same step, after a's chunk is entered into the cache). With chunks of 6 the two
    drop their shared window blocks in different steps, and a block one of them still holds does
    not go back to the pool. On every pool size from where b must wait to where it starts at
    once, what both may still take stays within the free blocks, and no step without an
    admission lowers the free blocks left outside the reservations."""
    num_shared = 0
    for num_blocks in range(20, 45):
        sched = _scheduler(uniform, num_blocks=num_blocks, budget=2 * chunk, chunk=chunk)
        kv = sched.kv_cache_manager
        assert kv is not None
        sched.add_request(_pool("a", 48, first=0))
        for _ in range(3):
            _step(sched)
        sched.add_request(_pool("b", 48, first=0))
        num_unreserved = kv.get_num_free_blocks() - _num_reserved(sched)
        while sched.has_unfinished_requests():
            out, _ = _step(sched)
            num_shared += out.num_scheduled_tokens.keys() == {"a", "b"}
            assert _num_reserved(sched) <= kv.get_num_free_blocks()
            if not out.restarted_req_ids:
                assert kv.get_num_free_blocks() - _num_reserved(sched) >= num_unreserved
            num_unreserved = kv.get_num_free_blocks() - _num_reserved(sched)
        assert sched.stats.num_preemptions == 0
    assert num_shared > 0


def test_a_generating_request_does_not_start_on_reserved_blocks() -> None:
    """A pooling prompt in progress reserves its blocks; a generating request whose first chunk
    fits the free blocks but not the unreserved ones waits (before, it started at once and the
    prompt's last chunks preempted it); decoding is not reserved for."""
    sched = _scheduler(True, num_blocks=12, budget=16, chunk=8)  # 11 usable
    kv = sched.kv_cache_manager
    assert kv is not None
    sched.add_request(_pool("p", 40, first=0))  # peak 10 blocks
    _step(sched)
    assert kv.get_num_free_blocks() == 9 and _num_reserved(sched) == 8
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    sched.add_request(Request("g", list(range(500, 512)), sampling_params=params))
    for num_computed in (16, 24, 32, 40):  # g's first chunk, 2 blocks, does not fit in 1
        out, outputs = _step(sched)
        assert out.num_scheduled_tokens == {"p": 8}
        assert kv.get_num_free_blocks() - _num_reserved(sched) == (1 if num_computed < 40 else 11)
    assert [o.request_id for o in outputs] == ["p"]
    out, _ = _step(sched)
    assert out.num_scheduled_tokens == {"g": 8}
    while sched.has_unfinished_requests():
        _step(sched)
    assert sched.stats.num_preemptions == 0


@pytest.mark.parametrize("uniform", [True, False])
def test_a_prompt_whose_peak_exceeds_the_pool_fails_alone(uniform: bool) -> None:
    """20 usable blocks: a 100-token prompt holds 25 uniform blocks at its end, so it is refused
    when added (it would wait forever); the others run."""
    sched = _scheduler(uniform, num_blocks=21, budget=16, chunk=8)
    sched.add_request(_pool("a", 30, first=0))
    num_peak = 25 if uniform else 25 + 5
    with pytest.raises(
        ValueError,
        match=rf"request big: its prompt of 100 tokens holds up to {num_peak} KV-cache blocks at "
        r"once \(chunks of at most 8 tokens\), more than the cache's 20",
    ):
        sched.add_request(_pool("big", 100, first=1000))
    sched.add_request(_pool("b", 30, first=2000))
    finished = set()
    while sched.has_unfinished_requests():
        _, outputs = _step(sched)
        finished |= {o.request_id for o in outputs}
    assert finished == {"a", "b"} and "big" not in sched.requests
