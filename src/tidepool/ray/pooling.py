"""Calling the engine on a batch of rows: every bad row becomes an error, never an exception.

Both batch runners (`tidepool.jobs.local`, `tidepool.jobs.ray_runner`) and `tidepool.ray`'s
Predictor call `pool_rows`; it takes any `OfflineLLM` (`tidepool.LLM` is one), the narrow
interface through which ray/ and jobs/ reach the offline API without importing entrypoints/.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from tidepool.config import ModelConfig
    from tidepool.outputs import (
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        ScoringRequestOutput,
    )


class OfflineLLM(Protocol):
    """What the batch jobs and Ray's Predictor use of the offline `tidepool.LLM`."""

    @property
    def model_config(self) -> ModelConfig: ...

    def encode(
        self,
        prompts: Any,
        pooling_params: Any = None,
        *,
        pooling_task: str | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]: ...

    def embed(self, prompts: Any, *, use_tqdm: bool = True) -> list[EmbeddingRequestOutput]: ...

    def score(
        self,
        data_1: Any,
        data_2: Any,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: Any = None,
    ) -> list[ScoringRequestOutput]: ...


@dataclass(frozen=True)
class PooledRows:
    """The results of one batch of rows, in row order."""

    values: np.ndarray
    """[num_rows, width] (embed, classify) or [num_rows] (score); zeros where a row failed."""
    errors: list[str | None]
    """Per row: None, or why the row has no value."""


def pool_rows(
    llm: OfflineLLM,
    task: str,
    texts: list[Any],
    pairs: list[Any] | None = None,
    *,
    pooling_params: Any = None,
    truncate_prompt_tokens: int | None = None,
) -> PooledRows:
    """Run `task` over `texts` (and `pairs` for score); bad rows become errors, never raise.

    Errors of the whole call (dimensions larger than the model's, a task the model lacks) still
    raise: they are settings to fix, and no row of the job could succeed.
    """
    from tidepool.outputs import BatchInputError

    try:
        outputs = _call_engine(llm, task, texts, pairs, pooling_params, truncate_prompt_tokens)
        errors: list[str | None] = [None] * len(texts)
    except BatchInputError as e:
        outputs = e.outputs
        errors = [None] * len(texts)
        for error in e.errors:
            errors[error.index] = error.message
    return PooledRows(_stack(task, outputs, len(texts)), errors)


def _call_engine(
    llm: OfflineLLM,
    task: str,
    texts: list[Any],
    pairs: list[Any] | None,
    pooling_params: Any,
    truncate_prompt_tokens: int | None,
) -> list[Any]:
    if task == "score":
        return llm.score(
            texts,
            pairs,
            truncate_prompt_tokens=truncate_prompt_tokens,
            pooling_params=pooling_params,
            use_tqdm=False,
        )
    # encode() hands back tensors: no per-row Python lists, unlike embed() / classify().
    return llm.encode(
        texts,
        pooling_params,
        pooling_task=task,
        truncate_prompt_tokens=truncate_prompt_tokens,
        use_tqdm=False,
    )


def _stack(task: str, outputs: Sequence[Any], num_rows: int) -> np.ndarray:
    if task == "score":
        return np.array(
            [0.0 if out is None else out.outputs.score for out in outputs], dtype=np.float64
        )
    vectors = [None if out is None else out.outputs.data.float().numpy() for out in outputs]
    width = next((len(v) for v in vectors if v is not None), 0)
    stacked: np.ndarray = np.zeros((num_rows, width), dtype=np.float32)
    for i, vector in enumerate(vectors):
        if vector is not None:
            stacked[i] = vector
    return stacked
