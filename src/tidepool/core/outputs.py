"""What one step produced per request: the scheduler's typed results, before the output processor
turns them into user-facing outputs (tidepool.outputs). Plain data: no tensors are looked into."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PooledData = Any
"""A pooled tensor (torch.Tensor) handed through `core/` untouched: the scheduler never reads it."""

TokenLogprobs = list[tuple[int, float, int]]
"""[(token id, logprob, rank)] of one position: the sampled token first, then the top ones."""


@dataclass
class EngineCoreOutput:
    """What one step produced for one generating request (engine core → output processor)."""

    request_id: str
    new_token_ids: list[int]
    """The tokens sampled this step (one per step today)."""
    new_logprobs: list[TokenLogprobs] | None = None
    """Per new token, its logprobs as the sampler gave them; the output processor builds the
    Logprob objects (and their decoded text)."""
    finish_reason: str | None = None
    """ "stop" or "length" when this token ended the request; None while it runs."""
    stop_reason: int | str | None = None
    """The stop token id that ended it; None for EOS, length, or while it runs."""
    num_cached_tokens: int = 0
    """Prompt tokens read from the prefix cache when the request was admitted (block-aligned;
    0 with prefix caching off)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PoolingCoreOutput:
    """A pooling request that finished this step: its prompt's last token ran and was pooled."""

    request_id: str
    prompt_token_ids: list[int]
    """The request's prompt (echoed in its output)."""
    data: PooledData
    """The pooler's tensor for this request."""
    num_cached_tokens: int = 0
    """Prompt tokens read from the prefix cache (causal models; 0 for encoders)."""

    finished = True
    """A pooling request yields one output, when it finishes."""


StepOutput = PoolingCoreOutput | EngineCoreOutput
"""One request's result of one step."""
