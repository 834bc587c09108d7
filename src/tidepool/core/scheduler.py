"""Which requests run in the next step, under a token budget and a sequence limit.

Encoder (bidirectional) requests are scheduled whole: attention needs every token of the sequence
at once, and they hold no KV blocks, so they finish in the step that schedules them.
"""

from __future__ import annotations

from collections import deque

import torch

from tidepool.config import SchedulerConfig
from tidepool.core.sched_output import SchedulerOutput
from tidepool.outputs import PoolingOutput, PoolingRequestOutput
from tidepool.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}

    def add_request(self, request: Request) -> None:
        if request.num_prompt_tokens > self.config.max_num_batched_tokens:
            # The engine checks this at start-up (max_model_len <= budget); keep the invariant.
            raise ValueError(
                f"request {request.request_id} has {request.num_prompt_tokens} tokens, more than "
                f"max_num_batched_tokens={self.config.max_num_batched_tokens}"
            )
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        request.status = RequestStatus.ABORTED
        try:
            self.waiting.remove(request)
        except ValueError:
            pass
        return True

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        while self.waiting and len(out.scheduled) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_prompt_tokens > budget:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            out.scheduled.append(request)
            out.num_scheduled_tokens[request.request_id] = request.num_prompt_tokens
            budget -= request.num_prompt_tokens
        return out

    def update(
        self, sched_out: SchedulerOutput, pooled: dict[str, torch.Tensor]
    ) -> list[PoolingRequestOutput]:
        finished: list[PoolingRequestOutput] = []
        for request in sched_out.scheduled:
            request.num_computed_tokens += sched_out.num_scheduled_tokens[request.request_id]
            if request.status is RequestStatus.ABORTED:
                continue  # aborted while its step ran: drop the result
            request.status = RequestStatus.FINISHED
            self.requests.pop(request.request_id, None)
            finished.append(
                PoolingRequestOutput(
                    request.request_id,
                    request.prompt_token_ids,
                    PoolingOutput(pooled[request.request_id]),
                )
            )
        return finished
