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

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)
