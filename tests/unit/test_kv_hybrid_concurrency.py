"""The claim behind the hybrid KV cache: on the same block budget, with prompts much longer than the
window, it runs more requests at once than the uniform layout. Scheduler and KV manager are real,
the runner is a fake; nothing is timed.

Model: 4 full-attention and 4 sliding-window layers (window 8), block size 4. Budget: 4 uniform
requests of 128 + 4 tokens (33 blocks of 8 layers each). Hybrid blocks are half the size (4 layers
per group), so the same bytes are 265 usable blocks; a request keeps 33 full-attention blocks and 2
window blocks, 35 in all: 7 requests fit.
"""

from __future__ import annotations

import torch

from tidepool.config import SchedulerConfig
from tidepool.core.causal_scheduler import CausalScheduler
from tidepool.core.sched_output import ModelRunnerOutput, SampledToken
from tidepool.kv_cache import (
    FullAttentionSpec,
    KVCacheManager,
    SlidingWindowSpec,
    group_layers,
    plan_kv_cache,
)
from tidepool.params import PoolingParams, SamplingParams
from tidepool.request import Request

BLOCK_SIZE, WINDOW, PROMPT_LEN, OUTPUT_LEN = 4, 8, 128, 4
LAYERS = {
    f"layers.{i}": (
        SlidingWindowSpec(BLOCK_SIZE, 1, 8, torch.float32, sliding_window=WINDOW)
        if i % 2 == 0
        else FullAttentionSpec(BLOCK_SIZE, 1, 8, torch.float32)
    )
    for i in range(8)
}
BYTES_PER_UNIFORM_BLOCK = 8 * LAYERS["layers.1"].page_size_bytes
BLOCKS_PER_REQUEST = (PROMPT_LEN + OUTPUT_LEN) // BLOCK_SIZE  # 33


def _scheduler(uniform: bool, num_requests: float = 4, budget: int = 256) -> CausalScheduler:
    kv_bytes = int((num_requests * BLOCKS_PER_REQUEST + 1) * BYTES_PER_UNIFORM_BLOCK)
    config = plan_kv_cache(group_layers(LAYERS, uniform=uniform), kv_bytes)
    return CausalScheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=64),
        KVCacheManager(config),
        max_model_len=PROMPT_LEN + OUTPUT_LEN,
    )


def _request(index: int, pooling: bool) -> Request:
    prompt = list(range(index * 1000, index * 1000 + PROMPT_LEN))  # no shared prefixes
    if pooling:
        return Request(str(index), prompt, PoolingParams(task="embed"))
    params = SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True)
    return Request(str(index), prompt, sampling_params=params, eos_token_ids=(2,))


def _run_all(sched: CausalScheduler, num_requests: int, pooling: bool = False) -> list[int]:
    """Requests running after each schedule(), until every request finished."""
    for index in range(num_requests):
        sched.add_request(_request(index, pooling))
    kv = sched.kv_cache_manager
    assert kv is not None
    num_running = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        num_running.append(sched.num_running)
        runner_out = ModelRunnerOutput()
        for request in out.scheduled:
            end = request.num_computed_tokens + out.num_scheduled_tokens[request.request_id]
            if end < request.num_tokens:
                continue
            if pooling:
                runner_out.pooled[request.request_id] = torch.zeros(2)
            else:
                runner_out.sampled[request.request_id] = SampledToken(7)
        sched.update(out, runner_out)
        # Blocks that left the window are freed when the step's tokens are computed.
        for request in sched.running:
            for manager in kv.managers:
                held = sum(not b.is_null for b in manager.get_blocks(request.request_id))
                assert held <= manager.get_num_blocks_to_hold(request.num_computed_tokens)
    assert kv.get_num_free_blocks() == kv.config.num_blocks - 1
    return num_running


def test_same_bytes_hybrid_runs_more_requests_at_once() -> None:
    hybrid, uniform = _scheduler(uniform=False), _scheduler(uniform=True)
    assert [len(g.layer_names) for g in hybrid.kv_cache_manager.config.groups] == [4, 4]
    assert [len(g.layer_names) for g in uniform.kv_cache_manager.config.groups] == [8]
    assert hybrid.kv_cache_manager.config.num_blocks == 2 * (4 * BLOCKS_PER_REQUEST + 1)
    assert hybrid.kv_cache_manager.get_num_blocks_to_hold(PROMPT_LEN + OUTPUT_LEN) == 35

    running_hybrid = _run_all(hybrid, 32)
    running_uniform = _run_all(uniform, 32)
    assert max(running_uniform) == 4
    assert max(running_hybrid) == 7  # 265 // 35: the bound the window allows
    assert max(running_hybrid) >= 1.7 * max(running_uniform)
    assert hybrid.stats.num_preemptions == uniform.stats.num_preemptions == 0
    assert len(running_hybrid) < len(running_uniform)  # fewer, fuller steps


def _take_all_but(kv: KVCacheManager, num_free_blocks: int) -> None:
    """Leave `num_free_blocks` free blocks (the rest held by someone else)."""
    kv.block_pool.get_new_blocks(kv.get_num_free_blocks() - num_free_blocks)


def test_hybrid_runs_a_prompt_in_chunks_that_fit_when_it_cannot_take_it_whole() -> None:
    """Whole, the prompt needs 32 + 32 blocks for one step; afterwards it keeps 32 + 2. With 40
    free it runs in chunks that fit, the window group giving back blocks between them:

        chunk 1: 80 tokens, 20 + 20 blocks   free 0, then 18 leave the window
        chunk 2: 36 tokens,  9 +  9 blocks   free 0, then 9 leave the window
        chunk 3: 12 tokens,  3 +  3 blocks   the prompt is done
    """
    sched = _scheduler(uniform=False)
    kv = sched.kv_cache_manager
    assert kv is not None
    _take_all_but(kv, 40)
    sched.add_request(_request(0, pooling=True))
    chunks = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        chunks.append(out.num_scheduled_tokens["0"])
        pooled = {"0": torch.zeros(2)} if sum(chunks) == PROMPT_LEN else {}
        sched.update(out, ModelRunnerOutput(pooled=pooled))
    assert chunks == [80, 36, 12]
    assert sched.stats.num_preemptions == 0


def test_a_prompt_that_cannot_keep_its_blocks_waits() -> None:
    """Uniform keeps every block: 32 needed, 20 free, so the prompt does not start (a part of it
    would only be preempted later). The same holds in the hybrid layout below 34 free blocks."""
    for uniform, num_free in ((True, 31), (False, 33)):
        sched = _scheduler(uniform=uniform)
        assert sched.kv_cache_manager is not None
        _take_all_but(sched.kv_cache_manager, num_free)
        sched.add_request(_request(0, pooling=True))
        assert sched.schedule().is_empty and sched.num_waiting == 1
