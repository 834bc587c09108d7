"""The causal models' scheduler: a paged KV cache, chunked prefill, prefix caching, preemption.

It follows vLLM's V1 policy, under a token budget and a sequence limit. Every request has
`num_computed_tokens`; a step gives each as many new tokens as the budget allows:

    1. running requests first, in admission order: a decode takes 1 token, an unfinished prompt
       the rest of its prompt (cut to the remaining budget: chunked prefill). When the pool has
       no blocks for one, the last-admitted running request is preempted (its blocks freed, its
       progress reset; it waits at the front of the queue to recompute) until the blocks fit.
    2. then waiting requests, FCFS (unless someone was preempted this step): a prefix-cache
       lookup gives the tokens it may skip, then blocks for the rest (or the first chunk of it).

Admission with reservations. A pooling request never generates, so the most blocks it will hold
is known before it starts: its prompt's peak with chunks of at most `_max_prefill_chunk` tokens
(KVCacheManager.get_num_blocks_at_peak; full attention: every block of the prompt, a sliding
window: the blocks of W - 1 + C tokens and the one they straddle). While other requests run, one
starts only when the free blocks, less what the pooling prompts in progress may still take to
reach their ends (their reservations), cover its own peak; a generating request starts only when
its first chunk fits outside the reservations. So pooling prompts never run out of blocks halfway
and are never preempted by each other, whether they run whole or in chunks. Without it a chunked
prompt started whenever its first chunk fitted and preempted others (or itself) later: with 512-
token prompts in 128-token chunks that restarted most prompts once or twice.

Generating requests reserve nothing (vLLM reserves no decode blocks either): how long they grow
is not known in advance, and reserving max_tokens would keep most of the pool idle. They start
as soon as their first chunk fits, and when decoding or a chunk runs out of blocks the
last-admitted request is preempted, as before. A workload with no pooling prompts in progress
is scheduled exactly as without reservations.

A prefill chunk whose blocks do not fit runs shorter (block-aligned) instead, when the blocks the
request keeps after all its tokens would fit: that only happens with sliding-window groups, which
hold a chunk's blocks for one step and then only the window's (see _num_prefill_tokens_that_fit).
After each step, blocks that left a window are freed at once (KVCacheManager.remove_skipped_blocks).

A generating request samples a token whenever its scheduled tokens reach its end; a pooling
request finishes when its last prompt token has run.
"""

from __future__ import annotations

from tidepool.config import SchedulerConfig
from tidepool.core.outputs import EngineCoreOutput, PoolingCoreOutput, StepOutput
from tidepool.core.sched_output import ModelRunnerOutput, SampledToken, SchedulerOutput
from tidepool.core.scheduler import Scheduler
from tidepool.kv_cache.manager import KVCacheBlocks, KVCacheManager
from tidepool.request import Request, RequestStatus


class CausalScheduler(Scheduler):
    """Decoders: requests hold KV-cache blocks across steps (see the module docstring)."""

    def __init__(
        self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int
    ) -> None:
        super().__init__(config)
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        """Finished or aborted since the last schedule(): told to the runner in the next step."""

    # ------------------------------------------------------------------ requests

    def _check_fits(self, request: Request) -> None:
        if not self.config.enable_chunked_prefill:
            super()._check_fits(request)
        kv = self.kv_cache_manager
        num_peak = kv.get_num_blocks_at_peak(request.num_prompt_tokens, self._max_prefill_chunk)
        num_usable = kv.config.num_blocks - 1  # block 0 is the null block
        if num_peak > num_usable:
            # It would wait forever (or preempt itself forever): fail it alone, now.
            raise ValueError(
                f"request {request.request_id}: its prompt of {request.num_prompt_tokens} "
                f"tokens holds up to {num_peak} KV-cache blocks at once (chunks of at most "
                f"{self._max_prefill_chunk} tokens), more than the cache's {num_usable}; "
                "shorten it, lower long_prefill_token_threshold / max_num_batched_tokens, or "
                "raise kv_cache_memory_bytes"
            )

    def _release(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        if request.status is RequestStatus.FINISHED:
            self.stats.num_finished_requests += 1

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        budget, num_preempted = self._schedule_running(out, self.config.max_num_batched_tokens)
        if num_preempted == 0:
            self._schedule_waiting(out, budget)
        if out.is_empty:  # no step runs: tell the runner next time
            self.finished_req_ids |= out.finished_req_ids
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, int]:
        """Schedule running requests in order, preempting from the back; (budget left, preempted)."""
        kv = self.kv_cache_manager
        num_preempted = 0
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            # >= 1: a running request always has tokens left (a finished one left `running`).
            num_new_tokens = self._cap_prefill(
                min(request.num_tokens - request.num_computed_tokens, budget)
            )
            while (new_blocks := kv.allocate_slots(request, num_new_tokens)) is None:
                num_fitting = self._num_prefill_tokens_that_fit(request, num_new_tokens)
                if 0 < num_fitting < num_new_tokens:  # a shorter chunk, not a preemption
                    num_new_tokens = num_fitting
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                num_preempted += 1
                if victim is request:
                    break
            if new_blocks is None:
                break  # the request preempted itself; everything after it is gone too
            self._add_scheduled(out, request, num_new_tokens, new_blocks.get_block_ids())
            budget -= num_new_tokens
            index += 1
        return budget, num_preempted

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        kv = self.kv_cache_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit = None
            if request.num_computed_tokens == 0 and not request.skip_reading_prefix_cache:
                hit = kv.get_computed_blocks(request)
            num_hit_tokens = hit.num_computed_tokens if hit is not None else 0
            num_new_tokens = request.num_tokens - num_hit_tokens
            if num_new_tokens > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new_tokens = budget
            num_new_tokens = self._cap_prefill(num_new_tokens)
            hit_blocks = hit.blocks if hit is not None else None
            num_reserved = self._num_blocks_reserved()
            if not self._peak_fits(request, hit_blocks, num_reserved):
                break  # its prompt could not reach its end: wait for running requests to finish
            new_blocks = kv.allocate_slots(
                request, num_new_tokens, hit_blocks, num_reserved_blocks=num_reserved
            )
            if new_blocks is None:
                num_new_tokens = self._num_prefill_tokens_that_fit(
                    request, num_new_tokens, hit_blocks, num_reserved
                )
                if num_new_tokens > 0:
                    new_blocks = kv.allocate_slots(
                        request, num_new_tokens, hit_blocks, num_reserved_blocks=num_reserved
                    )
            if new_blocks is None:
                break  # not enough free blocks: wait for running requests to finish
            self.waiting.popleft()
            if request.status is not RequestStatus.PREEMPTED:  # vLLM: the first admission's hit
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            self.running.append(request)
            out.restarted_req_ids.add(request.request_id)
            self._add_scheduled(out, request, num_new_tokens, kv.get_block_ids(request.request_id))
            budget -= num_new_tokens

    @property
    def _max_prefill_chunk(self) -> int:
        """Most prompt tokens one request computes in one step: the step's budget, or less with
        long_prefill_token_threshold (without chunked prefill a prompt runs whole, <= budget)."""
        cap = self.config.long_prefill_token_threshold
        budget = self.config.max_num_batched_tokens
        return min(cap, budget) if cap > 0 and self.config.enable_chunked_prefill else budget

    def _num_blocks_reserved(self) -> int:
        """Free blocks the running pooling prompts may still take before they end (a pooling
        request runs only while its prompt does)."""
        kv = self.kv_cache_manager
        return sum(
            kv.get_num_blocks_to_reserve(request, self._max_prefill_chunk)
            for request in self.running
            if request.pooling_params is not None
        )

    def _peak_fits(
        self, request: Request, hit_blocks: KVCacheBlocks | None, num_reserved: int
    ) -> bool:
        """Admission of a pooling request while others run: the free blocks outside the
        reservations cover what it may take up to the end of its prompt. Worked example (block
        16, window 64, chunks of 128, prompts of 512, a pool of 137 blocks): hybrid, a prompt may
        take 32 full-attention + 13 window blocks, so 3 run at once (137 // 45); uniform (one
        group of 128-KiB blocks, 68 of them), 32 each, 2 at once.

        True for generating requests (they reserve nothing; their chunks stay outside the
        reservations through `num_reserved_blocks`) and when nothing runs: alone, a prompt runs as
        before, in chunks that fit (see _num_prefill_tokens_that_fit; its reservation then keeps
        everyone else waiting until it ends)."""
        kv = self.kv_cache_manager
        if request.pooling_params is None or not self.running:
            return True
        num_needed = kv.get_num_blocks_to_reserve(request, self._max_prefill_chunk, hit_blocks)
        return num_needed <= kv.get_num_free_blocks() - num_reserved

    def _cap_prefill(self, num_new_tokens: int) -> int:
        """At most long_prefill_token_threshold prompt tokens per request per step (0: no cap)."""
        cap = self.config.long_prefill_token_threshold
        if 0 < cap < num_new_tokens and self.config.enable_chunked_prefill:
            return cap
        return num_new_tokens

    def _num_prefill_tokens_that_fit(
        self,
        request: Request,
        num_new_tokens: int,
        hit_blocks: KVCacheBlocks | None = None,
        num_reserved: int = 0,
    ) -> int:
        """A prefill chunk whose blocks do not fit: how much of it to run instead (0: none).

        A shorter chunk runs only when the request's blocks after all its tokens would fit. With
        full attention only, that is the whole remaining prompt, which then fits as one chunk:
        nothing changes. A sliding-window group keeps a chunk's blocks for one step and then only
        the window's, so a hybrid model admits a long prompt chunk by chunk (worked example:
        window 128, block 16, prompt 1,024: whole, it needs 64 + 64 blocks at once; afterwards it
        keeps 64 + 9). vLLM runs a chunk whole or not at all.
        """
        kv = self.kv_cache_manager
        if num_new_tokens <= 1 or not self.config.enable_chunked_prefill:
            return 0
        num_to_hold = kv.get_num_blocks_to_hold(request.num_tokens)
        num_held = kv.get_num_blocks_held(request.request_id)
        if num_to_hold > kv.get_num_free_blocks() - num_reserved + num_held:
            return 0
        return kv.get_num_new_tokens_that_fit(request, num_new_tokens, hit_blocks, num_reserved)

    def _add_scheduled(
        self,
        out: SchedulerOutput,
        request: Request,
        num_new_tokens: int,
        block_ids: tuple[list[int], ...],
    ) -> None:
        out.scheduled.append(request)
        out.num_scheduled_tokens[request.request_id] = num_new_tokens
        out.new_block_ids[request.request_id] = block_ids

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks; it recomputes from scratch (its outputs are kept)."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.stats.num_preemptions += 1

    # ------------------------------------------------------------------ update

    def update(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        any_finished = False
        for request in sched_out.scheduled:
            num_new_tokens = sched_out.num_scheduled_tokens[request.request_id]
            computed_before = request.num_computed_tokens
            request.num_computed_tokens += num_new_tokens
            self.kv_cache_manager.remove_skipped_blocks(request)
            if computed_before < request.num_prompt_tokens <= request.num_computed_tokens:
                if not request.output_token_ids:  # not a recompute after preemption
                    self.stats.num_prompt_tokens += request.num_prompt_tokens
            if request.pooling_params is not None:
                pooled = runner_out.pooled.get(request.request_id)
                if pooled is None:
                    continue  # a prefill chunk short of the prompt's end
                self._finish(request, "stop")
                outputs.append(
                    PoolingCoreOutput(
                        request.request_id,
                        request.prompt_token_ids,
                        pooled,
                        request.num_cached_tokens,
                    )
                )
            else:
                sampled = runner_out.sampled.get(request.request_id)
                if sampled is None:
                    continue
                outputs.append(self._append_token(request, sampled))
            any_finished |= request.is_finished
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _append_token(self, request: Request, sampled: SampledToken) -> EngineCoreOutput:
        request.output_token_ids.append(sampled.token_id)
        self.stats.num_generation_tokens += 1
        finish_reason, stop_reason = self._check_stop(request)
        if finish_reason is not None:
            self._finish(request, finish_reason, stop_reason)
        logprobs = None if sampled.logprobs is None else [sampled.logprobs]
        return EngineCoreOutput(
            request.request_id,
            [sampled.token_id],
            logprobs,
            finish_reason,
            stop_reason,
            request.num_cached_tokens,
        )

    def _check_stop(self, request: Request) -> tuple[str | None, int | None]:
        """vLLM's order: length first, then nothing before min_tokens, then EOS, stop tokens."""
        params = request.sampling_params
        assert params is not None
        num_output_tokens = len(request.output_token_ids)
        if (params.max_tokens is not None and num_output_tokens >= params.max_tokens) or (
            request.num_tokens >= self.max_model_len
        ):
            return "length", None
        if num_output_tokens < params.min_tokens:
            return None, None
        last_token = request.output_token_ids[-1]
        if not params.ignore_eos and last_token in request.eos_token_ids:
            return "stop", None
        if last_token in params.stop_token_ids:  # type: ignore[operator]
            return "stop", last_token
        return None, None

    def _finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.kv_cache_manager.free(request)
        self.requests.pop(request.request_id, None)
        self.finished_req_ids.add(request.request_id)
        self.stats.num_finished_requests += 1
