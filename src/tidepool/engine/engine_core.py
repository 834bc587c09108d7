"""One engine iteration: schedule → execute → update. Nothing else happens in a step.

Only the engine driver (engine/llm_engine.py) calls `step()`; it turns the step's typed results
(core/outputs.py) into user-facing outputs and routes them to their callers."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tidepool.config import EngineConfig
from tidepool.core.causal_scheduler import CausalScheduler
from tidepool.core.outputs import StepOutput
from tidepool.core.sched_output import SchedulerOutput
from tidepool.core.scheduler import EncoderScheduler, Scheduler
from tidepool.kv_cache.manager import KVCacheManager
from tidepool.kv_cache.spec import KVCacheConfig
from tidepool.request import Request
from tidepool.worker.model_runner import ModelRunner


@dataclass
class EngineStats:
    num_steps: int = 0
    num_finished_requests: int = 0
    num_prompt_tokens: int = 0
    """Prompt tokens of requests whose prompt has been computed (each request once)."""
    num_scheduled_tokens: int = 0
    """Tokens computed by the model, recomputation after preemption included."""
    model_seconds: float = 0.0
    """Time spent inside ModelRunner.execute (forward + pooling / sampling)."""


@dataclass(frozen=True)
class EngineMetrics:
    """A snapshot of the engine's state and counters (plain names; read by LLM.get_metrics())."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float
    """Share of the KV-cache blocks in use (0 for encoders, which keep none)."""
    kv_cache_num_blocks: int
    prefix_cache_queries: int
    """Tokens looked up in the prefix cache (vLLM counts tokens, not requests)."""
    prefix_cache_hits: int
    """Tokens served from the prefix cache."""
    prefix_cache_requests: int
    """Prefix-cache lookups (one per admitted request with caching on)."""
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_finished_requests: int
    num_steps: int
    num_scheduled_tokens: int
    model_seconds: float


class StepFailedError(RuntimeError):
    """The model runner (or the scheduler's update) raised during a step: the step's requests
    got no result. The cause is chained (`__cause__`)."""

    def __init__(self, request_ids: list[str], cause: Exception) -> None:
        super().__init__(f"the engine step failed: {cause!r}")
        self.request_ids = request_ids
        """The requests scheduled in the failed step."""


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_runner = ModelRunner(config)
        kv_config = self.model_runner.kv_cache_config
        self.kv_cache_manager: KVCacheManager | None = None
        self.scheduler: Scheduler
        # Encoders keep no KV cache; causal models page theirs. Chosen once, here.
        if kv_config is None:
            self.scheduler = EncoderScheduler(config.scheduler)
        else:
            _check_holds_one_request(kv_config, config)
            self.kv_cache_manager = KVCacheManager(
                kv_config, enable_caching=config.cache.enable_prefix_caching
            )
            self.scheduler = CausalScheduler(
                config.scheduler, self.kv_cache_manager, config.model.max_model_len
            )
        self.stats = EngineStats()

    def add_request(self, request: Request) -> None:
        if request.pooling_params is not None:
            pooler = self.model_runner.pooler
            pooler.check_params(request.pooling_params)
            if self.kv_cache_manager is not None:
                request.skip_reading_prefix_cache = pooler.reads_all_tokens(request.pooling_params)
        elif self.model_runner.sampler is None:
            raise ValueError(
                f"this {self.config.model.task} model cannot generate; load a *ForCausalLM model "
                "(or pass runner='generate')"
            )
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.abort_request(request_id)

    def stop_request(self, request_id: str, stop_reason: int | str | None) -> bool:
        return self.scheduler.stop_request(request_id, stop_reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[StepOutput]:
        """Run one step; StepFailedError (naming the step's requests) if it raised. The caller
        decides what happens to those requests (the driver fails and aborts them)."""
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return []
        start = time.perf_counter()
        try:
            runner_out = self.model_runner.execute(sched_out)
        except Exception as exc:
            self._forget_unwritten_blocks(sched_out)
            raise StepFailedError([r.request_id for r in sched_out.scheduled], exc) from exc
        self.stats.model_seconds += time.perf_counter() - start
        try:
            outputs = self.scheduler.update(sched_out, runner_out)
        except Exception as exc:
            raise StepFailedError([r.request_id for r in sched_out.scheduled], exc) from exc
        self.stats.num_steps += 1
        self.stats.num_finished_requests = self.scheduler.stats.num_finished_requests
        self.stats.num_prompt_tokens = self.scheduler.stats.num_prompt_tokens
        self.stats.num_scheduled_tokens += sched_out.total_num_scheduled_tokens
        return outputs

    def _forget_unwritten_blocks(self, sched_out: SchedulerOutput) -> None:
        """A failed step wrote none of its KV: no later request may hit the blocks it was to fill."""
        kv = self.kv_cache_manager
        if kv is None:  # an encoder caches nothing
            return
        for request in sched_out.scheduled:
            num_new_tokens = sched_out.num_scheduled_tokens[request.request_id]
            kv.uncache_unwritten_blocks(request, num_new_tokens)

    def get_metrics(self) -> EngineMetrics:
        kv = self.kv_cache_manager
        prefix = kv.prefix_cache_stats if kv is not None else None
        sched = self.scheduler
        return EngineMetrics(
            num_requests_running=sched.num_running,
            num_requests_waiting=sched.num_waiting,
            kv_cache_usage=kv.usage if kv is not None else 0.0,
            kv_cache_num_blocks=kv.config.num_blocks if kv is not None else 0,
            prefix_cache_queries=prefix.num_query_tokens if prefix else 0,
            prefix_cache_hits=prefix.num_hit_tokens if prefix else 0,
            prefix_cache_requests=prefix.num_requests if prefix else 0,
            num_preemptions=sched.stats.num_preemptions,
            prompt_tokens=sched.stats.num_prompt_tokens,
            generation_tokens=sched.stats.num_generation_tokens,
            num_finished_requests=sched.stats.num_finished_requests,
            num_steps=self.stats.num_steps,
            num_scheduled_tokens=self.stats.num_scheduled_tokens,
            model_seconds=self.stats.model_seconds,
        )


def _check_holds_one_request(kv_config: KVCacheConfig, config: EngineConfig) -> None:
    """A request of max_model_len tokens must fit alone, or it would preempt itself forever
    (vLLM makes the same check at start-up)."""
    max_model_len = config.model.max_model_len
    budget = config.scheduler.max_num_batched_tokens
    num_needed = sum(
        g.spec.max_num_blocks_per_request(max_model_len, budget) for g in kv_config.groups
    )
    if num_needed > kv_config.num_blocks - 1:  # block 0 is the null block
        max_tokens = (kv_config.num_blocks - 1) // len(kv_config.groups) * kv_config.block_size
        raise ValueError(
            f"the KV cache holds {kv_config.num_blocks - 1} blocks, fewer than one request of "
            f"max_model_len={max_model_len} tokens needs ({num_needed}); raise "
            f"kv_cache_memory_bytes or lower max_model_len (to about {max_tokens})"
        )
