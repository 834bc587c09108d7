"""Prompt types with vLLM's names (`vllm.inputs`): a prompt is a string, a `TextPrompt` or a
`TokensPrompt` (plain dicts, as in vLLM)."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    """A text prompt: {"prompt": "..."}."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt given as token ids: {"prompt_token_ids": [...]} (tokenized by the caller:
    special tokens included as given; no model prompt is put before it)."""

    prompt_token_ids: list[int]


SingletonPrompt = str | TextPrompt | TokensPrompt
PromptType = SingletonPrompt

__all__ = ["PromptType", "SingletonPrompt", "TextPrompt", "TokensPrompt"]
