"""Planning for causal attention over the paged KV cache: rows, buckets, block tables, masks.

KV cache of one layer, head-major inside each KV-cache tensor (the kernels are in paged.py):

    kv_cache [2, num_kv_heads, num_blocks, block_size, head_size]     (K = [0], V = [1])

A step's scheduled tokens are cut into attention rows, and consecutive rows of similar size form a
bucket that runs as one padded SDPA call. A row is a request's query tokens of this step, or a tile
of them (long prefills are tiled so that the [queries, keys] mask stays small). Worked example,
block_size 4, the runner puts decodes first (longest context first), then prefills:

    request   context  query  keys (context + query)
    A         9        1      10  → padded to 12 (3 blocks)      bucket 0: decodes A, B
    B         7        1      8   → padded to 12 (A's blocks)    (waste 2/20 keys)
    C         0        6      6   → 8                            bucket 1: prefill C alone

Prompts computed from their first token (no cached context, as with prefix caching off) skip all
that: a *causal row* is a whole prompt that attends only to this step's own keys, so it runs as
one SDPA with `is_causal` on views of the step's q / k / v (no gather from the cache, no mask, no
padding, half the score blocks skipped); consecutive causal rows of one length share a call. In
the example above, C would be one if it had CAUSAL_ROW_MIN_LEN tokens: its bucket would then read
neither the cache nor a mask.

Every layer of a KV-cache group shares the group's metadata (slot mapping, buckets, masks), built
once per step. Masks are additive (0 / -inf): key k is visible to the query at position p when
k <= p (and k > p - sliding_window). Keys past a row's end read the null block or stale values of
the row's last block; both are finite (the cache is zero-initialised), and the mask hides them.
A sliding-window group gathers from the block of a row's first visible key, not from block 0.

Where the builder says so (CPU, the in-place kernel built: backends/paged_sdpa.py), non-causal rows
of a few queries (decodes, short prompts, the output rows) skip the buckets altogether
(split_decode_rows): GroupAttentionMetadata.decode lists them with their block tables and
lengths, and attention/cpu_paged_decode.py reads their keys from the cache blocks in place, with
the same visibility rule computed per key (no padding, no mask, no gather).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tidepool.attention.common import slot_mapping_of
from tidepool.kv_cache.spec import KVCacheSpec, SlidingWindowSpec

# Queries of one row at most: a longer prefill chunk is cut into tiles of this many tokens,
# each attending to the keys up to its own end (so the mask is [tile, keys], not [chunk, keys]).
MAX_ROW_QUERY_LEN = 512
# Prompts from position 0 at least this long are causal rows (see the module docstring); shorter
# ones are cheaper in a padded bucket with their neighbours than in a call of their own.
CAUSAL_ROW_MIN_LEN = 16
# A bucket's mask holds at most this many elements (num_kv_heads * rows * queries * keys).
_MAX_BUCKET_MASK_ELEMS = 1 << 24


@dataclass(frozen=True)
class AttentionRow:
    """Query tokens [token_start, token_start + query_len) of one request, at positions
    context_len .. context_len + query_len - 1; `request_index` picks its block-table row."""

    request_index: int
    token_start: int
    context_len: int
    query_len: int
    causal: bool = False
    """A causal row: the whole prompt from position 0, attended on this step's K/V alone."""

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


@dataclass(frozen=True)
class PagedBucket:
    start: int
    """First flat token of the bucket (its rows are contiguous in the flat batch)."""
    end: int
    num_rows: int
    query_len: int
    """Queries per row after padding."""
    key_len: int
    """Keys per row after padding: a whole number of blocks."""
    block_index: torch.Tensor | None
    """[num_rows * key_len // block_size] block id per padded block (0 = the null block); None
    for causal rows (they read this step's K/V, not the cache)."""
    mask: torch.Tensor | None
    """[num_kv_heads * num_rows, 1, query_len, key_len] additive (0 / -inf), model dtype; None
    for causal rows (SDPA's `is_causal`)."""
    query_gather: torch.Tensor | None
    """[num_rows * query_len] flat token per padded query slot; None when nothing is padded."""
    valid_slots: torch.Tensor | None
    """[end - start] padded query slots that hold real tokens; None when nothing is padded."""

    @property
    def causal(self) -> bool:
        """Causal rows (see the module docstring): this step's K/V, `is_causal`, no mask."""
        return self.block_index is None


@dataclass(frozen=True)
class PagedDecodeRows:
    """Rows of a few queries each that read the cache in place (cpu_paged_decode.py): row r's
    queries are flat tokens query_starts[r] .. + query_lens[r], the last of its seq_lens[r] keys,
    whose blocks are block_table[r] (the group's own table: a sliding window reads from the block
    of its first visible key). int32 CPU tensors."""

    block_table: torch.Tensor
    """[rows, max_blocks] int32 (0, the null block, past each row's end)."""
    seq_lens: torch.Tensor
    query_starts: torch.Tensor
    query_lens: torch.Tensor
    window: int | None
    """The group's sliding window (None: full attention)."""


@dataclass(frozen=True)
class GroupAttentionMetadata:
    """One KV-cache group's view of the step (its block tables differ from other groups')."""

    slot_mapping: torch.Tensor
    """[num_tokens] int64: cache slot (block_id * block_size + offset) each new token's KV goes to."""
    buckets: tuple[PagedBucket, ...]
    decode: PagedDecodeRows | None = None
    """Rows outside the buckets that the in-place kernel attends (None: none)."""


class AttentionView(NamedTuple):
    """Layers that read one KV-cache group's block tables with one spec (mask and gather).

    Usually one view per group. With the uniform layout (disable_hybrid_kv_cache_manager) the
    sliding-window layers sit in the full-attention group, keep every block, and still attend
    only inside their window: that group has two views, one per spec.
    """

    group_id: int
    spec: KVCacheSpec


@dataclass(frozen=True)
class PagedAttentionMetadata:
    num_tokens: int
    groups: tuple[GroupAttentionMetadata, ...]
    """One per attention view."""
    layer_groups: tuple[int, ...]
    """Layer index → its attention view (index into `groups`)."""
    output_rows: torch.Tensor | None = None
    """[num_output_rows] int64: the flat tokens whose final hidden states the step reads (each
    finishing request's last token), or None: every token. A model may then compute its last
    layer's queries, o_proj, MLP and final norm at these rows only and return [num_output_rows,
    hidden] (its K/V still at every token); one that ignores it returns every row."""
    output_groups: tuple[GroupAttentionMetadata, ...] = ()
    """With output_rows, per view: the last layer's attention with the output rows as its
    queries (one-query rows over the cache, like decodes) and the step's full slot mapping."""

    def for_layer(self, layer_index: int) -> GroupAttentionMetadata:
        return self.groups[self.layer_groups[layer_index]]

    def for_output_rows(self, layer_index: int) -> GroupAttentionMetadata:
        return self.output_groups[self.layer_groups[layer_index]]


def causal_row_max_len(specs: Sequence[KVCacheSpec]) -> int | None:
    """The longest prompt that may be a causal row under every spec (None: no limit): a
    sliding window hides keys only from queries past it, so prompts up to the window qualify."""
    windows = [s.sliding_window for s in specs if isinstance(s, SlidingWindowSpec)]
    return min(windows) if windows else None


def split_rows(
    context_lens: Sequence[int],
    query_lens: Sequence[int],
    max_query_len: int = MAX_ROW_QUERY_LEN,
    causal_max_len: int | None = None,
    causal_rows: bool = True,
) -> list[AttentionRow]:
    """Requests in flat order → attention rows: a prompt from position 0 of at least
    CAUSAL_ROW_MIN_LEN (and at most `causal_max_len`) tokens is one causal row; other requests
    longer than max_query_len are tiled. `causal_rows=False` buckets everything."""
    rows: list[AttentionRow] = []
    token_start = 0
    for index, (context_len, query_len) in enumerate(zip(context_lens, query_lens, strict=True)):
        if (
            causal_rows
            and context_len == 0
            and query_len >= CAUSAL_ROW_MIN_LEN
            and (causal_max_len is None or query_len <= causal_max_len)
        ):
            rows.append(AttentionRow(index, token_start, 0, query_len, causal=True))
            token_start += query_len
            continue
        for offset in range(0, query_len, max_query_len):
            tile_len = min(max_query_len, query_len - offset)
            rows.append(AttentionRow(index, token_start + offset, context_len + offset, tile_len))
        token_start += query_len
    return rows


def output_rows_of(
    context_lens: Sequence[int], query_lens: Sequence[int], reaches_end: Sequence[bool]
) -> tuple[list[int], list[AttentionRow]]:
    """The finishing requests' last flat tokens, and one-query attention rows for them (query
    token_start = the index among the output rows; keys: the whole sequence, from the cache)."""
    tokens: list[int] = []
    rows: list[AttentionRow] = []
    token_end = 0
    for index, (context_len, query_len, end) in enumerate(
        zip(context_lens, query_lens, reaches_end, strict=True)
    ):
        token_end += query_len
        if end:
            rows.append(AttentionRow(index, len(tokens), context_len + query_len - 1, 1))
            tokens.append(token_end - 1)
    return tokens, rows


def plan_buckets(
    rows: Sequence[AttentionRow], block_size: int, num_kv_heads: int, max_pad_fraction: float
) -> list[tuple[int, int]]:
    """[first_row, end_row) of each bucket: consecutive rows while the padded area
    (rows x max queries x max keys) stays within (1 + max_pad_fraction) x the real one."""
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(rows):
        if rows[i].causal:  # with its neighbours of the same length: one unpadded call
            j = i + 1
            while j < len(rows) and rows[j].causal and rows[j].query_len == rows[i].query_len:
                j += 1
            spans.append((i, j))
            i = j
            continue
        max_q, max_k = rows[i].query_len, _round_up(rows[i].seq_len, block_size)
        real_area = rows[i].query_len * rows[i].seq_len
        j = i + 1
        while j < len(rows) and not rows[j].causal:
            q, k = max(max_q, rows[j].query_len), max(max_k, _round_up(rows[j].seq_len, block_size))
            area = real_area + rows[j].query_len * rows[j].seq_len
            padded = (j - i + 1) * q * k
            if padded > (1.0 + max_pad_fraction) * area or (
                padded * num_kv_heads > _MAX_BUCKET_MASK_ELEMS
            ):
                break
            max_q, max_k, real_area = q, k, area
            j += 1
        spans.append((i, j))
        i = j
    return spans


def build_group_metadata(
    rows: Sequence[AttentionRow],
    spans: Sequence[tuple[int, int]],
    block_table: torch.Tensor,
    token_request: torch.Tensor,
    positions: torch.Tensor,
    spec: KVCacheSpec,
    dtype: torch.dtype,
    device: torch.device,
    decode_rows: Sequence[AttentionRow] = (),
    block_table_i32: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> GroupAttentionMetadata:
    """block_table: [num_requests, max_blocks] int64 (0-padded); token_request / positions:
    [num_tokens] request index and position of each flat token (CPU tensors). `decode_rows`:
    rows (not in `rows`) for the in-place kernel (split_decode_rows); `block_table_i32`, the
    same table as int32, saves converting it again for each group view; `slot_mapping` (on the
    device), the step's, when the caller has it (common.KVGroupStep)."""
    block_size = spec.block_size
    if slot_mapping is None:
        slot_mapping = slot_mapping_of(block_table, token_request, positions, block_size, device)
    window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
    buckets = tuple(
        _make_bucket(rows[i:j], block_table, spec.num_kv_heads, block_size, window, dtype, device)
        for i, j in spans
    )
    decode = None
    if decode_rows:
        if block_table_i32 is None:
            block_table_i32 = block_table.to(torch.int32)
        decode = _decode_rows(decode_rows, block_table_i32, window)
    return GroupAttentionMetadata(slot_mapping, buckets, decode)


def split_decode_rows(
    rows: Sequence[AttentionRow], max_query_len: int
) -> tuple[list[AttentionRow], list[AttentionRow]]:
    """(rows for the SDPA buckets, rows for the in-place kernel): the kernel takes every
    non-causal row of at most `max_query_len` queries."""
    bucketed: list[AttentionRow] = []
    in_place: list[AttentionRow] = []
    for row in rows:
        (in_place if not row.causal and row.query_len <= max_query_len else bucketed).append(row)
    return bucketed, in_place


def _decode_rows(
    rows: Sequence[AttentionRow], block_table: torch.Tensor, window: int | None
) -> PagedDecodeRows:
    index = [r.request_index for r in rows]
    identity = index == list(range(block_table.shape[0]))
    table = block_table if identity else block_table[torch.tensor(index)]
    fields = torch.tensor(
        [(r.seq_len, r.token_start, r.query_len) for r in rows], dtype=torch.int32
    ).T.contiguous()
    return PagedDecodeRows(table.contiguous(), fields[0], fields[1], fields[2], window)


def _make_bucket(
    rows: Sequence[AttentionRow],
    block_table: torch.Tensor,
    num_kv_heads: int,
    block_size: int,
    window: int | None,
    dtype: torch.dtype,
    device: torch.device,
) -> PagedBucket:
    num_rows = len(rows)
    query_len = max(r.query_len for r in rows)
    start = rows[0].token_start
    end = rows[-1].token_start + rows[-1].query_len
    if rows[0].causal:  # plan_buckets: all causal, one length
        return PagedBucket(start, end, num_rows, query_len, query_len, None, None, None, None)
    query_lens = torch.tensor([r.query_len for r in rows])
    context_lens = torch.tensor([r.context_len for r in rows])
    block_index, key_pos = _row_blocks(rows, block_table, block_size, window)
    key_len = key_pos.shape[1]
    slot = torch.arange(query_len)
    # Padded query slots take the row's last position: their keys are real, so no row of the
    # softmax is all -inf (their outputs are dropped anyway).
    query_pos = context_lens[:, None] + torch.minimum(slot[None, :], query_lens[:, None] - 1)
    visible = key_pos[:, None, :] <= query_pos[:, :, None]  # [rows, queries, keys]
    if window is not None:
        visible &= key_pos[:, None, :] > query_pos[:, :, None] - window
    mask = torch.zeros(num_rows, query_len, key_len, dtype=dtype).masked_fill_(~visible, -torch.inf)
    # Heads are the outer batch axis of the gathered K/V: [num_kv_heads * num_rows, ...].
    mask = mask.unsqueeze(0).expand(num_kv_heads, -1, -1, -1).reshape(-1, 1, query_len, key_len)

    query_gather = valid_slots = None
    if any(r.query_len != query_len for r in rows):
        starts = torch.tensor([r.token_start for r in rows])
        valid = slot[None, :] < query_lens[:, None]
        gather = torch.where(valid, starts[:, None] + slot[None, :], starts[:, None])
        query_gather = gather.reshape(-1).to(device)
        valid_slots = valid.reshape(-1).nonzero().squeeze(1).to(device)
    return PagedBucket(
        start,
        end,
        num_rows,
        query_len,
        key_len,
        block_index.to(device),
        mask.to(device),
        query_gather,
        valid_slots,
    )


def _row_blocks(
    rows: Sequence[AttentionRow],
    block_table: torch.Tensor,
    block_size: int,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block ids to gather [rows * blocks], position of each gathered key [rows, keys]).

    Full attention reads every block from the first. A sliding window reads from the block of
    the row's first visible key (first query position - window + 1): a 4K window over a 32K
    context gathers 4K keys, not 32K.
    """
    # Per-row block ranges in Python ints: a handful of rows, and tensor reductions cost more.
    last_blocks = [(r.seq_len - 1) // block_size for r in rows]
    first_blocks = [0] * len(rows)
    if window is not None:
        first_blocks = [max(r.context_len - window + 1, 0) // block_size for r in rows]
    num_blocks = (
        max(last - first for first, last in zip(first_blocks, last_blocks, strict=True)) + 1
    )
    table = block_table[torch.tensor([r.request_index for r in rows])]
    first_block = torch.tensor(first_blocks)
    columns = first_block[:, None] + torch.arange(num_blocks)[None, :]  # [rows, blocks]
    width = max(first_blocks) + num_blocks
    if table.shape[1] < width:
        table = F.pad(table, (0, width - table.shape[1]))
    block_index = table.gather(1, columns).reshape(-1)
    key_pos = (first_block * block_size)[:, None] + torch.arange(num_blocks * block_size)[None, :]
    return block_index, key_pos


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
