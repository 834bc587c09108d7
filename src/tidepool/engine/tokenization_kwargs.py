"""vLLM's `tokenization_kwargs` (LLM.embed / encode / classify / score) and the HTTP fields of the
same meaning (`truncation_side`, `add_special_tokens`), as tidepool's request options.

Honoured: `truncation` (True: cut at max_model_len; False: no cutting), `max_length` (cut at N
tokens, special tokens included: truncate_prompt_tokens), `truncation_side` ("left" keeps the
last tokens), `add_special_tokens` (False: the texts are tokenized without [CLS] / [SEP] / BOS
and run as token ids), `padding` other than "max_length" (every sequence is attended to without
padding: the outputs are the same). Any other key is refused, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_PADDING_NO_EFFECT = (False, None, True, "longest", "do_not_pad")


@dataclass(frozen=True)
class TokenizationOptions:
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    add_special_tokens: bool = True


def tokenization_options(
    kwargs: dict[str, Any] | None, truncate_prompt_tokens: int | None = None
) -> TokenizationOptions:
    """The options of `tokenization_kwargs` (and the call's `truncate_prompt_tokens`, which a
    kwargs' `max_length` may not contradict). ValueError naming an unsupported key or value."""
    kwargs = dict(kwargs or {})
    unknown = sorted(
        set(kwargs)
        - {"truncation", "max_length", "truncation_side", "add_special_tokens", "padding"}
    )
    if unknown:
        raise ValueError(
            f"tokenization_kwargs {unknown} are not supported here: tidepool honours truncation, "
            "max_length, truncation_side, add_special_tokens and padding"
        )
    padding = kwargs.get("padding")
    if padding not in _PADDING_NO_EFFECT:
        raise ValueError(
            f"tokenization_kwargs padding={padding!r} is not supported: sequences run unpadded "
            "(padding to max_length would change mean-pooled outputs)"
        )
    tpt = truncate_prompt_tokens
    truncation = kwargs.get("truncation")
    max_length = kwargs.get("max_length")
    if max_length is not None:
        if truncation is False:
            raise ValueError("tokenization_kwargs max_length needs truncation (not False)")
        if tpt is not None and tpt != max_length:
            raise ValueError(
                f"truncate_prompt_tokens={tpt} and tokenization_kwargs max_length={max_length} "
                "disagree: give one"
            )
        tpt = max_length
    elif truncation is True and tpt is None:
        tpt = -1
    elif truncation is False and tpt is not None:
        raise ValueError("tokenization_kwargs truncation=False contradicts truncate_prompt_tokens")
    side = kwargs.get("truncation_side")
    if side not in (None, "left", "right"):
        raise ValueError(f"tokenization_kwargs truncation_side must be left or right, got {side!r}")
    special = kwargs.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise ValueError(f"tokenization_kwargs add_special_tokens must be a bool, got {special!r}")
    return TokenizationOptions(tpt, side, special)


def without_special_tokens(
    tokenizer: Any, texts: list[Any], prefix: str, lower_case: bool
) -> list[Any]:
    """Text prompts tokenized without special tokens, as token-id prompts (`add_special_tokens`
    False); token-id prompts are kept. `prefix`: the model's prompt put before each text."""
    out = []
    for text in texts:
        if isinstance(text, dict) and "prompt" in text and "prompt_token_ids" not in text:
            text = text["prompt"]
        if not isinstance(text, str):
            out.append(text)
            continue
        text = prefix + text
        if lower_case:
            text = text.lower()
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append({"prompt_token_ids": list(ids)})
    return out
