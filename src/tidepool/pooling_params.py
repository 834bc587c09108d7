"""`vllm.pooling_params`'s path: PoolingParams lives in tidepool/params.py."""

from tidepool.params import POOLING_TASKS, PoolingParams, PoolingTask, check_pooling_task

__all__ = ["POOLING_TASKS", "PoolingParams", "PoolingTask", "check_pooling_task"]
