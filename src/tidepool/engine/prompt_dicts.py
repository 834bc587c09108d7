"""The keys of a dict prompt, checked against vLLM 0.32's prompt schemas (vllm/inputs):

    TextPrompt      prompt
    TokensPrompt    prompt_token_ids, prompt (the text of the ids, informative), token_type_ids
    EmbedsPrompt    prompt_embeds, prompt
    both / all      multi_modal_data, mm_processor_kwargs, multi_modal_uuids, cache_salt
    explicit enc-dec   encoder_prompt, decoder_prompt
    DataPrompt      data, data_format (IO processor plugins)

tidepool reads `prompt` and `prompt_token_ids`. Every other key is refused with a message naming
it, never dropped: a dropped `multi_modal_data` would answer with the text-only embedding, a typo
(`prompt_token_id`) with the embedding of something else. A vLLM key whose value is None means the
same as the key left out (vLLM's schemas allow None for the multi-modal options), so it passes.
"""

from __future__ import annotations

import difflib
from typing import Any

READ_KEYS = ("prompt", "prompt_token_ids")
"""The keys tidepool reads."""

_MULTI_MODAL = (
    "images, audio and video are not supported yet: tidepool takes text and token ids only"
)
_NOT_SUPPORTED = {
    "multi_modal_data": f"multi_modal_data: {_MULTI_MODAL}",
    "mm_processor_kwargs": f"mm_processor_kwargs applies to multi_modal_data; {_MULTI_MODAL}",
    "multi_modal_uuids": f"multi_modal_uuids applies to multi_modal_data; {_MULTI_MODAL}",
    "cache_salt": "cache_salt is not supported: tidepool's prefix cache has no per-request salt",
    "token_type_ids": (
        "token_type_ids in a prompt dict is not supported: give a cross-encoder's two texts to "
        "score() and the tokenizer writes them"
    ),
    "prompt_embeds": (
        "prompt_embeds (an EmbedsPrompt) is not supported: give 'prompt' or 'prompt_token_ids'"
    ),
    "encoder_prompt": "explicit encoder / decoder prompts are not supported",
    "decoder_prompt": "explicit encoder / decoder prompts are not supported",
    "data": "'data' / 'data_format' prompts (IO processor plugins) are not supported",
    "data_format": "'data' / 'data_format' prompts (IO processor plugins) are not supported",
}
"""vLLM's other keys, and why each is refused."""

KNOWN_KEYS = READ_KEYS + tuple(_NOT_SUPPORTED)


def prompt_dict_problem(prompt: dict[Any, Any]) -> str | None:
    """Why tidepool cannot read this dict prompt as it is meant, or None."""
    unknown = [key for key in prompt if key not in KNOWN_KEYS]
    if unknown:
        return _unknown_keys_message(unknown)
    refused = {
        _NOT_SUPPORTED[key]: None
        for key, value in prompt.items()
        if key in _NOT_SUPPORTED and value is not None
    }
    return "; ".join(refused) if refused else None


def _unknown_keys_message(unknown: list[Any]) -> str:
    names = ", ".join(repr(key) for key in unknown)
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), KNOWN_KEYS, n=1, cutoff=0.75)
        if close:
            hints.append(f"{key!r}: did you mean {close[0]!r}?")
    hint = f" ({'; '.join(hints)})" if hints else ""
    return (
        f"unknown key{'s' if len(unknown) > 1 else ''} {names} in the prompt dict{hint}; a dict "
        "prompt takes 'prompt' (a string) or 'prompt_token_ids' (a list of ints), as vLLM's "
        "TextPrompt / TokensPrompt"
    )
