"""The keys of a dict prompt, checked against vLLM 0.32's prompt schemas (vllm/inputs):

    TextPrompt      prompt
    TokensPrompt    prompt_token_ids, prompt (the text of the ids, informative), token_type_ids
    EmbedsPrompt    prompt_embeds, prompt
    both / all      multi_modal_data, mm_processor_kwargs, multi_modal_uuids, cache_salt
    explicit enc-dec   encoder_prompt, decoder_prompt
    DataPrompt      data, data_format (IO processor plugins)

tidepool reads `prompt` and `prompt_token_ids`, and `multi_modal_data` where the model takes
images (multimodal/processing.py: the model has an image prompt processor). Every other key is
refused with a message naming it, never dropped: a dropped `multi_modal_data` would answer with
the text-only embedding, a typo (`prompt_token_id`) with the embedding of something else. A vLLM
key whose value is None means the same as the key left out (vLLM's schemas allow None for the
multi-modal options), so it passes.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from tidepool.engine.text_checks import unicode_problem
from tidepool.multimodal.processing import check_multi_modal_data

READ_KEYS = ("prompt", "prompt_token_ids")
"""The keys tidepool reads (and multi_modal_data, for a model that takes images)."""

PROMPT_TYPES_HINT = (
    "a string, or a dict with 'prompt' (string) or 'prompt_token_ids' (list of ints)"
)

_MULTI_MODAL = "this model takes text and token ids only (no images, audio or video)"
_NOT_SUPPORTED = {
    "multi_modal_data": f"multi_modal_data: {_MULTI_MODAL}",
    "mm_processor_kwargs": (
        "mm_processor_kwargs is not supported: tidepool runs the model's processor with the "
        "settings saved in its folder"
    ),
    "multi_modal_uuids": (
        "multi_modal_uuids is not supported: tidepool keys each image by a hash of its pixels"
    ),
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


def prompt_dict_problem(prompt: dict[Any, Any], modalities: tuple[str, ...] = ()) -> str | None:
    """Why tidepool cannot read this dict prompt as it is meant, or None. `modalities`: what
    the model's multi_modal_data may hold (() for a text-only model, which refuses the key)."""
    unknown = [key for key in prompt if key not in KNOWN_KEYS]
    if unknown:
        return _unknown_keys_message(unknown)
    refused = {
        _NOT_SUPPORTED[key]: None
        for key, value in prompt.items()
        if key in _NOT_SUPPORTED
        and value is not None
        and not (key == "multi_modal_data" and modalities)
    }
    return "; ".join(refused) if refused else None


@dataclass
class ParsedPrompt:
    text: str | None = None
    token_ids: list[int] | None = None
    mm_data: dict[str, list[Any]] = field(default_factory=dict)
    """modality → items (PIL images), from multi_modal_data; empty for a text prompt."""


def describe(value: Any) -> str:
    return "None" if value is None else type(value).__name__


def parse_prompt(
    prompt: Any, vocab_size: int, modalities: tuple[str, ...] = ()
) -> ParsedPrompt | str:
    """A prompt (string or vLLM dict) → text, token ids and images; a string is the error."""
    if isinstance(prompt, dict):
        if problem := prompt_dict_problem(
            prompt, modalities
        ):  # a key it cannot read is never dropped
            return problem
        mm_data: dict[str, list[Any]] = {}
        if prompt.get("multi_modal_data") is not None:
            checked = check_multi_modal_data(prompt["multi_modal_data"], modalities)
            if isinstance(checked, str):
                return checked
            mm_data = checked
        if "prompt_token_ids" in prompt:
            if mm_data:
                return "multi_modal_data needs a text 'prompt' (the processor places the images)"
            return _parse_token_ids(prompt["prompt_token_ids"], vocab_size)
        if "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                return f"'prompt' must be a string, got {describe(text)}"
            if mm_data:  # "" is the image-only prompt of CLIP / SigLIP
                problem = unicode_problem(text) if text else None
                return f"the prompt {problem}" if problem else ParsedPrompt(text, None, mm_data)
            return parse_prompt(text, vocab_size)
        return f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}"
    if isinstance(prompt, str):
        if prompt == "":
            return "the prompt is an empty string"
        if problem := unicode_problem(prompt):
            return f"the prompt {problem}"
        return ParsedPrompt(text=prompt)
    return f"the prompt has type {describe(prompt)}; expected {PROMPT_TYPES_HINT}"


def _parse_token_ids(ids: Any, vocab_size: int) -> ParsedPrompt | str:
    if not isinstance(ids, (list, tuple)):
        return f"'prompt_token_ids' must be a list of ints, got {describe(ids)}"
    if not ids:
        return "'prompt_token_ids' is empty"
    for tok in ids:
        if isinstance(tok, bool) or not isinstance(tok, int):
            return f"'prompt_token_ids' must hold ints, found {describe(tok)}"
        if tok < 0 or (vocab_size and tok >= vocab_size):
            return f"token id {tok} is outside the vocabulary [0, {vocab_size})"
    return ParsedPrompt(token_ids=list(ids))


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
