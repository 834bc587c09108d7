"""One engine iteration: schedule → execute → update. Nothing else happens in a step."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tidepool.config import EngineConfig
from tidepool.core.scheduler import Scheduler
from tidepool.outputs import PoolingRequestOutput
from tidepool.request import Request
from tidepool.worker.model_runner import ModelRunner


@dataclass
class EngineStats:
    num_steps: int = 0
    num_finished_requests: int = 0
    num_prompt_tokens: int = 0
    model_seconds: float = 0.0
    """Time spent inside ModelRunner.execute (forward + pooling)."""


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_runner = ModelRunner(config)
        self.scheduler = Scheduler(config.scheduler)
        self.stats = EngineStats()

    def add_request(self, request: Request) -> None:
        self.model_runner.pooler.check_params(request.pooling_params)
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[PoolingRequestOutput]:
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return []
        start = time.perf_counter()
        pooled = self.model_runner.execute(sched_out)
        self.stats.model_seconds += time.perf_counter() - start
        finished = self.scheduler.update(sched_out, pooled)
        self.stats.num_steps += 1
        self.stats.num_finished_requests += len(finished)
        self.stats.num_prompt_tokens += sched_out.total_num_scheduled_tokens
        return finished
