"""The offline LLM's argument checks: prompts as a list, vLLM arguments with no effect here
(lora_request, score's chat_template), score's tokenization_kwargs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tidepool.engine.tokenization_kwargs import tokenization_options
from tidepool.params import PoolingParams

PromptsArg = Any  # str | dict | Sequence[str | dict]
ScoreInputs = Any
"""score()'s sides: a string, a prompt dict, a {"content": [parts]} item, or a list of them."""


def _as_list(prompts: PromptsArg, what: str = "prompts") -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError(f"{what} is empty: give at least one prompt")
        return list(prompts)
    raise TypeError(
        f"{what} must be a string, a dict prompt or a list of them, got {type(prompts).__name__}"
    )


def _no_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise ValueError("lora_request is not supported here: tidepool has no LoRA adapters")


def check_score_chat_template(chat_template: str | None) -> None:
    """score(chat_template=...): vLLM renders an LLM reranker's pairs with it. Here the pair
    prompt is the model's score template (score_template=..., engine/score_template.py)."""
    if chat_template is not None:
        raise ValueError(
            "score(chat_template=...) is not supported here: give the pair prompt as "
            "LLM(..., score_template=...) (a template with {query} and {document})"
        )


def score_tokenization(
    tokenization_kwargs: dict[str, Any] | None,
    truncate_prompt_tokens: int | None,
    pooling_params: PoolingParams | None,
) -> tuple[int | None, PoolingParams | None]:
    """score()'s truncation from its tokenization_kwargs (pairs keep their special tokens)."""
    options = tokenization_options(tokenization_kwargs, truncate_prompt_tokens)
    if not options.add_special_tokens:
        raise ValueError("score() needs special tokens (the pair is joined by them)")
    if options.truncation_side is not None:
        base = pooling_params or PoolingParams()
        pooling_params = replace(base, truncation_side=options.truncation_side)
    return options.truncate_prompt_tokens, pooling_params
