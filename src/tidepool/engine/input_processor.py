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
from typing import Any

from tidepool.checkpoint.siglip_tokenizer import load_tokenizer
from tidepool.config import ModelConfig
from tidepool.engine.chunked import ChunkedInput, LongInputSplitter
from tidepool.engine.generate_inputs import tokenize_generate
from tidepool.engine.multi_vector import MultiVectorInputs
from tidepool.engine.prefix_tokenizer import (
    CHARS_PER_TOKEN,
    FirstTokens,
    PrefixTokenizer,
    read_limit,
)
from tidepool.engine.prompt_dicts import ParsedPrompt, describe, parse_prompt
from tidepool.engine.prompts import check_prompt_name, is_query, prompt_text
from tidepool.engine.score_template import ScoreTemplate, render_pairs
from tidepool.engine.text_checks import unicode_problem
from tidepool.engine.truncation import (
    Budget,
    keep,
    keeps_last,
    longest_first,
    too_long,
    too_sparse,
)
from tidepool.multimodal.features import MultiModalFeature
from tidepool.multimodal.processing import processor_for
from tidepool.outputs import RequestError
from tidepool.params import PoolingParams, SamplingParams
from tidepool.request import Request
from tidepool.utils.lists import filled


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer=None) -> None:
        self.model_config = model_config
        self.max_model_len = model_config.max_model_len
        # AutoTokenizer, or SigLIP 1's SentencePiece-only tokenizer converted to a fast one.
        self.tokenizer = tokenizer or load_tokenizer(model_config.tokenizer_source)
        if model_config.chat_template is not None:
            self.tokenizer.chat_template = model_config.chat_template
        # We check lengths ourselves; stop transformers warning about long inputs.
        self.tokenizer.model_max_length = 1 << 30
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                f"{model_config.model}: tidepool needs a fast tokenizer (tokenizer.json); "
                f"{type(self.tokenizer).__name__} has none"
            )
        self._prefix_tokenizer = PrefixTokenizer(backend)
        self._text_problem: Any = getattr(self.tokenizer, "tidepool_text_problem", None)
        self._num_special = self._prefix_tokenizer.num_special_tokens(pair=False)
        self.vocab_size = int(getattr(model_config.hf_config, "vocab_size", 0) or 0)
        self.keep_token_types = model_config.uses_token_type_ids
        st = model_config.st
        self.lower_case = st.do_lower_case
        self.default_prompt = st.prompts.get(st.default_prompt_name or "", "")
        self.score_template = (
            None
            if model_config.score_template is None
            else ScoreTemplate.parse(model_config.score_template)
        )
        self.multi_vector = (
            None
            if model_config.multi_vector is None
            else MultiVectorInputs.build(model_config.multi_vector, self.tokenizer)
        )
        self._mm = processor_for(model_config, self.tokenizer)
        """The model's image prompt processor (multimodal/processing.py); None: text only."""
        self._modalities = () if self._mm is None else self._mm.modalities
        self._ids = itertools.count()
        self._long = LongInputSplitter.for_model(
            model_config, self._prefix_tokenizer, self._lower, self._make
        )

    def next_request_id(self) -> str:
        return str(next(self._ids))

    # ------------------------------------------------------------------ parsing

    def _parse(self, prompt: Any) -> ParsedPrompt | str:
        """A prompt → text, token ids (and images); a string is the error message."""
        parsed = parse_prompt(prompt, self.vocab_size, self._modalities)
        text = parsed.text if isinstance(parsed, ParsedPrompt) and self._text_problem else None
        problem = self._text_problem(text) if text else None  # a converted tokenizer's refusal
        return f"the text {problem}" if problem else parsed

    def _prepare_text(self, text: str) -> str:
        """A text with the default prompt, as the tokenizer gets it (pairs)."""
        return self._lower(self.default_prompt + text)

    def _lower(self, text: str) -> str:
        return text.lower() if self.lower_case else text

    def _is_multi_vector(self, params: PoolingParams) -> bool:
        return self.multi_vector is not None and params.task == "token_embed"

    def _text_budget(self, params: PoolingParams) -> Budget | str:
        budget = self._budget(params, pair=False)  # a ColBERT text is cut to its length (PyLate)
        if isinstance(budget, str) or not self._is_multi_vector(params):
            return budget
        query = is_query(self.model_config, params.prompt_name)
        assert self.multi_vector is not None  # _is_multi_vector
        num_tokens = self.multi_vector.num_text_tokens(query, self._num_special)
        return Budget(min(num_tokens, budget.num_tokens), truncate=True)

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

    def _budget(self, params: PoolingParams, pair: bool) -> Budget | str:
        """Text prompts: the tokens of text one prompt may keep, or why `params` cannot work."""
        num_special = self._num_special_pair if pair else self._num_special
        tpt = params.truncate_prompt_tokens
        if tpt is None:
            return Budget(self.max_model_len - num_special, truncate=False)
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
        return Budget(total - num_special, truncate=True)

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
    ) -> list[Request | RequestError | ChunkedInput]:
        """One request (or error) per prompt, in order. Texts are tokenized in batched calls.
        With chunked processing, a text too long for the model becomes a ChunkedInput."""
        results: list[Request | RequestError | ChunkedInput | None] = [None] * len(prompts)
        texts: list[tuple[int, str, Budget]] = []
        for i, prompt in enumerate(prompts):
            p = self._parse(prompt)
            try:
                check_prompt_name(self.model_config, params[i].prompt_name)
            except ValueError as e:
                p = str(e)
            if isinstance(p, str):
                results[i] = RequestError(i, p)
            elif p.mm_data:
                results[i] = self._process_multimodal(i, p, params[i])
            elif p.token_ids is not None:
                try:
                    max_len = self._truncation(params[i])
                except ValueError as e:
                    results[i] = RequestError(i, str(e))
                    continue
                ids = keep(p.token_ids, max_len, params[i].truncation_side)
                results[i] = self._make(i, ids, None, params[i])
            elif isinstance(budget := self._text_budget(params[i]), str):
                results[i] = RequestError(i, budget)
            elif error := self._left_read_error(p.text, budget, params[i]):  # type: ignore[arg-type]
                results[i] = RequestError(i, error)
            else:
                # The prompt goes before the text (sentence-transformers' encode(prompt_name=)).
                prefix = prompt_text(self.model_config, params[i].prompt_name)
                text = prefix + p.text  # type: ignore[operator]
                if self._mm is not None:  # the model's processor's text (ColPali's queries)
                    text = self._mm.shape_prompt(text)
                texts.append((i, text, budget))
        firsts = self._prefix_tokenizer.first_tokens(
            [text for _, text, _ in texts],
            [self._num_to_read(text, b, params[i]) for i, text, b in texts],
            self._lower,
        )
        long_texts = []
        for (i, text, budget), first in zip(texts, firsts, strict=True):
            if self._long and self._long.takes_text(params[i], first, budget):
                long_texts.append((i, text, params[i]))
            else:
                results[i] = self._finish_text(i, text, first, budget, params[i])
        if long_texts:
            assert self._long is not None  # only it takes long texts
            for i, item in self._long.texts(long_texts):
                results[i] = item
        return filled(results)

    def _finish_text(
        self, index: int, text: str, first: FirstTokens, budget: Budget, params: PoolingParams
    ) -> Request | RequestError:
        if not first.complete:
            if first.num_tokens < budget.num_wanted:
                return RequestError(
                    index, too_sparse("the prompt", first, budget.num_wanted, len(text))
                )
            if not budget.truncate:
                num_tokens = first.num_tokens + self._num_special
                message = too_long(
                    self.max_model_len, "the prompt", num_tokens, first.num_chars_read, len(text)
                )
                return RequestError(index, message)
        num_kept = budget.num_tokens if budget.truncate else None
        ids = keep(first.token_ids, num_kept, params.truncation_side)
        ids, types = self._prefix_tokenizer.with_special_tokens(ids)
        if self._is_multi_vector(params):
            query = is_query(self.model_config, params.prompt_name)
            assert self.multi_vector is not None  # _is_multi_vector
            shaped = self.multi_vector.shape(ids, query)
            return self._make(index, shaped.token_ids, None, params, shaped.num_attended_tokens)
        return self._make(index, ids, types if self.keep_token_types else None, params)

    def process_pairs(
        self, pairs: Sequence[tuple[Any, Any]], params: Sequence[PoolingParams]
    ) -> list[Request | RequestError | ChunkedInput]:
        """Cross-encoder inputs: (query, document) text pairs, encoded together with token types
        (or, for a decoder reranker, rendered into its score template: `_process_templated`).
        With chunked processing, a pair too long for the model becomes a ChunkedInput."""
        if self.score_template is not None:
            return self._process_templated(pairs, params, self.score_template)
        results: list[Request | RequestError | ChunkedInput | None] = [None] * len(pairs)
        ok: list[tuple[int, Budget]] = []
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
                len(pairs[i][side]) if keeps_last(b, params[i]) else b.num_tokens + 1
                for side in (0, 1)
                for i, b in ok
            ],
            self._prepare_text,
        )
        long_pairs = []
        for k, (i, budget) in enumerate(ok):
            both = (sides[k], sides[len(ok) + k])
            if self._long and self._long.takes_pair(params[i], both, budget):
                doc = self.default_prompt + pairs[i][1]
                long_pairs.append((i, both[0].token_ids, doc, params[i]))
            else:
                results[i] = self._finish_pair(i, pairs[i], both, budget, params[i])
        if long_pairs:
            assert self._long is not None  # only it takes long pairs
            for i, item in self._long.pairs(long_pairs):
                results[i] = item
        return filled(results)

    def _finish_pair(
        self,
        index: int,
        texts: tuple[str, str],
        sides: tuple[FirstTokens, FirstTokens],
        budget: Budget,
        params: PoolingParams,
    ) -> Request | RequestError:
        first, second = sides
        wanted = budget.num_tokens + 1
        sparse = [
            too_sparse(f"the {name} text of the pair", side, wanted, len(text))
            for name, side, text in zip(("first", "second"), sides, texts, strict=True)
            if not side.complete and side.num_tokens < wanted
        ]
        if sparse:
            return RequestError(index, "; ".join(sparse))
        if budget.truncate:
            keep_first, keep_second = longest_first(
                first.num_tokens, second.num_tokens, budget.num_tokens
            )
            first_ids = keep(first.token_ids, keep_first, params.truncation_side)
            second_ids = keep(second.token_ids, keep_second, params.truncation_side)
        elif not (first.complete and second.complete):  # a side over the budget: too long
            return RequestError(
                index,
                too_long(
                    self.max_model_len,
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
    def _num_to_read(text: str, budget: Budget, params: PoolingParams) -> int:
        """Tokens to read from a text: keeping the last ones needs them all (wanting as many
        tokens as characters makes the read limit cover the whole text)."""
        return len(text) if keeps_last(budget, params) else budget.num_wanted

    def _left_read_error(self, text: str, budget: Budget, params: PoolingParams) -> str | None:
        limit = read_limit(self.max_model_len)
        if keeps_last(budget, params) and len(text) > limit:
            return (
                f"the text has {len(text):,} characters; truncation from the left keeps the last "
                "tokens, which needs the whole text read, and tidepool reads at most "
                f"{limit:,} ({CHARS_PER_TOKEN} per token of max_model_len): shorten it"
            )
        return None

    def _process_templated(
        self,
        pairs: Sequence[tuple[Any, Any]],
        params: Sequence[PoolingParams],
        template: ScoreTemplate,
    ) -> list[Request | RequestError | ChunkedInput]:
        """Each pair rendered into ONE prompt (no token types), then checked as a single text."""
        texts, errors = render_pairs(template, pairs, params, self._pair_side_error)
        results: dict[int, Request | RequestError | ChunkedInput] = {
            i: RequestError(i, m) for i, m in errors.items()
        }
        ok = sorted(texts)
        for i, item in zip(
            ok, self.process([texts[i] for i in ok], [params[i] for i in ok]), strict=True
        ):
            results[i] = RequestError(i, item.message) if isinstance(item, RequestError) else item
        return [results[i] for i in range(len(pairs))]

    @property
    def _num_special_pair(self) -> int:
        return self._prefix_tokenizer.num_special_tokens(pair=True)

    def _pair_side_error(self, side: str, value: Any) -> str | None:
        if isinstance(value, dict):
            return (
                f"the {side} text of the pair is a dict (keys {sorted(map(str, value))}); "
                "expected a string (vLLM's multi-modal score inputs, {'content': [...]}, are not "
                "supported yet)"
            )
        if not isinstance(value, str):
            return f"the {side} text of the pair has type {describe(value)}; expected a string"
        if value == "":
            return f"the {side} text of the pair is an empty string"
        if problem := unicode_problem(value):
            return f"the {side} text of the pair {problem}"
        return None

    def _process_multimodal(
        self, index: int, parsed: ParsedPrompt, params: PoolingParams
    ) -> Request | RequestError:
        """A prompt with images, through the model's prompt processor (placeholders, features)."""
        assert self._mm is not None and parsed.text is not None  # parse_prompt took the images
        try:
            task = params.task or self.model_config.default_pooling_task
            done = self._mm.process(parsed.text, parsed.mm_data["image"], task)
        except (ValueError, OSError) as e:  # OSError: PIL's on truncated pixel data
            return RequestError(index, str(e))
        return self._make(
            index,
            done.prompt_token_ids,
            None,
            params,
            mm_features=done.mm_features,
            check_len=done.counts_toward_max_model_len,
        )

    def _make(
        self,
        index: int,
        ids: list[int],
        token_types: list[int] | None,
        params: PoolingParams,
        num_attended_tokens: int | None = None,
        mm_features: tuple[MultiModalFeature, ...] = (),
        check_len: bool = True,
    ) -> Request | RequestError:
        if check_len and (error := self._check_len(len(ids))):
            return RequestError(index, error)
        first_position = 0
        if self._mm is not None and not mm_features:
            try:
                shaped = self._mm.shape_text(ids)
            except ValueError as e:
                return RequestError(index, str(e))
            ids = shaped.token_ids
            first_position = shaped.first_position
            if shaped.num_attended_tokens is not None:
                num_attended_tokens = shaped.num_attended_tokens
        if token_types is not None and not any(token_types):
            token_types = None
        return Request(
            request_id=self.next_request_id(),
            prompt_token_ids=list(ids),
            pooling_params=params,
            token_type_ids=None if token_types is None else list(token_types),
            num_attended_tokens=num_attended_tokens,
            first_position=first_position,
            mm_features=mm_features,
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
            elif p.mm_data:
                results[i] = RequestError(i, "multi_modal_data in generation is not supported yet")
            elif p.token_ids is not None:
                token_ids[i] = p.token_ids
            else:
                texts.append((i, p.text))  # type: ignore[arg-type]
        keeps_last = [
            params[i].truncate_prompt_tokens is not None and params[i].truncation_side == "left"
            for i, _ in texts
        ]
        encoded = tokenize_generate(
            self._prefix_tokenizer,
            self.max_model_len,
            [t for _, t in texts],
            keeps_last,
            add_special_tokens,
        )
        for (i, _), ids_or_error in zip(texts, encoded, strict=True):
            if isinstance(ids_or_error, str):
                results[i] = RequestError(i, ids_or_error)
            else:
                token_ids[i] = ids_or_error
        for i, ids in enumerate(token_ids):
            if ids is None:
                continue
            ids = keep(ids, params[i].truncate_prompt_tokens, params[i].truncation_side)
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
        return filled(results)
