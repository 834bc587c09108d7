"""Per-request parameters: plain data, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PoolingTask = Literal["embed", "classify", "score", "token_embed", "token_classify"]
POOLING_TASKS: tuple[str, ...] = ("embed", "classify", "score", "token_embed", "token_classify")


@dataclass
class PoolingParams:
    """What a pooling request wants from its output stage (mirrors vLLM's PoolingParams)."""

    task: PoolingTask | None = None
    """Filled in by the entry point (`LLM.embed` sets "embed", ...)."""
    dimensions: int | None = None
    """Matryoshka: keep the first `dimensions` values of the embedding, then renormalize."""
    normalize: bool | None = None
    """Embeddings: L2-normalize. None = what the model's sentence-transformers modules say."""
    activation: bool | None = None
    """Classify / score: apply softmax (sigmoid for one label). None = yes."""
    truncate_prompt_tokens: int | None = None
    """Keep at most this many tokens (special tokens included); -1 = the model's max length."""

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"unknown pooling task {self.task!r}; expected one of {POOLING_TASKS}")
        if self.dimensions is not None:
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int):
                raise ValueError(f"dimensions must be an integer, got {self.dimensions!r}")
            if self.dimensions < 1:
                raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")
        tpt = self.truncate_prompt_tokens
        if tpt is not None:
            if isinstance(tpt, bool) or not isinstance(tpt, int):
                raise ValueError(f"truncate_prompt_tokens must be an integer, got {tpt!r}")
            if tpt < -1 or tpt == 0:
                raise ValueError(f"truncate_prompt_tokens must be -1 or >= 1, got {tpt}")

    def with_task(self, task: PoolingTask) -> PoolingParams:
        return PoolingParams(
            task=task,
            dimensions=self.dimensions,
            normalize=self.normalize,
            activation=self.activation,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )
