"""The scheduler → runner contract for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from tidepool.request import Request


@dataclass
class SchedulerOutput:
    scheduled: list[Request] = field(default_factory=list)
    """Requests that run this step, in scheduling order."""
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    """request_id → tokens computed this step (an encoder request takes its whole prompt)."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
