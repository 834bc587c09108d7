"""vLLM 0.32's fields of every pooling request and of its chat form (`messages`), as mixins of
protocol.py's requests; serving_vllm.py honours or refuses each."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

Int = StrictInt
Bool = StrictBool
Str = StrictStr


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class PoolingFields(_Base):
    """vLLM's fields of every pooling request, each honoured or refused (serving_vllm.py)."""

    use_activation: Bool | None = None
    """Embeddings: L2-normalize; classify / score: softmax or sigmoid. None = the default."""
    truncation_side: Literal["left", "right"] | None = None
    """Which end truncate_prompt_tokens keeps: "right" the first tokens, "left" the last."""
    request_id: Str | None = None
    """Echoed in the response's `id`."""
    priority: Int = 0
    """Refused unless 0 (requests are served first come, first served)."""
    padding: Literal["max_length", "do_not_pad"] | None = None
    """"do_not_pad" is what runs; "max_length" is refused."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """Refused (text models only)."""
    cache_salt: Str | None = None
    """Refused (no per-request prefix-cache salting)."""

    @field_validator("request_id")
    @classmethod
    def _encodable(cls, value: str | None) -> str | None:
        """Echoed in the answer, so it must encode as UTF-8 (a lone surrogate would not)."""
        if value is not None:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"is not valid Unicode: a lone surrogate (\\u{ord(value[e.start]):04x}) at "
                    f"character {e.start}"
                ) from None
        return value


class ScoringFields(_Base):
    """vLLM 0.32's fields of /score and /rerank (its ScoringRequestMixin), each honoured or
    refused (serving_vllm.py)."""

    max_tokens_per_query: Int = 0
    """Each query cut to its first N tokens before pairing (0: not cut), as vLLM cuts it."""
    max_tokens_per_doc: Int = 0
    """Each document cut to its first N tokens before pairing (0: not cut)."""
    instruction: Str | None = None
    """vLLM: folded into chat_template_kwargs for a score chat template. Refused here when set:
    the score template's instruction is fixed at start (--score-instruction)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Refused when not empty (score templates take no per-request keywords here)."""
    user: Str | None = None
    """OpenAI's end-user id: accepted with no effect, as in vLLM."""


class TokenizeChatFields(_Base):
    """/tokenize with `messages` (vLLM's TokenizeChatRequest)."""

    chat_template: Str | None = None
    """Replaces the tokenizer's template (needs --trust-request-chat-template)."""
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    tools: list[Any] | None = None
    """Refused when not empty (no tool calling)."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """Refused (text models only)."""
    media_io_kwargs: dict[str, Any] | None = None
    """Refused (text models only)."""


class PromptTokenUsageInfo(_Base):
    """Generation usage's prompt_tokens_details (--enable-prompt-tokens-details)."""

    cached_tokens: int | None = None
    """Prompt tokens read from the prefix cache (block-aligned)."""


class ChatFields(_Base):
    """`messages` instead of `input` (vLLM's chat form of a pooling request): rendered with the
    model's chat template into one prompt."""

    messages: list[dict[str, Any]] | None = None
    chat_template: Str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: Bool = False
    continue_final_message: Bool = False
    add_special_tokens: Bool | None = None
    """None: True for `input`, False for `messages` (the template writes them), as vLLM."""
    media_io_kwargs: dict[str, Any] | None = None
    """Refused (text models only)."""

    @model_validator(mode="before")
    @classmethod
    def _messages_stand_for_input(cls, data: Any) -> Any:
        """`input` is required unless `messages` is given (vLLM's two request forms)."""
        if isinstance(data, dict) and "messages" in data and "input" not in data:
            data = {**data, "input": None}
        return data
