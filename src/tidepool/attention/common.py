"""The neutral description of one step's attention, built once by the runner for every backend.

The runner knows sequences, positions and block tables; it does not know how a backend attends.
It describes the step once (`CommonAttentionMetadata`: what vLLM calls the common attention
metadata), and the backend chosen at load turns that into its own metadata with its
`AttentionMetadataBuilder`: buckets and masks for SDPA, lengths for a variable-length kernel,
int32 tables for the in-place decode kernel. Every layer then reads the backend's metadata.

    runner ──CommonAttentionMetadata──▶ backend's builder ──its metadata──▶ model ──▶ layers
                                        (once per step)                             (backend)

Worked example, a causal step of two requests, block size 4, one KV group:

    request   context  query  block table   flat tokens
    a (decode)      9      1  [3, 5, 8]     0            (position 9 → block 8, offset 1)
    b (prefill)     0      3  [2]           1, 2, 3      (positions 0-2 → block 2)

    query_start_loc [0, 1, 4]   query_lens [1, 3]   seq_lens [10, 3]   causal True
    positions [9, 0, 1, 2]      token_seq [0, 1, 1, 1]
    kv_groups[0]: block_table [[3, 5, 8], [2, 0, 0]]   slot_mapping [33, 8, 9, 10]

An encoder step has the same fields without the KV groups: each prompt is whole (context 0),
bidirectional (causal False), optionally with fewer keys than tokens (key_lens).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Generic, TypeVar

import torch

from tidepool.kv_cache.spec import KVCacheSpec


@dataclass(frozen=True)
class KVGroupStep:
    """One attention view's part of a causal step: the layers reading one KV-cache group's
    block tables with one spec (paged_metadata.AttentionView)."""

    spec: KVCacheSpec
    block_table: torch.Tensor
    """[num_seqs, max_blocks] int64 CPU: each sequence's blocks, 0 (the null block) after its end."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64 on the device: the cache slot (block * block_size + offset) each new
    token's K/V goes to."""


@dataclass(frozen=True)
class CommonAttentionMetadata:
    """What every backend is told about a step (see the module docstring)."""

    query_lens: list[int]
    """New tokens per sequence, in flat order."""
    seq_lens: list[int]
    """Tokens per sequence after this step (context + query): its keys, up to key_lens."""
    query_start_loc: torch.Tensor
    """[num_seqs + 1] int64 CPU: sequence i's new tokens are flat tokens [loc[i], loc[i+1])."""
    causal: bool
    device: torch.device
    dtype: torch.dtype
    """The model's compute dtype (masks are made in it)."""
    num_heads: int = 1
    """Query heads (bounds the memory of padded score buckets)."""
    key_lens: list[int] | None = None
    """Encoders: per sequence, how many of its first tokens are keys (None: all)."""
    positions: torch.Tensor | None = None
    """Causal steps: [num_tokens] int64 CPU position of each flat token."""
    token_seq: torch.Tensor | None = None
    """Causal steps: [num_tokens] int64 CPU sequence index of each flat token."""
    kv_groups: tuple[KVGroupStep, ...] = ()
    """Causal steps: one per attention view."""
    layer_groups: tuple[int, ...] = ()
    """Causal steps: KV-cache layer index → its attention view (index into kv_groups)."""
    output_seqs: list[bool] | None = None
    """The step reads only the last token of the sequences marked True (sampling, LAST
    pooling): a backend may attend their last layer at those rows alone. None: every token."""

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def context_lens(self) -> list[int]:
        return [s - q for s, q in zip(self.seq_lens, self.query_lens, strict=True)]


def encoder_step(
    seq_lens: Sequence[int],
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int = 1,
    key_lens: list[int] | None = None,
) -> CommonAttentionMetadata:
    """An encoder step: whole prompts of `seq_lens` tokens in flat order (longest first, so that
    neighbours have similar lengths), bidirectional."""
    loc = [0]
    for n in seq_lens:
        loc.append(loc[-1] + n)
    return CommonAttentionMetadata(
        query_lens=list(seq_lens),
        seq_lens=list(seq_lens),
        query_start_loc=torch.tensor(loc, dtype=torch.int64),
        causal=False,
        device=device,
        dtype=dtype,
        num_heads=num_heads,
        key_lens=key_lens,
    )


def slot_mapping_of(
    block_table: torch.Tensor,
    token_seq: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> torch.Tensor:
    """[num_tokens] int64 on `device`: the cache slot of each flat token (block_table,
    token_seq and positions: CPU tensors, see CommonAttentionMetadata)."""
    block_ids = block_table[token_seq, torch.div(positions, block_size, rounding_mode="floor")]
    return (block_ids * block_size + positions % block_size).to(device, non_blocking=True)


@dataclass(frozen=True)
class LayerRows:
    """Where an encoder's layers hold the step's tokens, as its backend's builder chose: the
    packed tokens themselves (a variable-length kernel), or another row order (bucketed SDPA's
    padded buckets, metadata.pad_buckets). A model spreads its per-token inputs with `gather`
    once, runs its layers on the rows, and takes the hidden states back with `to_tokens`; it
    never lays the rows out itself.

    Worked example, padded buckets of lengths (3, 2) in one bucket of max_len 3:
        token_index [0, 1, 2, 3, 4, 3]   (row 5 is padding: it repeats token 3, masked as a key)
        row_of_token [0, 1, 2, 3, 4]     first_rows [0, 3]
    """

    token_index: torch.Tensor | None
    """[num_rows] the packed token each row holds; None: row i is packed token i."""
    row_of_token: torch.Tensor | None
    """[num_tokens] the row that holds each packed token; None: the same."""
    first_row_starts: torch.Tensor | None = None
    """Packed rows: [num_seqs] each sequence's first token (cu_seqlens[:-1]); None: the rows'
    own first rows are `first_rows_of` of the builder's buckets."""
    bucket_shapes: tuple[tuple[int, int, int], ...] = ()
    """Padded rows: (first row, end row, max_len) per bucket, for first_rows."""

    @classmethod
    def packed(cls, cu_seqlens: torch.Tensor) -> LayerRows:
        """The packed tokens as the rows (cu_seqlens: [num_seqs + 1] on the device)."""
        return cls(None, None, cu_seqlens[:-1])

    def gather(self, per_token: torch.Tensor | None) -> torch.Tensor | None:
        """A per-token input [num_tokens, ...] → the rows' [num_rows, ...] (None stays None)."""
        if per_token is None or self.token_index is None:
            return per_token
        return per_token[self.token_index]

    def to_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """The layers' output [num_rows, ...] → [num_tokens, ...] in packed order."""
        return rows if self.row_of_token is None else rows.index_select(0, self.row_of_token)

    @cached_property
    def first_rows(self) -> torch.Tensor:
        """[num_seqs] the row of each sequence's first token, in sequence order (what CLS
        pooling and a first-token-only last layer read); made on first use."""
        if self.first_row_starts is not None:
            return self.first_row_starts
        device = self.row_of_token.device if self.row_of_token is not None else None
        return torch.cat([torch.arange(s, e, n, device=device) for s, e, n in self.bucket_shapes])


M = TypeVar("M", covariant=True)


class AttentionMetadataBuilder(ABC, Generic[M]):
    """A backend's half of the step: the neutral description → the metadata its kernels read.
    Made once per model (backend.metadata_builder), called once per step."""

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> M:
        """The step's metadata for this backend, shared by every layer."""
