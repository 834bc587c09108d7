"""The scheduler → runner → scheduler contract for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from tidepool.core.outputs import PooledData, TokenLogprobs
from tidepool.request import Request


@dataclass
class SchedulerOutput:
    scheduled: list[Request] = field(default_factory=list)
    """Requests that run this step, in scheduling order."""
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    """request_id → tokens computed this step (an encoder request takes its whole prompt)."""
    new_block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    """Causal models: request_id → block ids added this step, per KV-cache group. For a request
    in `restarted_req_ids`, its whole block table (prefix-cache hits included)."""
    restarted_req_ids: set[str] = field(default_factory=set)
    """Requests whose block table starts over this step: new ones and resumed preempted ones."""
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests that finished or were aborted since the last step: the runner drops their state."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None = None
    """[(token id, logprob, rank)]: the sampled token first, then the top ones asked for."""


@dataclass
class ModelRunnerOutput:
    pooled: dict[str, PooledData] = field(default_factory=dict)
    """request_id → pooled tensor (opaque to the scheduler), for pooling requests whose last
    prompt token ran this step."""
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    """request_id → next token, for generating requests whose scheduled tokens reached their end
    (a prefill chunk that stops short of the prompt's end samples nothing)."""
