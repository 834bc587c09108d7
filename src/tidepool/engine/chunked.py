"""Long inputs (PoolerConfig.enable_chunked_processing, vLLM's option): a text longer than
max_model_len runs as several sequences, and their outputs are combined into the one its caller
gets.

    text tokens  t0 t1 ... t9                    (max_model_len 6, BERT: 2 special tokens)
    chunks       [CLS] t0 t1 t2 t3 [SEP]   [CLS] t4 t5 t6 t7 [SEP]   [CLS] t8 t9 [SEP]

Each chunk gets the model's special tokens, so it is an input of the kind the model was trained
on (a CLS model pools each chunk's own [CLS]); the text tokens are split without overlap, so the
chunks hold each token exactly once, in order.

Embeddings: the chunks run unnormalized (Dense modules applied), and their embeddings are
averaged weighted by each chunk's token count, then truncated (dimensions) and normalized as the
request asked. For MEAN pooling that is the mean over all tokens of the text (each token seen in
its chunk's context), the natural extension. CLS and LAST models get the same token-weighted mean
of their chunks' [CLS] / last-token embeddings, as vLLM does (it aggregates chunks by MEAN
whatever the pooling type): a chunk's [CLS] summarizes its chunk, and a LAST model's last token
has seen only the last chunk, so keeping one chunk would drop the rest of the text.

Cross-encoders (score): a long document is split and each chunk paired with the whole query; the
pair's score is the max (default), mean or first of its chunks' scores
(PoolerConfig.chunk_score_aggregation), taken after the activation.

Fairness: each chunk is a request marked `long_input_chunk`; the encoder scheduler gives such
chunks at most a share (1/8) of each step's token budget (core/scheduler.py), so the requests
that arrive while a long input runs go into the next step instead of waiting for all its chunks. The
longest input taken is `max_embed_len` tokens (default DEFAULT_MAX_EMBED_LEN).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from tidepool.config import ModelConfig
from tidepool.engine.prefix_tokenizer import FirstTokens, PrefixTokenizer
from tidepool.outputs import PoolingOutput, PoolingRequestOutput, RequestError
from tidepool.params import PoolingParams
from tidepool.request import Request

DEFAULT_MAX_EMBED_LEN = 131_072
"""The longest input chunked processing takes when `max_embed_len` is not set, in tokens: a
long input holds ~1 KiB of host memory per token while it runs (its ids, the tokenizer's
encoding, its chunks' requests), so one input stays near 130 MiB; a longer one answers 400 up
front, before any of its request runs (a 1,000,000-token text took 208 s and +900 MiB)."""


@dataclass(frozen=True)
class ChunkedInput:
    """One long prompt (or pair), run as one request per chunk."""

    requests: list[Request]
    """The chunks' requests, in text order."""
    params: PoolingParams
    """What the caller asked for (the chunks run with their own parameters)."""


def split_tokens(token_ids: Sequence[int], chunk_len: int) -> list[list[int]]:
    """Text tokens → consecutive chunks of at most `chunk_len` (none empty, none overlapping)."""
    if chunk_len < 1:
        raise ValueError(f"chunk_len must be >= 1, got {chunk_len}")
    return [list(token_ids[i : i + chunk_len]) for i in range(0, len(token_ids), chunk_len)]


def chunk_params(params: PoolingParams) -> PoolingParams:
    """A chunk's parameters: embeddings stay unnormalized and whole until they are combined."""
    if params.task == "embed":
        return replace(params, use_activation=False, dimensions=None)
    return params


@dataclass(frozen=True)
class Expansion:
    """A batch's items with each ChunkedInput replaced by its chunks' requests."""

    flat: list[Request | RequestError]
    """What runs, in order."""
    owner: list[int]
    """Per item of `flat`, the index of the caller's item it belongs to."""
    items: list[Request | RequestError | ChunkedInput]
    """The caller's items."""


def expand(items: Sequence[Request | RequestError | ChunkedInput]) -> Expansion:
    flat: list[Request | RequestError] = []
    owner: list[int] = []
    for i, item in enumerate(items):
        if isinstance(item, RequestError):
            item = RequestError(len(flat), item.message)  # `flat`'s indices, as all errors here
        parts = item.requests if isinstance(item, ChunkedInput) else [item]
        flat.extend(parts)
        owner.extend([i] * len(parts))
    return Expansion(flat, owner, list(items))


def has_chunks(items: Sequence[object]) -> bool:
    return any(isinstance(item, ChunkedInput) for item in items)


def combine(
    expansion: Expansion,
    outputs: Sequence[PoolingRequestOutput | None],
    errors: Sequence[RequestError],
    model_config: ModelConfig,
) -> tuple[list[PoolingRequestOutput | None], list[RequestError]]:
    """The caller's outputs (one per item; None where it failed) and errors (indexed by item):
    a chunked item fails when any of its chunks did."""
    failed: dict[int, str] = {}
    for error in errors:
        failed.setdefault(expansion.owner[error.index], error.message)
    parts: dict[int, list[PoolingRequestOutput]] = {}
    for flat_index, out in enumerate(outputs):
        if out is not None:
            parts.setdefault(expansion.owner[flat_index], []).append(out)
    results: list[PoolingRequestOutput | None] = []
    for i, item in enumerate(expansion.items):
        if i in failed or i not in parts:
            results.append(None)
        elif isinstance(item, ChunkedInput):
            results.append(_combine_item(parts[i], item.params, model_config))
        else:
            results.append(parts[i][0])
    return results, [RequestError(i, message) for i, message in sorted(failed.items())]


def _combine_item(
    chunks: list[PoolingRequestOutput], params: PoolingParams, model_config: ModelConfig
) -> PoolingRequestOutput:
    values = [c.outputs.data for c in chunks]
    if params.task == "embed":
        data = combine_embeddings(values, [len(c.prompt_token_ids) for c in chunks])
        data = _finish_embedding(data, params, model_config)
    else:
        data = combine_scores(values, model_config.pooler.chunk_score_aggregation)
    token_ids = [t for c in chunks for t in c.prompt_token_ids]
    return PoolingRequestOutput(chunks[0].request_id, token_ids, PoolingOutput(data))


def combine_embeddings(
    embeddings: Sequence[torch.Tensor], num_tokens: Sequence[int]
) -> torch.Tensor:
    """Token-weighted mean of the chunks' (unnormalized) embeddings."""
    weights = torch.tensor(num_tokens, dtype=torch.float32)
    stacked = torch.stack([e.float() for e in embeddings])
    return (weights[:, None] * stacked).sum(dim=0) / weights.sum()


def combine_scores(scores: Sequence[torch.Tensor], how: str) -> torch.Tensor:
    """A long document's score from its chunks' scores: "max", "mean" or "first"."""
    stacked = torch.stack([s.float() for s in scores])
    if how == "first":
        return stacked[0]
    return stacked.amax(dim=0) if how == "max" else stacked.mean(dim=0)


def _finish_embedding(
    x: torch.Tensor, params: PoolingParams, model_config: ModelConfig
) -> torch.Tensor:
    # The pooler's rule (worker/pooler.py): normalize unless a sentence-transformers pipeline
    # without a Normalize module says otherwise; an explicit normalize wins.
    st = model_config.st
    default = st.normalize or not st.is_sentence_transformer
    if params.dimensions is not None:
        x = x[: params.dimensions]
    if default if params.use_activation is None else params.use_activation:
        x = F.normalize(x, p=2, dim=-1)
    return x


class LongInputSplitter:
    """The input side: tokenizes a long text whole (up to max_embed_len) and builds its chunks'
    requests; the input processor hands it the texts its length check refused."""

    def __init__(
        self,
        prefix_tokenizer: PrefixTokenizer,
        max_model_len: int,
        max_embed_len: int | None,
        prepare: Callable[[str], str],
        make: Callable[[int, list[int], list[int] | None, PoolingParams], Request | RequestError],
        keep_token_types: bool,
    ) -> None:
        self._tokenizer = prefix_tokenizer
        self._max_model_len = max_model_len
        self._max_embed_len = max_embed_len
        self._prepare = prepare
        self._make = make
        self._keep_token_types = keep_token_types

    @classmethod
    def for_model(
        cls,
        model_config: ModelConfig,
        prefix_tokenizer: PrefixTokenizer,
        prepare: Callable[[str], str],
        make: Callable[[int, list[int], list[int] | None, PoolingParams], Request | RequestError],
    ) -> LongInputSplitter | None:
        """The splitter of a model with chunked processing on; None when it is off."""
        pooler = model_config.pooler
        if not pooler.enable_chunked_processing:
            return None
        max_embed_len = pooler.max_embed_len
        return cls(
            prefix_tokenizer,
            model_config.max_model_len,
            DEFAULT_MAX_EMBED_LEN if max_embed_len is None else max_embed_len,
            prepare,
            make,
            model_config.uses_token_type_ids,
        )

    @staticmethod
    def takes_text(params: PoolingParams, first: FirstTokens, budget: Any) -> bool:
        """An embed text longer than an untruncated budget (the input processor's _Budget:
        `num_tokens` of text, `truncate`)."""
        return (
            params.task == "embed" and not budget.truncate and first.num_tokens > budget.num_tokens
        )

    @staticmethod
    def takes_pair(
        params: PoolingParams, sides: tuple[FirstTokens, FirstTokens], budget: Any
    ) -> bool:
        """A scored pair over an untruncated budget whose first text is whole (the second is
        split)."""
        first, second = sides
        return (
            params.task == "score"
            and not budget.truncate
            and first.complete
            and (not second.complete or first.num_tokens + second.num_tokens > budget.num_tokens)
        )

    def _whole(self, texts: list[str]) -> list[list[int] | str]:
        """Each text's tokens, or why it is refused (longer than max_embed_len)."""
        limit = self._max_embed_len
        # Wanting as many tokens as characters makes the read limit cover the whole text.
        wanted = [len(t) if limit is None else limit + 1 for t in texts]
        out: list[list[int] | str] = []
        for first, text in zip(
            self._tokenizer.first_tokens(texts, wanted, self._prepare), texts, strict=True
        ):
            if limit is not None and first.num_tokens > limit:
                out.append(
                    f"the text is longer than max_embed_len={limit} tokens (its first "
                    f"{first.num_chars_read:,} of {len(text):,} characters give "
                    f"{first.num_tokens}); shorten it or pass truncate_prompt_tokens"
                )
            elif first.complete:
                out.append(first.token_ids)
            else:
                out.append(
                    f"the text has {len(text):,} characters and its first "
                    f"{first.num_chars_read:,} give only {first.num_tokens} tokens: too sparse "
                    "to read (long runs of whitespace or of characters without a break)"
                )
        return out

    def _chunks(
        self,
        index: int,
        pieces: list[list[int]],
        query: list[int] | None,
        params: PoolingParams,
    ) -> ChunkedInput | RequestError:
        requests = []
        for piece in pieces:
            first, second = (piece, None) if query is None else (query, piece)
            ids, types = self._tokenizer.with_special_tokens(first, second)
            made = self._make(
                index, ids, types if self._keep_token_types else None, chunk_params(params)
            )
            if isinstance(made, RequestError):
                return made
            made.long_input_chunk = True  # scheduled in a share of each step (core/scheduler.py)
            requests.append(made)
        return ChunkedInput(requests, params)

    def texts(
        self, long_texts: list[tuple[int, str, PoolingParams]]
    ) -> list[tuple[int, ChunkedInput | RequestError]]:
        """(index, text as given to the tokenizer, params) → the text's chunks."""
        chunk_len = self._max_model_len - self._tokenizer.num_special_tokens(pair=False)
        out: list[tuple[int, ChunkedInput | RequestError]] = []
        whole = self._whole([text for _, text, _ in long_texts])
        for (i, _, params), ids in zip(long_texts, whole, strict=True):
            if isinstance(ids, str):
                out.append((i, RequestError(i, ids)))
            else:
                out.append((i, self._chunks(i, split_tokens(ids, chunk_len), None, params)))
        return out

    def pairs(
        self, long_pairs: list[tuple[int, list[int], str, PoolingParams]]
    ) -> list[tuple[int, ChunkedInput | RequestError]]:
        """(index, the query's tokens, the document, params) → the document's chunks, each
        paired with the whole query."""
        num_special = self._tokenizer.num_special_tokens(pair=True)
        out: list[tuple[int, ChunkedInput | RequestError]] = []
        whole = self._whole([doc for _, _, doc, _ in long_pairs])
        for (i, query, _, params), ids in zip(long_pairs, whole, strict=True):
            chunk_len = self._max_model_len - num_special - len(query)
            if isinstance(ids, str):
                out.append((i, RequestError(i, f"the second text of the pair: {ids}")))
            elif chunk_len < 1:
                message = (
                    f"the first text of the pair has {len(query)} tokens: with the "
                    f"{num_special} special tokens no room is left for the second within "
                    f"max_model_len={self._max_model_len}; chunked processing splits only the "
                    "second text"
                )
                out.append((i, RequestError(i, message)))
            else:
                out.append((i, self._chunks(i, split_tokens(ids, chunk_len), query, params)))
        return out
