"""Output objects, with vLLM's class and field names so user code ports unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PoolingOutput:
    data: torch.Tensor
    """The pooled tensor: [hidden] for a sequence task, [num_tokens, hidden] for a token task."""


@dataclass
class PoolingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    num_cached_tokens: int = 0
    """Prompt tokens read from the prefix cache (causal models; 0 for encoders), as vLLM's."""


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        data = out.outputs.data
        if data.dim() != 1:
            raise ValueError("an embedding output must be 1-D; use encode() for token embeddings")
        return cls(
            out.request_id,
            out.prompt_token_ids,
            EmbeddingOutput(data.tolist()),
            True,
            out.num_cached_tokens,
        )


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True
    num_cached_tokens: int = 0

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(
            out.request_id,
            out.prompt_token_ids,
            ClassificationOutput(out.outputs.data.tolist()),
            num_cached_tokens=out.num_cached_tokens,
        )


@dataclass
class SparseEmbeddingOutput:
    """A sparse embedding: the token ids with a weight (ascending ids) and their weights."""

    indices: list[int]
    """Token ids (vocabulary positions) with a non-zero weight, ascending."""
    values: list[float]
    """The weight of each id in `indices`."""
    tokens: list[str] | None = None
    """The tokens of `indices` as strings, when asked for (`return_tokens=True`)."""

    def as_dict(self) -> dict[int, float]:
        """token id → weight."""
        return dict(zip(self.indices, self.values, strict=True))


@dataclass
class SparseEmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: SparseEmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0

    @classmethod
    def from_base(cls, out: PoolingRequestOutput, tokenizer=None) -> SparseEmbeddingRequestOutput:
        """From an embed_sparse output (a sparse [vocab] tensor); `tokenizer` fills `tokens`."""
        indices, values = sparse_pairs(out.outputs.data)
        tokens = None if tokenizer is None else tokenizer.convert_ids_to_tokens(indices)
        return cls(
            out.request_id,
            out.prompt_token_ids,
            SparseEmbeddingOutput(indices, values, tokens),
            num_cached_tokens=out.num_cached_tokens,
        )


def sparse_pairs(data: torch.Tensor) -> tuple[list[int], list[float]]:
    """A sparse [vocab] tensor (an embed_sparse output) → (token ids ascending, weights)."""
    if not data.is_sparse:
        raise ValueError("a sparse embedding output must be a sparse tensor (task embed_sparse)")
    data = data.coalesce()
    return data.indices()[0].tolist(), data.values().tolist()


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class Logprob:
    """The log-probability of one token at one position (vLLM's Logprob)."""

    logprob: float
    rank: int
    """1 = the likeliest token."""
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""Per generated position: token id → Logprob (the sampled token and the top `logprobs`)."""


@dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's CompletionOutput)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    """"stop" (EOS, a stop token or a stop string), "length" (max_tokens or max_model_len),
    "abort"; None while unfinished."""
    stop_reason: int | str | None = None
    """The stop token id or stop string; None for EOS and length."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A generating request's result (vLLM's RequestOutput)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: None = None
    """Not computed (always None)."""
    num_cached_tokens: int | None = None
    """vLLM's prefix-cache hit count; not counted for generation here (None)."""
    metrics: None = None
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    kv_transfer_params: None = None
    """vLLM's fields with no meaning here (no metrics object, LoRA, encoder-decoder or KV
    transfer): always None, present so code that reads them runs."""

    @property
    def finish_reason(self) -> str | None:
        """The first completion's finish reason (a shortcut for `outputs[0].finish_reason`)."""
        return self.outputs[0].finish_reason if self.outputs else None


@dataclass
class RequestError:
    """Why one request of a batch failed; the others are unaffected."""

    index: int
    message: str


@dataclass
class BatchInputError(ValueError):
    """Some prompts of a call were invalid.

    Raised after every valid prompt has been computed: ``outputs`` holds their results in prompt
    order (None where the prompt failed), so a caller loses nothing.
    """

    errors: list[RequestError]
    outputs: list = field(default_factory=list)

    def __str__(self) -> str:
        shown = "; ".join(f"prompt {e.index}: {e.message}" for e in self.errors[:5])
        more = f" (and {len(self.errors) - 5} more)" if len(self.errors) > 5 else ""
        return f"{len(self.errors)} invalid prompt(s): {shown}{more}"
