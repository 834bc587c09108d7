"""tidepool: a fast inference engine for pooling models (embed, classify, score, rerank)."""

from __future__ import annotations

from tidepool.entrypoints.llm import LLM
from tidepool.outputs import (
    BatchInputError,
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestError,
    ScoringOutput,
    ScoringRequestOutput,
)
from tidepool.params import PoolingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "PoolingParams",
    "BatchInputError",
    "RequestError",
    "PoolingOutput",
    "PoolingRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
    "__version__",
]
