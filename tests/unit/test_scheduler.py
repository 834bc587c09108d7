"""Scheduler policy without a model: a fake runner answers every step, the KV-cache manager is real.

Block size 4 throughout; `num_blocks` counts the null block (so 11 = 10 usable blocks).
"""

from __future__ import annotations

import pytest
import torch

from tidepool.config import SchedulerConfig
from tidepool.core.causal_scheduler import CausalScheduler
from tidepool.core.outputs import EngineCoreOutput, PoolingCoreOutput
from tidepool.core.sched_output import ModelRunnerOutput, SampledToken, SchedulerOutput
from tidepool.core.scheduler import EncoderScheduler
from tidepool.kv_cache import FullAttentionSpec, KVCacheConfig, KVCacheGroup, KVCacheManager
from tidepool.params import PoolingParams, SamplingParams
from tidepool.request import Request, RequestStatus

BLOCK_SIZE = 4
SPEC = FullAttentionSpec(BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32)
NEXT_TOKEN = 7


def _scheduler(
    budget: int = 64,
    max_num_seqs: int = 8,
    num_blocks: int = 11,
    caching: bool = True,
    chunked: bool = True,
    max_model_len: int = 1000,
    long_prefill: int = 0,
) -> CausalScheduler:
    kv = KVCacheManager(KVCacheConfig(num_blocks, (KVCacheGroup(SPEC, ("layers.0",)),)), caching)
    config = SchedulerConfig(
        budget,
        max_num_seqs,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=long_prefill,
    )
    return CausalScheduler(config, kv, max_model_len)


def _gen(request_id: str, num_prompt: int, first: int = 100, **params) -> Request:
    params.setdefault("max_tokens", 100)
    params.setdefault("ignore_eos", True)
    return Request(
        request_id,
        list(range(first, first + num_prompt)),
        sampling_params=SamplingParams(**params),
        eos_token_ids=(2,),
    )


def _pool(request_id: str, num_prompt: int, first: int = 100) -> Request:
    return Request(request_id, list(range(first, first + num_prompt)), PoolingParams(task="embed"))


def _run(sched: CausalScheduler, token: int = NEXT_TOKEN) -> tuple[SchedulerOutput, list]:
    """One step with a fake runner: every request whose tokens reach its end samples `token`."""
    out = sched.schedule()
    runner_out = ModelRunnerOutput()
    for request in out.scheduled:
        if (
            request.num_computed_tokens + out.num_scheduled_tokens[request.request_id]
            < request.num_tokens
        ):
            continue
        if request.pooling_params is not None:
            runner_out.pooled[request.request_id] = torch.zeros(2)
        else:
            runner_out.sampled[request.request_id] = SampledToken(token)
    return out, sched.update(out, runner_out)


def test_token_budget_chunks_a_long_prompt_among_decodes():
    sched = _scheduler(budget=10)
    sched.add_request(_gen("a", 6))
    out, _ = _run(sched)
    assert out.num_scheduled_tokens == {"a": 6}
    sched.add_request(_gen("b", 25, first=200))
    # a decodes (1 token) first, b takes the remaining 9, then 9 more, then 7.
    for expected_b in (9, 9, 7):
        out, outputs = _run(sched)
        assert out.num_scheduled_tokens == {"a": 1, "b": expected_b}
        assert [o.request_id for o in outputs] == (["a", "b"] if expected_b == 7 else ["a"])
    assert sched.requests["b"].output_token_ids == [NEXT_TOKEN]


def test_long_prefill_token_threshold_caps_each_prompt_per_step():
    sched = _scheduler(budget=100, num_blocks=31, long_prefill=8)
    sched.add_request(_gen("a", 3))
    out, _ = _run(sched)
    assert out.num_scheduled_tokens == {"a": 3}  # under the cap: whole
    sched.add_request(_pool("p", 20, first=200))
    sched.add_request(_pool("q", 10, first=300))
    # Every prompt gets at most 8 tokens a step, side by side; the decode keeps its 1 token.
    expected = ({"a": 1, "p": 8, "q": 8}, {"a": 1, "p": 8, "q": 2}, {"a": 1, "p": 4})
    for step in expected:
        out, _ = _run(sched)
        assert out.num_scheduled_tokens == step
    assert "p" not in sched.requests and "q" not in sched.requests
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)


def test_max_num_seqs_and_fcfs():
    sched = _scheduler(budget=100, max_num_seqs=2)
    for name in "abc":
        sched.add_request(_gen(name, 3, first=10 * ord(name)))
    out, _ = _run(sched)
    assert [r.request_id for r in out.scheduled] == ["a", "b"]
    out, _ = _run(sched)
    assert [r.request_id for r in out.scheduled] == ["a", "b"]  # c waits for a free seat
    assert sched.num_waiting == 1 and sched.num_running == 2


def test_no_chunking_waits_for_budget():
    sched = _scheduler(budget=8, chunked=False)
    with pytest.raises(ValueError, match="more than max_num_batched_tokens=8"):
        sched.add_request(_gen("big", 9))
    sched.add_request(_gen("a", 6))
    sched.add_request(_gen("b", 6, first=300))
    out, _ = _run(sched)
    assert out.num_scheduled_tokens == {"a": 6}  # b does not fit whole in the 2 left


def test_prefix_hit_skips_tokens_and_new_request_gets_whole_table():
    sched = _scheduler()
    sched.add_request(_gen("a", 10))
    out, _ = _run(sched)
    assert out.new_block_ids["a"] == ([1, 2, 3],) and out.restarted_req_ids == {"a"}
    sched.add_request(_gen("b", 10))  # same prompt: 2 full blocks cached (8 tokens)
    out, _ = _run(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 2}
    assert out.new_block_ids["b"] == ([1, 2, 4],)  # the hits, then a new block
    assert out.new_block_ids["a"] == ([],)  # 11 tokens still fit its 3 blocks
    assert sched.kv_cache_manager.prefix_cache_stats.num_hit_tokens == 8


def test_mean_pooling_skips_prefix_reads():
    sched = _scheduler()
    sched.add_request(_pool("a", 9))
    _run(sched)
    b = _pool("b", 9)
    b.skip_reading_prefix_cache = True
    sched.add_request(b)
    out, outputs = _run(sched)
    assert out.num_scheduled_tokens == {"b": 9}
    assert isinstance(outputs[0], PoolingCoreOutput) and not sched.has_unfinished_requests()


def test_preemption_frees_the_last_admitted_and_it_resumes_first():
    # 4 usable blocks; a and b take 2 each (8 tokens); b's decode then needs a fifth.
    sched = _scheduler(num_blocks=5, caching=False)
    sched.add_request(_gen("a", 7))
    sched.add_request(_gen("b", 7, first=300))
    sched.add_request(_gen("c", 3, first=500))
    out, _ = _run(sched)
    assert out.num_scheduled_tokens == {"a": 7, "b": 7}  # c: no blocks left
    out, _ = _run(sched)  # both have 8 tokens now: fits exactly
    out, _ = _run(sched)  # 9 tokens each: a takes the last free block, b is preempted
    assert out.num_scheduled_tokens == {"a": 1}
    b = sched.waiting[0]
    assert b.request_id == "b" and b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and len(b.output_token_ids) == 2  # outputs kept
    assert sched.stats.num_preemptions == 1
    assert "b" not in sched.kv_cache_manager.managers[0].req_to_blocks


def test_preempted_request_recomputes_and_finishes_with_its_outputs():
    sched = _scheduler(num_blocks=5, caching=False, max_model_len=1000)
    a = _gen("a", 7, max_tokens=4)
    b = _gen("b", 7, first=300, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    finished = []
    for _ in range(30):
        if not sched.has_unfinished_requests():
            break
        _, outputs = _run(sched)
        finished += [
            o.request_id for o in outputs if isinstance(o, EngineCoreOutput) and o.finished
        ]
    assert sorted(finished) == ["a", "b"]
    assert a.output_token_ids == b.output_token_ids == [NEXT_TOKEN] * 4
    assert sched.stats.num_preemptions >= 1
    assert sched.kv_cache_manager.get_num_free_blocks() == 4


@pytest.mark.parametrize(
    "params, tokens, reason, stop_reason, num_outputs",
    [
        (dict(max_tokens=3), [5, 5, 5, 5], "length", None, 3),
        (dict(ignore_eos=False), [5, 2], "stop", None, 2),  # EOS kept in the tokens
        (dict(ignore_eos=True), [5, 2, 5], None, None, 3),
        (dict(stop_token_ids=[9]), [5, 9], "stop", 9, 2),
        (dict(ignore_eos=False, min_tokens=3), [2, 2, 2], "stop", None, 3),
    ],
)
def test_stop_conditions(params, tokens, reason, stop_reason, num_outputs):
    sched = _scheduler()
    request = _gen("a", 3, **params)
    sched.add_request(request)
    last = None
    for token in tokens:
        if not sched.has_unfinished_requests():
            break
        _, outputs = _run(sched, token)
        last = outputs[0]
    assert len(request.output_token_ids) == num_outputs
    assert last.finish_reason == reason and last.stop_reason == stop_reason


def test_max_model_len_stops_generation():
    sched = _scheduler(max_model_len=5)
    request = _gen("a", 3)
    sched.add_request(request)
    _run(sched)
    _, outputs = _run(sched)
    assert outputs[0].finish_reason == "length" and request.num_tokens == 5


def test_abort_and_stop_free_blocks_and_tell_the_runner():
    sched = _scheduler()
    sched.add_request(_gen("a", 5))
    sched.add_request(_gen("b", 5, first=300))
    _run(sched)
    assert sched.abort_request("a") and not sched.abort_request("a")
    assert sched.stop_request("b", "###")
    assert sched.requests == {} and not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.get_num_free_blocks() == 10
    sched.add_request(_gen("c", 3, first=500))
    out, _ = _run(sched)
    assert out.finished_req_ids == {"a", "b"}
    assert sched.stats.num_finished_requests == 1  # b stopped; a aborted


def test_encoder_path_is_unchanged():
    sched = EncoderScheduler(SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=4))
    for name, n in (("a", 6), ("b", 4), ("c", 3)):
        sched.add_request(_pool(name, n))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 6, "b": 4} and not out.new_block_ids
    outputs = sched.update(out, ModelRunnerOutput(pooled={"a": torch.ones(1), "b": torch.ones(1)}))
    assert [o.request_id for o in outputs] == ["a", "b"]
    assert sched.num_waiting == 1
