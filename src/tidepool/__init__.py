"""tidepool: a fast inference engine for pooling models (embed, classify, score, rerank) and
causal decoders (embed, generate)."""

from __future__ import annotations

from tidepool import envs

envs.apply_openmp_defaults()  # before anything imports torch

from tidepool.config import PoolerConfig  # noqa: E402
from tidepool.engine.args import AsyncEngineArgs, EngineArgs  # noqa: E402
from tidepool.engine.async_llm_engine import AsyncLLMEngine  # noqa: E402
from tidepool.engine.llm_engine import LLMEngine  # noqa: E402
from tidepool.entrypoints.bge_m3 import bge_m3_compute_score  # noqa: E402
from tidepool.entrypoints.llm import LLM  # noqa: E402
from tidepool.inputs import PromptType, TextPrompt, TokensPrompt  # noqa: E402
from tidepool.outputs import (  # noqa: E402
    BatchInputError,
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestError,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tidepool.params import PoolingParams, SamplingParams  # noqa: E402
from tidepool.quantize import quantize_embeddings  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "EngineArgs",
    "AsyncEngineArgs",
    "AsyncLLMEngine",
    "LLMEngine",
    "PoolerConfig",
    "PromptType",
    "TextPrompt",
    "TokensPrompt",
    "quantize_embeddings",
    "bge_m3_compute_score",
    "PoolingParams",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
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
