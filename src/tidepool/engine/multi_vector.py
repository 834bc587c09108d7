"""ColBERT inputs and outputs: how a query or a document becomes token ids, and which of its
token vectors are kept (the PyLate / colbert-ir encoding; ModelConfig.multi_vector says which).

    query     [CLS] [Q] what is a tide pool ? [SEP] [MASK] [MASK] ... (query_length tokens)
    document  [CLS] [D] a tide pool is a rocky pool by the sea . [SEP] (at most document_length)

The marker is a token inserted after the first special token (PyLate's insert_prefix_token);
texts are cut so that the whole, marker and special tokens included, fits the length; queries
are padded with [MASK] to query_length when query expansion is on (query augmentation). Every
token runs through the model; a document's vectors of skiplist tokens (punctuation) are then
dropped (`kept_rows`), a query keeps all of its vectors, [MASK]s included. A model that does not
attend to the expansion (colbert-ir's attend_to_mask_tokens, PyLate's attend_to_expansion_tokens
false: their attention mask is 0 there) gets the query's unpadded length as its number of
attended tokens: the [MASK]s attend to the text, nothing attends to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tidepool.config import MultiVectorMeta


class ShapedPrompt(NamedTuple):
    """A query or document as the model runs it."""

    token_ids: list[int]
    """Marker, text, special tokens, then a query's [MASK] padding."""
    num_attended_tokens: int | None
    """The first tokens attended to (the rest, a query's [MASK]s, only attend); None: all."""


@dataclass(frozen=True)
class MultiVectorInputs:
    """A ColBERT model's encoding rules, in token ids (built once from its tokenizer)."""

    query_prefix_id: int | None
    """The query marker's id; None: no marker."""
    document_prefix_id: int | None
    """The document marker's id; None: no marker."""
    mask_token_id: int | None
    """[MASK]: pads queries when `query_length` is set."""
    query_length: int | None
    """Queries are padded to this many tokens (None: query expansion off)."""
    attend_to_expansion: bool
    """Whether the query's [MASK] padding is attended to (is a key) like its text."""
    max_query_tokens: int
    """Most tokens of a query, marker and special tokens included."""
    max_document_tokens: int
    """Most tokens of a document, marker and special tokens included."""
    skip_ids: frozenset[int]
    """Token ids whose vectors documents drop."""

    @classmethod
    def build(cls, meta: MultiVectorMeta, tokenizer: Any) -> MultiVectorInputs:
        mask_id = tokenizer.mask_token_id
        if meta.do_query_expansion and mask_id is None:
            raise ValueError("query expansion needs a [MASK] token; this tokenizer has none")
        return cls(
            query_prefix_id=_marker_id(tokenizer, meta.query_prefix),
            document_prefix_id=_marker_id(tokenizer, meta.document_prefix),
            mask_token_id=mask_id,
            query_length=meta.query_length if meta.do_query_expansion else None,
            attend_to_expansion=meta.attend_to_expansion_tokens,
            max_query_tokens=meta.query_length,
            max_document_tokens=meta.document_length,
            # As PyLate: convert_tokens_to_ids, so a word outside the vocabulary skips [UNK].
            skip_ids=frozenset(tokenizer.convert_tokens_to_ids(list(meta.skiplist_words))),
        )

    def num_text_tokens(self, is_query: bool, num_special: int) -> int:
        """Tokens of text a query (or document) keeps: its length less marker and specials."""
        marker = self.query_prefix_id if is_query else self.document_prefix_id
        total = self.max_query_tokens if is_query else self.max_document_tokens
        return total - num_special - (marker is not None)

    def shape(self, ids: list[int], is_query: bool) -> ShapedPrompt:
        """Token ids with special tokens → the model's input: marker, then [MASK] padding."""
        marker = self.query_prefix_id if is_query else self.document_prefix_id
        if marker is not None:
            ids = ids[:1] + [marker] + ids[1:]
        if is_query and self.query_length is not None and len(ids) < self.query_length:
            num_text = len(ids)
            ids = ids + [self.mask_token_id] * (self.query_length - len(ids))  # type: ignore[list-item]
            return ShapedPrompt(ids, None if self.attend_to_expansion else num_text)
        return ShapedPrompt(ids, None)

    def kept_rows(self, token_ids: list[int]) -> torch.Tensor | None:
        """A document's rows to keep (None: all): those whose token is not in the skiplist."""
        if not self.skip_ids or not any(t in self.skip_ids for t in token_ids):
            return None
        return torch.tensor([t not in self.skip_ids for t in token_ids], dtype=torch.bool)


def _marker_id(tokenizer: Any, marker: str | None) -> int | None:
    if marker is None:
        return None
    token_id = tokenizer.convert_tokens_to_ids(marker)
    if token_id is None or (token_id == tokenizer.unk_token_id and marker != tokenizer.unk_token):
        raise ValueError(
            f"the ColBERT marker {marker!r} is not a token of this tokenizer (PyLate adds its "
            "markers to the tokenizer when it saves a model)"
        )
    return int(token_id)
