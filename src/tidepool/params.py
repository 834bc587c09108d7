"""Per-request parameters: plain data, validated on construction."""

from __future__ import annotations

import copy
import enum
import re
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

PoolingTask = Literal["embed", "classify", "score", "token_embed", "token_classify", "embed_sparse"]
POOLING_TASKS: tuple[str, ...] = get_args(PoolingTask)
"""The built-in task names a request may carry: vLLM's, and "embed_sparse" (TEI's /embed_sparse:
(token id, weight) pairs of a SPLADE or BGE-M3 model). A model serves some of them
(`ModelConfig.pooling_tasks`); the pooler refuses the others, naming the ones it serves. vLLM's
newest releases fold "score" into "classify"; tidepool keeps "score" (a cross-encoder's pair
score) as the name of the same thing, so code written for either release runs. An output head
may declare more (`declare_pooling_task`): `known_pooling_tasks()` is the whole list."""

_HEAD_TASKS: dict[str, str] = {}
"""Tasks declared by output heads beyond POOLING_TASKS: task → the head that declared it."""

_TASK_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


def known_pooling_tasks() -> tuple[str, ...]:
    """The built-in tasks, then those the registered output heads declare."""
    return (*POOLING_TASKS, *_HEAD_TASKS)


def declare_pooling_task(task: str, owner: str) -> None:
    """Make `task` a task name requests may carry, served by output head `owner`
    (output_heads/registry.py calls it when a head is registered); ValueError for a built-in
    name, a refused one, a name that is not lower_snake_case, or one another head declared."""
    if task in POOLING_TASKS or task in _REFUSED_TASKS:
        raise ValueError(f"output head {owner!r}: {task!r} is a built-in task name")
    if not _TASK_NAME.fullmatch(task):
        raise ValueError(
            f"output head {owner!r}: task name {task!r} must be lower_snake_case "
            "(a-z, 0-9, _; at most 64 characters)"
        )
    holder = _HEAD_TASKS.get(task)
    if holder is not None and holder != owner:
        raise ValueError(f"output head {owner!r}: task {task!r} is already declared by {holder!r}")
    _HEAD_TASKS[task] = owner


def withdraw_pooling_task(task: str, owner: str) -> None:
    """Undo `declare_pooling_task` (the head is unregistered)."""
    if _HEAD_TASKS.get(task) == owner:
        del _HEAD_TASKS[task]


_REFUSED_TASKS = {
    "encode": "the `encode` task was removed in vLLM; use token_embed or token_classify",
    "plugin": "IO-processor plugins (task 'plugin') are not supported here",
    "embed&token_classify": "the combined task 'embed&token_classify' is not supported here; "
    "run embed and token_classify as two requests",
}

_DEPRECATED_ALIASES = ("normalize", "activation", "softmax")


def check_pooling_task(task: object) -> None:
    """ValueError naming the task unless it is one of known_pooling_tasks() (vLLM's removed /
    unsupported task names get their own reason)."""
    if isinstance(task, str) and task in _REFUSED_TASKS:
        raise ValueError(_REFUSED_TASKS[task])
    if not isinstance(task, str) or task not in known_pooling_tasks():
        raise ValueError(f"unknown pooling task {task!r}; expected one of {known_pooling_tasks()}")


@dataclass
class PoolingParams:
    """What a pooling request wants from its output stage (vLLM's PoolingParams, as vLLM 0.32
    has it: `use_activation` for every task; `normalize` / `activation` / `softmax` kept as
    deprecated aliases)."""

    truncate_prompt_tokens: int | None = None
    """Keep at most this many tokens (special tokens included); -1 = the model's max length."""
    use_activation: bool | None = None
    """Embeddings: L2-normalize; classify / score: softmax (sigmoid for one label). None = the
    model's default (embeddings: what its sentence-transformers modules say; scores: yes)."""
    dimensions: int | None = None
    """Matryoshka: keep the first `dimensions` values of the embedding, then renormalize."""
    task: str | None = None
    """Filled in by the entry point (`LLM.embed` sets "embed", ...)."""
    truncation_side: Literal["right", "left"] | None = "right"
    """Which end of a text `truncate_prompt_tokens` keeps: "right" cuts the end (keeps the first
    tokens), "left" cuts the start (keeps the last; Cohere's truncate=START, TEI's Left)."""
    max_active_dims: int | None = None
    """embed_sparse: keep the largest this many weights (sentence-transformers' name); None =
    every non-zero weight."""
    prompt_name: str | None = None
    """The model's prompt (config_sentence_transformers.json) put before the text; None = its
    default_prompt_name. ColBERT models: "query" or "document" (the default) chooses how the
    text is encoded. Token-id prompts get no prompt (engine/prompts.py)."""
    # vLLM's step-pooling and internal fields: accepted at their defaults, refused otherwise.
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None
    requires_token_ids: bool = False
    skip_reading_prefix_cache: bool | None = None
    late_interaction_params: Any = None
    extra_kwargs: dict[str, Any] | None = None
    output_kind: Any = None
    # Deprecated aliases of use_activation (vLLM's older names): folded into it, then None.
    normalize: bool | None = field(default=None, repr=False)
    activation: bool | None = field(default=None, repr=False)
    softmax: bool | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._resolve_aliases()
        self._refuse_vllm_only()
        if self.truncation_side is None:
            self.truncation_side = "right"
        if self.truncation_side not in ("right", "left"):
            raise ValueError(
                f"truncation_side must be 'right' or 'left', got {self.truncation_side!r}"
            )
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation must be a bool or None, got {self.use_activation!r}")
        if self.prompt_name is not None and not isinstance(self.prompt_name, str):
            raise ValueError(f"prompt_name must be a string, got {self.prompt_name!r}")
        if self.task is not None:
            check_pooling_task(self.task)
        if self.dimensions is not None:
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int):
                raise ValueError(f"dimensions must be an integer, got {self.dimensions!r}")
            if self.dimensions < 1:
                raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")
        mad = self.max_active_dims
        if mad is not None and (isinstance(mad, bool) or not isinstance(mad, int) or mad < 1):
            raise ValueError(f"max_active_dims must be a positive integer, got {mad!r}")
        tpt = self.truncate_prompt_tokens
        if tpt is not None:
            if isinstance(tpt, bool) or not isinstance(tpt, int):
                raise ValueError(f"truncate_prompt_tokens must be an integer, got {tpt!r}")
            if tpt < -1 or tpt == 0:
                raise ValueError(f"truncate_prompt_tokens must be -1 or >= 1, got {tpt}")

    def _resolve_aliases(self) -> None:
        """normalize / activation / softmax → use_activation (a DeprecationWarning; ValueError
        when two disagree). Afterwards the aliases are None: use_activation is the one value."""
        for name in _DEPRECATED_ALIASES:
            value = getattr(self, name)
            if value is None:
                continue
            if self.use_activation is not None and value != self.use_activation:
                raise ValueError(
                    f"{name}={value!r} contradicts use_activation={self.use_activation!r}; "
                    f"{name} is a deprecated alias of use_activation: give use_activation only"
                )
            warnings.warn(
                f"PoolingParams({name}=...) is deprecated (vLLM 0.32 has use_activation for "
                "every task); use use_activation",
                DeprecationWarning,
                stacklevel=4,
            )
            self.use_activation = value
        self.normalize = self.activation = self.softmax = None

    def _refuse_vllm_only(self) -> None:
        refused = {
            "step_tag_id": (self.step_tag_id is not None, "STEP pooling (reward models)"),
            "returned_token_ids": (
                self.returned_token_ids is not None,
                "STEP pooling (reward models)",
            ),
            "requires_token_ids": (bool(self.requires_token_ids), "token ids in pooler outputs"),
            "skip_reading_prefix_cache": (
                self.skip_reading_prefix_cache is not None,
                "a per-request prefix-cache switch (--no-enable-prefix-caching turns it off)",
            ),
            "late_interaction_params": (
                self.late_interaction_params is not None,
                "vLLM's late-interaction query cache (LLM.score and /score run MaxSim whole)",
            ),
            "extra_kwargs": (bool(self.extra_kwargs), "extra pooler keyword arguments"),
            "output_kind": (
                self.output_kind is not None
                and getattr(self.output_kind, "name", self.output_kind) not in ("FINAL_ONLY", 2),
                "streamed pooling outputs (pooling is FINAL_ONLY)",
            ),
        }
        for name, (given, what) in refused.items():
            if given:
                raise ValueError(
                    f"PoolingParams.{name} is not supported here: tidepool has no {what}"
                )

    @property
    def all_parameters(self) -> list[str]:
        return ["dimensions", "use_activation"]

    def clone(self) -> PoolingParams:
        """A copy (vLLM's `clone`)."""
        return copy.deepcopy(self)

    def with_task(self, task: str) -> PoolingParams:
        return replace(self, task=task)


class RequestOutputKind(enum.Enum):
    """What a streamed generating request yields per step (vLLM's RequestOutputKind):
    CUMULATIVE the whole completion so far, DELTA only what is new, FINAL_ONLY the finished
    completion once. The offline LLM always returns final outputs."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


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
    """Keep only the last k prompt tokens (`truncation_side`)."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """AsyncLLMEngine.generate's stream: each step's completion so far (CUMULATIVE), the new
    part (DELTA) or the final output only (FINAL_ONLY); LLM.generate returns final outputs."""
    # vLLM's fields tidepool's sampler lacks: accepted at vLLM's defaults, refused otherwise.
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logit_bias: dict[int, float] | None = None
    structured_outputs: Any = None
    extra_args: dict[str, Any] | None = None
    logprob_token_ids: list[int] | None = None
    prompt_logprob_token_ids: list[int] | None = None
    prompt_logprob_start: int | None = None
    flat_logprobs: bool = False
    output_text_buffer_length: int = 0
    repetition_detection: Any = None
    thinking_token_budget: int | None = None
    watermarking: Any = None
    stream_interval: int | None = None
    skip_reading_prefix_cache: bool = False
    skip_clone: bool = False
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(getattr(self.output_kind, "value", -1))
            except ValueError:
                raise ValueError(
                    "output_kind must be a RequestOutputKind (CUMULATIVE, DELTA, FINAL_ONLY), "
                    f"got {self.output_kind!r}"
                ) from None
        self._refuse_vllm_only()
        self._check()

    def _refuse_vllm_only(self) -> None:
        """ValueError naming a vLLM field set to something tidepool's sampler does not do."""
        refused = {
            "prompt_logprobs": "prompt logprobs",
            "allowed_token_ids": "allowed-token masks",
            "bad_words": "bad-word masks",
            "logit_bias": "logit biases",
            "structured_outputs": "structured outputs",
            "extra_args": "sampler plugins (extra_args)",
            "logprob_token_ids": "logprobs of chosen token ids",
            "prompt_logprob_token_ids": "prompt logprobs",
            "prompt_logprob_start": "prompt logprobs",
            "flat_logprobs": "flat logprobs (logprobs are a list of dicts)",
            "output_text_buffer_length": "output text buffering",
            "repetition_detection": "repetition detection",
            "thinking_token_budget": "thinking budgets (no reasoning parsers)",
            "watermarking": "watermarking",
            "stream_interval": "stream intervals (a delta per step that adds text)",
            "skip_reading_prefix_cache": "a per-request prefix-cache switch",
            "routed_experts_prompt_start": "mixture-of-experts models",
            "trace_decode_token_ids": "decode tracing",
        }
        for name, what in refused.items():
            value = getattr(self, name)
            if value not in (None, False, 0, [], {}) and not (
                name == "stream_interval" and value == 1
            ):
                raise ValueError(
                    f"SamplingParams.{name}={value!r} is not supported here: tidepool's "
                    f"sampler has no {what}"
                )

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
    def truncation_side(self) -> Literal["left"]:
        """Which end `truncate_prompt_tokens` keeps, read as PoolingParams' field is (one rule,
        engine/truncation.py's `keep`): always the last tokens, as vLLM's SamplingParams."""
        return "left"

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
