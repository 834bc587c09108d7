"""A request as the engine sees it: token ids, parameters, progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tidepool.multimodal.features import MultiModalFeature
from tidepool.params import PoolingParams, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    """Lost its KV blocks to a longer-running request; waits to recompute (keeps its outputs)."""
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    pooling_params: PoolingParams | None = None
    """Set for pooling requests; None for generating ones."""
    token_type_ids: list[int] | None = None
    """Segment ids for pair inputs (BERT cross-encoders); None = all zeros."""
    num_attended_tokens: int | None = None
    """Encoders: only the prompt's first this many tokens are attended to (are keys), while
    every token attends (a ColBERT query's [MASK] expansion when the model does not attend to
    it); None: all of them."""
    first_position: int = 0
    """Encoders: the first prompt token's position (the others follow it): a text whose leading
    pads are masked (no token attends to them) runs without them, at the positions they pushed
    it to (multimodal/dual_tower.py, SigLIP 2's left padding)."""
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache when the request was scheduled (vLLM's
    num_cached_tokens); 0 for encoders."""
    output_token_ids: list[int] = field(default_factory=list)
    """Tokens generated so far (empty for pooling requests)."""
    block_hashes: list[bytes] = field(default_factory=list, compare=False, repr=False)
    """Chained hashes of the full blocks of `all_token_ids`, kept up to date by the KV-cache manager."""
    sampling_params: SamplingParams | None = None
    """Set for generating requests."""
    eos_token_ids: tuple[int, ...] = ()
    """Generation stops at these (unless sampling_params.ignore_eos)."""
    skip_reading_prefix_cache: bool = False
    """The output needs every prompt token's hidden state (MEAN pooling, token tasks): computing
    from a prefix-cache hit would skip some. Its blocks are still entered into the cache."""
    long_input_chunk: bool = False
    """One chunk of a long input run in chunks (engine/chunked.py): the scheduler gives such
    chunks a share of each step, so that other requests interleave with them."""
    finish_reason: str | None = None
    """"stop" or "length" once finished (vLLM's names); "abort" when aborted."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended generation; None for EOS or length."""
    mm_features: tuple[MultiModalFeature, ...] = field(default=(), compare=False, repr=False)
    """The prompt's images (multimodal/features.py), in offset order: each one's placeholder
    range in prompt_token_ids, encoded by the runner when a step first reaches it."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens (a new list: O(num_tokens))."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        prompt, num_prompt = self.prompt_token_ids, len(self.prompt_token_ids)
        if end <= num_prompt:
            return prompt[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return prompt[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)
