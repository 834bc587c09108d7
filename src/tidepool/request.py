"""A request as the engine sees it: token ids, parameters, progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tidepool.params import PoolingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    pooling_params: PoolingParams
    token_type_ids: list[int] | None = None
    """Segment ids for pair inputs (BERT cross-encoders); None = all zeros."""
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    arrival_index: int = field(default=0, compare=False)
    output_token_ids: list[int] = field(default_factory=list)
    """Tokens generated so far (empty for pooling requests)."""
    cache_salt: str | None = None
    """Mixed into the first block hash: requests with different salts never share cached blocks."""
    block_hashes: list[bytes] = field(default_factory=list, compare=False, repr=False)
    """Chained hashes of the full blocks of `all_token_ids`, kept up to date by the KV-cache manager."""

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

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)
