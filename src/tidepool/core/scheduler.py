"""Which requests run in the next step: the scheduler contract, and the encoder scheduler.

Two schedulers sit behind one interface, chosen once when the engine starts (EngineCore):

- `EncoderScheduler` (bidirectional models: BERT-like embedders, cross-encoders): a request is
  scheduled whole, because attention needs every token of the sequence at once; it holds no KV
  blocks, so it finishes in the step that schedules it.
- `CausalScheduler` (core/causal_scheduler.py): decoders with a paged KV cache, chunked prefill,
  prefix caching, preemption, generation.

Each step: `schedule()` plans (a SchedulerOutput), the runner computes (a ModelRunnerOutput), and
`update()` returns one typed result per request that produced something (core/outputs.py); the
output processor turns those into user-facing outputs. The scheduler never looks into tensors.
`abort_request` / `stop_request` are called between steps, never between `schedule()` and
`update()` (the engine driver runs them on its own thread).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass

from tidepool.config import SchedulerConfig
from tidepool.core.outputs import PoolingCoreOutput, StepOutput
from tidepool.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tidepool.request import Request, RequestStatus


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    """Prompt tokens of requests whose prompt has been computed (each request counted once)."""
    num_generation_tokens: int = 0
    num_finished_requests: int = 0


class Scheduler(ABC):
    """What EngineCore may call. Requests are queued by `add_request`, planned by `schedule`,
    advanced by `update`, and leave by finishing, `abort_request` or `stop_request`."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        """Every unfinished request, by id."""
        self.stats = SchedulerStats()

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it could never run (the engine's start-up checks keep
        every request of up to max_model_len tokens within the limits)."""
        self._check_fits(request)
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def _check_fits(self, request: Request) -> None:
        if request.num_prompt_tokens > self.config.max_num_batched_tokens:
            raise ValueError(
                f"request {request.request_id} has {request.num_prompt_tokens} tokens, more "
                f"than max_num_batched_tokens={self.config.max_num_batched_tokens}"
            )

    def abort_request(self, request_id: str) -> bool:
        """Drop a request wherever it is (False if unknown or already finished)."""
        return self._remove(request_id, RequestStatus.ABORTED, "abort", None)

    def stop_request(self, request_id: str, stop_reason: int | str | None) -> bool:
        """Finish a generating request early (a stop string found by the output processor)."""
        return self._remove(request_id, RequestStatus.FINISHED, "stop", stop_reason)

    def _remove(
        self,
        request_id: str,
        status: RequestStatus,
        finish_reason: str,
        stop_reason: int | str | None,
    ) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        request.status = status
        request.finish_reason = finish_reason
        request.stop_reason = stop_reason
        try:
            self.waiting.remove(request)
        except ValueError:
            pass
        self._release(request)
        return True

    @abstractmethod
    def _release(self, request: Request) -> None:
        """Give back what a removed request holds besides its place in the queue."""

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Requests that hold state across steps (0 for encoders: they run within one step)."""
        return 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Plan the next step (empty when nothing can run)."""

    @abstractmethod
    def update(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[StepOutput]:
        """Advance the step's requests by what the runner computed; one result per request that
        produced something this step, in scheduling order."""


LONG_INPUT_SHARE = 8
"""Chunks of long inputs (Request.long_input_chunk) take at most 1 / LONG_INPUT_SHARE of a
step's token budget (at least one chunk a step): a step full of chunks is one that a request
arriving meanwhile waits for whole (~1 s for 4,096 tokens on two loaded CPU cores), and the
requests behind the chunks take the rest of each step. One chunk a step while others wait cut
the short requests' p99 further but slowed the long input more (benchmarks/
long_input_fairness.py; figures in docs/performance.md, 'Choices elsewhere in the code')."""


class EncoderScheduler(Scheduler):
    """Whole prompts under the token budget and the sequence limit; no KV cache. Requests run
    first come, first served, except chunks of long inputs: they get a share of each step
    (LONG_INPUT_SHARE), and the requests behind them take the rest, so one long input never
    holds the others back for more than a short step."""

    def _release(self, request: Request) -> None:
        pass  # an encoder request holds nothing across steps

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunk_budget = budget // LONG_INPUT_SHARE
        num_chunk_tokens = 0
        passed_over: list[Request] = []  # chunks beyond this step's share, kept in order
        while self.waiting and len(out.scheduled) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_tokens = request.num_prompt_tokens
            is_chunk = request.long_input_chunk
            if is_chunk and num_chunk_tokens and num_chunk_tokens + num_tokens > chunk_budget:
                passed_over.append(self.waiting.popleft())
                continue
            if num_tokens > budget:
                break
            if is_chunk:
                num_chunk_tokens += num_tokens
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            out.scheduled.append(request)
            out.num_scheduled_tokens[request.request_id] = num_tokens
            budget -= num_tokens
        self.waiting.extendleft(reversed(passed_over))
        return out

    def update(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[StepOutput]:
        finished: list[StepOutput] = []
        for request in sched_out.scheduled:
            request.num_computed_tokens = request.num_prompt_tokens
            request.status = RequestStatus.FINISHED
            del self.requests[request.request_id]
            finished.append(
                PoolingCoreOutput(
                    request.request_id,
                    request.prompt_token_ids,
                    runner_out.pooled[request.request_id],
                )
            )
        self.stats.num_prompt_tokens += sched_out.total_num_scheduled_tokens
        self.stats.num_finished_requests += len(finished)
        return finished
