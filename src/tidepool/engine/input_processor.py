"""Prompts → validated requests: tokenization (batched, fast tokenizer), pairs, truncation, checks.

A bad prompt never raises here: it becomes a `RequestError` for that prompt alone, so the rest of
a batch goes on. Every text passes `text_checks.unicode_problem` first; texts are tokenized by
`PrefixTokenizer`, which reads only as much of a text as the tokens it may keep (the rule is in
docs/server.md, "Text inputs"). Safe to call from several threads at once: nothing here changes
after construction but the request-id counter (itertools.count: atomic under the GIL).

truncate_prompt_tokens counts special tokens, as in vLLM and transformers: 8 on BERT keeps
[CLS] + 6 tokens of text + [SEP]. A value that leaves no token of text (1 or 2 on BERT, fewer than
5 for a pair) is refused; -1 means max_model_len. Token-id prompts get no special tokens added, so
there it is the number of ids kept. PoolingParams.truncation_side "left" keeps the last tokens
instead of the first (special tokens stay where they are): that needs the whole text read, so
such a text may have at most `read_limit(max_model_len)` characters.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tidepool.config import ModelConfig
from tidepool.engine.prefix_tokenizer import (
    CHARS_PER_TOKEN,
    FirstTokens,
    PrefixTokenizer,
    read_limit,
)
from tidepool.engine.text_checks import unicode_problem
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


@dataclass(frozen=True)
class _Budget:
    """How many tokens of text (special tokens excluded) one prompt may have."""

    num_tokens: int
    """Tokens of text the prompt may keep."""
    truncate: bool
    """A longer text is cut to `num_tokens` (truncate_prompt_tokens); else it is refused."""

    @property
    def num_wanted(self) -> int:
        """Tokens to read from the text: one more than it may keep tells that it is too long."""
        return max(self.num_tokens, 0) + (0 if self.truncate else 1)


def longest_first(num_first: int, num_second: int, budget: int) -> tuple[int, int]:
    """Tokens kept of each text of a pair: the tokenizers library's "longest_first" truncation
    (the longer text is cut first; when both are longer than half, the budget is split, the odd
    token to the longer one). One difference: when both texts are longer than the whole budget,
    the first keeps budget // 2 and the second the rest, whichever is longer: knowing which is
    would mean reading both texts whole."""
    if num_first + num_second <= budget:
        return num_first, num_second
    half = budget // 2
    if num_first > budget and num_second > budget:
        return half, budget - half
    if 2 * min(num_first, num_second) > budget:
        return (budget - half, half) if num_first > num_second else (half, budget - half)
    if num_first <= num_second:
        return num_first, budget - num_first
    return budget - num_second, num_second


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
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                f"{model_config.model}: tidepool needs a fast tokenizer (tokenizer.json); "
                f"{type(self.tokenizer).__name__} has none"
            )
        self._prefix_tokenizer = PrefixTokenizer(backend)
        self._num_special = self._prefix_tokenizer.num_special_tokens(pair=False)
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
            if problem := unicode_problem(prompt):
                return f"the prompt {problem}"
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
        """Token-id prompts: how many ids to keep (None: all)."""
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

    def _budget(self, params: PoolingParams, pair: bool) -> _Budget | str:
        """Text prompts: the tokens of text one prompt may keep, or why `params` cannot work."""
        num_special = self._num_special_pair if pair else self._num_special
        tpt = params.truncate_prompt_tokens
        if tpt is None:
            return _Budget(self.max_model_len - num_special, truncate=False)
        if tpt > self.max_model_len:
            return f"truncate_prompt_tokens={tpt} is larger than max_model_len={self.max_model_len}"
        total = self.max_model_len if tpt == -1 else tpt
        min_text = 2 if pair else 1
        if total - num_special < min_text:
            return (
                f"truncate_prompt_tokens={tpt} leaves no room for text: it counts the "
                f"{num_special} special tokens the model adds to each "
                f"{'pair' if pair else 'prompt'}, and at least one token of "
                f"{'each text' if pair else 'the text'} must stay, so it must be at least "
                f"{num_special + min_text} (or -1 for max_model_len)"
            )
        return _Budget(total - num_special, truncate=True)

    def _check_len(self, num_tokens: int) -> str | None:
        if num_tokens > self.max_model_len:
            return (
                f"the prompt has {num_tokens} tokens, more than the model's maximum of "
                f"{self.max_model_len} (max_model_len); shorten it or pass "
                "truncate_prompt_tokens to truncate"
            )
        return None

    def _too_long(self, what: str, num_tokens: int, num_chars_read: int, num_chars: int) -> str:
        # Only a prefix was read: the count is a lower bound.
        return (
            f"{what} is longer than {self.max_model_len} tokens, the model's maximum "
            f"(max_model_len): its first {num_chars_read:,} of {num_chars:,} characters already "
            f"give {num_tokens} tokens; shorten it or pass truncate_prompt_tokens to truncate"
        )

    @staticmethod
    def _too_sparse(what: str, first: FirstTokens, num_wanted: int, num_chars: int) -> str:
        return (
            f"{what} has {num_chars:,} characters and its first {first.num_chars_read:,} give "
            f"only {first.num_tokens} tokens; tidepool reads at most {CHARS_PER_TOKEN} "
            f"characters per token it needs ({num_wanted} here), so a text this sparse (long "
            "runs of whitespace or of characters without a break) must be shortened"
        )

    # ------------------------------------------------------------------ public

    def process(
        self, prompts: Sequence[Any], params: Sequence[PoolingParams]
    ) -> list[Request | RequestError]:
        """One request (or error) per prompt, in order. Texts are tokenized in batched calls."""
        results: list[Request | RequestError | None] = [None] * len(prompts)
        texts: list[tuple[int, str, _Budget]] = []
        for i, prompt in enumerate(prompts):
            p = self._parse(prompt)
            if isinstance(p, str):
                results[i] = RequestError(i, p)
            elif p.token_ids is not None:
                try:
                    max_len = self._truncation(params[i])
                except ValueError as e:
                    results[i] = RequestError(i, str(e))
                    continue
                ids = _keep(p.token_ids, max_len, params[i].truncation_side)
                results[i] = self._make(i, ids, None, params[i])
            elif isinstance(budget := self._budget(params[i], pair=False), str):
                results[i] = RequestError(i, budget)
            elif error := self._left_read_error(p.text, budget, params[i]):  # type: ignore[arg-type]
                results[i] = RequestError(i, error)
            else:
                texts.append((i, p.text, budget))  # type: ignore[arg-type]
        firsts = self._prefix_tokenizer.first_tokens(
            [text for _, text, _ in texts],
            [self._num_to_read(text, b, params[i]) for i, text, b in texts],
            self._prepare_text,
        )
        for (i, text, budget), first in zip(texts, firsts, strict=True):
            results[i] = self._finish_text(i, text, first, budget, params[i])
        return results  # type: ignore[return-value]

    def _finish_text(
        self, index: int, text: str, first: FirstTokens, budget: _Budget, params: PoolingParams
    ) -> Request | RequestError:
        if not first.complete:
            if first.num_tokens < budget.num_wanted:
                return RequestError(
                    index, self._too_sparse("the prompt", first, budget.num_wanted, len(text))
                )
            if not budget.truncate:
                num_tokens = first.num_tokens + self._num_special
                message = self._too_long("the prompt", num_tokens, first.num_chars_read, len(text))
                return RequestError(index, message)
        num_kept = budget.num_tokens if budget.truncate else None
        ids = _keep(first.token_ids, num_kept, params.truncation_side)
        ids, types = self._prefix_tokenizer.with_special_tokens(ids)
        return self._make(index, ids, types if self.keep_token_types else None, params)

    def process_pairs(
        self, pairs: Sequence[tuple[Any, Any]], params: Sequence[PoolingParams]
    ) -> list[Request | RequestError]:
        """Cross-encoder inputs: (query, document) text pairs, encoded together with token types."""
        results: list[Request | RequestError | None] = [None] * len(pairs)
        ok: list[tuple[int, _Budget]] = []
        for i, (first, second) in enumerate(pairs):
            errors = [
                msg
                for side, value in (("first", first), ("second", second))
                if (msg := self._pair_side_error(side, value))
            ]
            if errors:
                results[i] = RequestError(i, "; ".join(errors))
            elif isinstance(budget := self._budget(params[i], pair=True), str):
                results[i] = RequestError(i, budget)
            elif errors := [
                msg for text in pairs[i] if (msg := self._left_read_error(text, budget, params[i]))
            ]:
                results[i] = RequestError(i, errors[0])
            else:
                ok.append((i, budget))
        # Both modes read one token more than the budget of each side: enough to know whether a
        # side is longer than the budget, which is all that longest_first needs (the whole side
        # when the last tokens are kept).
        sides = self._prefix_tokenizer.first_tokens(
            [pairs[i][side] for side in (0, 1) for i, _ in ok],
            [
                len(pairs[i][side]) if _keeps_last(b, params[i]) else b.num_tokens + 1
                for side in (0, 1)
                for i, b in ok
            ],
            self._prepare_text,
        )
        for k, (i, budget) in enumerate(ok):
            both = (sides[k], sides[len(ok) + k])
            results[i] = self._finish_pair(i, pairs[i], both, budget, params[i])
        return results  # type: ignore[return-value]

    def _finish_pair(
        self,
        index: int,
        texts: tuple[str, str],
        sides: tuple[FirstTokens, FirstTokens],
        budget: _Budget,
        params: PoolingParams,
    ) -> Request | RequestError:
        first, second = sides
        wanted = budget.num_tokens + 1
        sparse = [
            self._too_sparse(f"the {name} text of the pair", side, wanted, len(text))
            for name, side, text in zip(("first", "second"), sides, texts, strict=True)
            if not side.complete and side.num_tokens < wanted
        ]
        if sparse:
            return RequestError(index, "; ".join(sparse))
        if budget.truncate:
            keep_first, keep_second = longest_first(
                first.num_tokens, second.num_tokens, budget.num_tokens
            )
            first_ids = _keep(first.token_ids, keep_first, params.truncation_side)
            second_ids = _keep(second.token_ids, keep_second, params.truncation_side)
        elif not (first.complete and second.complete):  # a side over the budget: too long
            return RequestError(
                index,
                self._too_long(
                    "the pair",
                    first.num_tokens + second.num_tokens + self._num_special_pair,
                    first.num_chars_read + second.num_chars_read,
                    len(texts[0]) + len(texts[1]),
                ),
            )
        else:
            first_ids, second_ids = first.token_ids, second.token_ids
        ids, types = self._prefix_tokenizer.with_special_tokens(first_ids, second_ids)
        return self._make(index, ids, types if self.keep_token_types else None, params)

    @staticmethod
    def _num_to_read(text: str, budget: _Budget, params: PoolingParams) -> int:
        """Tokens to read from a text: keeping the last ones needs them all (wanting as many
        tokens as characters makes the read limit cover the whole text)."""
        return len(text) if _keeps_last(budget, params) else budget.num_wanted

    def _left_read_error(self, text: str, budget: _Budget, params: PoolingParams) -> str | None:
        limit = read_limit(self.max_model_len)
        if _keeps_last(budget, params) and len(text) > limit:
            return (
                f"the text has {len(text):,} characters; truncation from the left keeps the last "
                "tokens, which needs the whole text read, and tidepool reads at most "
                f"{limit:,} ({CHARS_PER_TOKEN} per token of max_model_len): shorten it"
            )
        return None

    @property
    def _num_special_pair(self) -> int:
        return self._prefix_tokenizer.num_special_tokens(pair=True)

    def _pair_side_error(self, side: str, value: Any) -> str | None:
        if not isinstance(value, str):
            return f"the {side} text of the pair has type {_describe(value)}; expected a string"
        if value == "":
            return f"the {side} text of the pair is an empty string"
        if problem := unicode_problem(value):
            return f"the {side} text of the pair {problem}"
        return None

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
        prompt, no lower-casing), in batched calls; truncation keeps the last tokens (vLLM)."""
        results: list[Request | RequestError | None] = [None] * len(prompts)
        token_ids: list[list[int] | None] = [None] * len(prompts)
        texts: list[tuple[int, str]] = []
        for i, prompt in enumerate(prompts):
            p = self._parse(prompt)
            if isinstance(p, str):
                results[i] = RequestError(i, p)
            elif p.token_ids is not None:
                token_ids[i] = p.token_ids
            else:
                texts.append((i, p.text))  # type: ignore[arg-type]
        keeps_last = [params[i].truncate_prompt_tokens is not None for i, _ in texts]
        encoded = self._tokenize_generate([t for _, t in texts], keeps_last, add_special_tokens)
        for (i, _), ids_or_error in zip(texts, encoded, strict=True):
            if isinstance(ids_or_error, str):
                results[i] = RequestError(i, ids_or_error)
            else:
                token_ids[i] = ids_or_error
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

    def _tokenize_generate(
        self, texts: list[str], keeps_last: list[bool], add_special_tokens: bool
    ) -> list[list[int] | str]:
        """Token ids (special tokens included) of each text, or why it is refused. Without
        truncation, a prefix one token over the limit refuses a text; keeping the last tokens
        needs the whole text, so its length is capped by the read limit instead."""
        num_special = self._prefix_tokenizer.num_special_tokens(False, add_special_tokens)
        num_wanted = max(self.max_model_len - num_special, 0) + 1
        limit = read_limit(self.max_model_len)
        out: list[list[int] | str] = []
        readable = [k for k, text in enumerate(texts) if not (keeps_last[k] and len(text) > limit)]
        firsts = self._prefix_tokenizer.first_tokens(
            [texts[k] for k in readable],
            # Wanting as many tokens as characters makes the read limit cover the whole text.
            [len(texts[k]) if keeps_last[k] else num_wanted for k in readable],
        )
        by_index = dict(zip(readable, firsts, strict=True))
        for k, text in enumerate(texts):
            first = by_index.get(k)
            if first is None:
                out.append(
                    f"the prompt has {len(text):,} characters; truncate_prompt_tokens keeps the "
                    "last tokens, which needs the whole text read, and tidepool reads at most "
                    f"{limit:,} ({CHARS_PER_TOKEN} per token of max_model_len): shorten it"
                )
            elif not first.complete:
                out.append(
                    self._too_sparse("the prompt", first, num_wanted, len(text))
                    if first.num_tokens < num_wanted
                    else self._too_long(
                        "the prompt",
                        first.num_tokens + num_special,
                        first.num_chars_read,
                        len(text),
                    )
                )
            else:
                ids, _ = self._prefix_tokenizer.with_special_tokens(
                    first.token_ids, None, add_special_tokens
                )
                out.append(ids)
        return out


def _keeps_last(budget: _Budget, params: PoolingParams) -> bool:
    return budget.truncate and params.truncation_side == "left"


def _keep(token_ids: list[int], num_tokens: int | None, side: str) -> list[int]:
    """The first `num_tokens` ids ("right": the end is cut), or the last ("left"); None = all."""
    if num_tokens is None:
        return token_ids
    if side == "left":
        return token_ids[max(len(token_ids) - num_tokens, 0) :]
    return token_ids[:num_tokens]


def eos_token_ids(model_config: ModelConfig, tokenizer: Any) -> tuple[int, ...]:
    """Where generation stops: generation_config.json's EOS ids, then the tokenizer's if it is not
    among them."""
    ids = list(model_config.eos_token_ids)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    if tokenizer_eos is not None and tokenizer_eos not in ids:
        ids.append(int(tokenizer_eos))
    return tuple(ids)
