"""Per-request parameters: plain data, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PoolingTask = Literal["embed", "classify", "score", "token_embed", "token_classify"]
POOLING_TASKS: tuple[str, ...] = ("embed", "classify", "score", "token_embed", "token_classify")
"""Task names a request may carry (vLLM's). No pooler serves token_classify yet: the model's
Pooler.check_params refuses it, naming the tasks the model serves."""


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


# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """How a generating request picks its tokens and when it stops (vLLM's field names)."""

    n: int = 1
    """Completions per prompt (each a separate request sharing the prompt's cached blocks)."""
    temperature: float = 1.0
    """0 (or below 1e-5) = greedy."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep the k likeliest tokens; 0 or -1 = all."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the likeliest one."""
    seed: int | None = None
    """Per-request random stream: the same seed gives the same tokens whatever the batch."""
    presence_penalty: float = 0.0
    """Subtracted from the logits of tokens already generated (once per token)."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence of a token in the generated text."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens in the prompt or the output."""
    max_tokens: int | None = 16
    """Most tokens to generate; None = until max_model_len."""
    min_tokens: int = 0
    """Stop tokens (EOS, stop_token_ids) are masked until this many tokens are generated."""
    stop: str | list[str] | None = None
    """Stop strings: generation ends at the first one; it is left out of the text."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (kept in token_ids, like EOS)."""
    ignore_eos: bool = False
    """Go on past the EOS token."""
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    """Return the log-probabilities of the sampled token and of this many likeliest tokens per
    position (of the model's raw distribution, before temperature and filtering)."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    """Keep only the last k prompt tokens."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        self._check()

    def _check(self) -> None:
        checks = (
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.repetition_penalty > 0.0,
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be >= 1, got {self.max_tokens}",
            ),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}",
            ),
            (
                self.logprobs is None or self.logprobs >= 0,
                f"logprobs must be >= 0, got {self.logprobs}",
            ),
            (all(self.stop or ()), "stop strings must not be empty"),
            (
                self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1,
                f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}",
            ),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
