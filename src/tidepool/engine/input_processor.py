"""Prompts → validated requests: tokenization (batched, fast tokenizer), pairs, truncation, checks.

A bad prompt never raises here: it becomes a `RequestError` for that prompt alone, so the rest of
a batch goes on.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tidepool.config import ModelConfig
from tidepool.outputs import RequestError
from tidepool.params import PoolingParams, SamplingParams
from tidepool.request import Request

PROMPT_TYPES_HINT = (
    "a string, or a dict with 'prompt' (string) or 'prompt_token_ids' (list of ints)"
)


@dataclass
class _Parsed:
    text: str | None = None
    token_ids: list[int] | None = None


def _describe(value: Any) -> str:
    return "None" if value is None else type(value).__name__


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer=None) -> None:
        from transformers import AutoTokenizer

        self.model_config = model_config
        self.max_model_len = model_config.max_model_len
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model_config.path))
        # We check lengths ourselves; stop transformers warning about long inputs.
        self.tokenizer.model_max_length = 1 << 30
        self.vocab_size = int(getattr(model_config.hf_config, "vocab_size", 0) or 0)
        self.keep_token_types = model_config.uses_token_type_ids
        st = model_config.st
        self.lower_case = st.do_lower_case
        self.default_prompt = st.prompts.get(st.default_prompt_name or "", "")
        self._ids = itertools.count()

    def next_request_id(self) -> str:
        return str(next(self._ids))

    # ------------------------------------------------------------------ parsing

    def _parse(self, prompt: Any) -> _Parsed | str:
        """A prompt → text or token ids; a string is the error message."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return self._parse_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return (
                    self._parse(prompt["prompt"])
                    if isinstance(prompt["prompt"], str)
                    else (f"'prompt' must be a string, got {_describe(prompt['prompt'])}")
                )
            return f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}"
        if isinstance(prompt, str):
            if prompt == "":
                return "the prompt is an empty string"
            return _Parsed(text=prompt)
        return f"the prompt has type {_describe(prompt)}; expected {PROMPT_TYPES_HINT}"

    def _parse_token_ids(self, ids: Any) -> _Parsed | str:
        if not isinstance(ids, (list, tuple)):
            return f"'prompt_token_ids' must be a list of ints, got {_describe(ids)}"
        if not ids:
            return "'prompt_token_ids' is empty"
        for tok in ids:
            if isinstance(tok, bool) or not isinstance(tok, int):
                return f"'prompt_token_ids' must hold ints, found {_describe(tok)}"
            if tok < 0 or (self.vocab_size and tok >= self.vocab_size):
                return f"token id {tok} is outside the vocabulary [0, {self.vocab_size})"
        return _Parsed(token_ids=list(ids))

    def _prepare_text(self, text: str) -> str:
        text = self.default_prompt + text
        return text.lower() if self.lower_case else text

    def _truncation(self, params: PoolingParams) -> int | None:
        tpt = params.truncate_prompt_tokens
        if tpt is None:
            return None
        if tpt == -1:
            return self.max_model_len
        if tpt > self.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens={tpt} is larger than max_model_len={self.max_model_len}"
            )
        return tpt

    def _check_len(self, num_tokens: int) -> str | None:
        if num_tokens > self.max_model_len:
            return (
                f"the prompt has {num_tokens} tokens, more than the model's maximum of "
                f"{self.max_model_len} (max_model_len); shorten it or pass "
                "truncate_prompt_tokens to truncate"
            )
        return None

    # ------------------------------------------------------------------ public

    def process(
        self, prompts: Sequence[Any], params: Sequence[PoolingParams]
    ) -> list[Request | RequestError]:
        """One request (or error) per prompt, in order. Texts are tokenized in one batched call."""
        results: list[Request | RequestError | None] = [None] * len(prompts)
        texts: dict[int | None, list[int]] = {}  # truncation length → prompt indices
        parsed: list[_Parsed | None] = [None] * len(prompts)
        for i, prompt in enumerate(prompts):
            p = self._parse(prompt)
            if isinstance(p, str):
                results[i] = RequestError(i, p)
                continue
            parsed[i] = p
            try:
                max_len = self._truncation(params[i])
            except ValueError as e:
                results[i] = RequestError(i, str(e))
                continue
            if p.token_ids is not None:
                ids = p.token_ids if max_len is None else p.token_ids[:max_len]
                results[i] = self._make(i, ids, None, params[i])
            else:
                texts.setdefault(max_len, []).append(i)
        for max_len, indices in texts.items():
            batch = [self._prepare_text(parsed[i].text) for i in indices]  # type: ignore[union-attr, arg-type]
            enc = self._tokenize(batch, None, max_len)
            for j, i in enumerate(indices):
                types = enc["token_type_ids"][j] if "token_type_ids" in enc else None
                results[i] = self._make(i, enc["input_ids"][j], types, params[i])
        return results  # type: ignore[return-value]

    def process_pairs(
        self, pairs: Sequence[tuple[Any, Any]], params: Sequence[PoolingParams]
    ) -> list[Request | RequestError]:
        """Cross-encoder inputs: (query, document) text pairs, encoded together with token types."""
        results: list[Request | RequestError | None] = [None] * len(pairs)
        groups: dict[int | None, list[int]] = {}
        for i, (first, second) in enumerate(pairs):
            errors = [
                msg
                for side, value in (("first", first), ("second", second))
                if (msg := self._pair_side_error(side, value))
            ]
            if errors:
                results[i] = RequestError(i, "; ".join(errors))
                continue
            try:
                groups.setdefault(self._truncation(params[i]), []).append(i)
            except ValueError as e:
                results[i] = RequestError(i, str(e))
        for max_len, indices in groups.items():
            firsts = [self._prepare_text(pairs[i][0]) for i in indices]
            seconds = [self._prepare_text(pairs[i][1]) for i in indices]
            enc = self._tokenize(firsts, seconds, max_len)
            for j, i in enumerate(indices):
                types = enc["token_type_ids"][j] if "token_type_ids" in enc else None
                results[i] = self._make(i, enc["input_ids"][j], types, params[i])
        return results  # type: ignore[return-value]

    def _pair_side_error(self, side: str, value: Any) -> str | None:
        if not isinstance(value, str):
            return f"the {side} text of the pair has type {_describe(value)}; expected a string"
        if value == "":
            return f"the {side} text of the pair is an empty string"
        return None

    def _tokenize(self, first: list[str], second: list[str] | None, max_len: int | None):
        kwargs: dict[str, Any] = {"return_attention_mask": False}
        kwargs["return_token_type_ids"] = self.keep_token_types
        if max_len is not None:
            kwargs.update(truncation=True, max_length=max_len)
        if second is None:
            return self.tokenizer(first, **kwargs)
        return self.tokenizer(first, second, **kwargs)

    def _make(
        self,
        index: int,
        ids: list[int],
        token_types: list[int] | None,
        params: PoolingParams,
    ) -> Request | RequestError:
        if error := self._check_len(len(ids)):
            return RequestError(index, error)
        if token_types is not None and not any(token_types):
            token_types = None
        return Request(
            request_id=self.next_request_id(),
            prompt_token_ids=list(ids),
            pooling_params=params,
            token_type_ids=None if token_types is None else list(token_types),
        )

    # ------------------------------------------------------------------ generation

    def process_generate(
        self,
        prompts: Sequence[Any],
        params: Sequence[SamplingParams],
        eos_token_ids: tuple[int, ...],
        add_special_tokens: bool = True,
    ) -> list[Request | RequestError]:
        """Generating requests, one per prompt. Texts are tokenized as-is (no sentence-transformers
        prompt, no lower-casing), in one batched call; truncation keeps the last tokens (vLLM)."""
        results: list[Request | RequestError | None] = [None] * len(prompts)
        token_ids: list[list[int] | None] = [None] * len(prompts)
        texts: list[int] = []
        for i, prompt in enumerate(prompts):
            p = self._parse(prompt)
            if isinstance(p, str):
                results[i] = RequestError(i, p)
            elif p.token_ids is not None:
                token_ids[i] = p.token_ids
            else:
                texts.append(i)
        if texts:
            enc = self.tokenizer(
                [
                    prompts[i] if isinstance(prompts[i], str) else prompts[i]["prompt"]
                    for i in texts
                ],
                add_special_tokens=add_special_tokens,
                return_attention_mask=False,
                return_token_type_ids=False,
            )
            for j, i in enumerate(texts):
                token_ids[i] = list(enc["input_ids"][j])
        for i, ids in enumerate(token_ids):
            if ids is None:
                continue
            keep = params[i].truncate_prompt_tokens
            if keep is not None:
                ids = ids[-keep:]
            if not ids:
                results[i] = RequestError(i, "the prompt has no tokens")
            elif error := self._check_len(len(ids)):
                results[i] = RequestError(i, error)
            else:
                results[i] = Request(
                    request_id=self.next_request_id(),
                    prompt_token_ids=ids,
                    sampling_params=params[i],
                    eos_token_ids=eos_token_ids,
                )
        return results  # type: ignore[return-value]


def eos_token_ids(model_config: ModelConfig, tokenizer: Any) -> tuple[int, ...]:
    """Where generation stops: generation_config.json's EOS ids, then the tokenizer's if it is not
    among them."""
    ids = list(model_config.eos_token_ids)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    if tokenizer_eos is not None and tokenizer_eos not in ids:
        ids.append(int(tokenizer_eos))
    return tuple(ids)
