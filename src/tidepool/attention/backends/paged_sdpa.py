"""The `paged_sdpa` decoder backend: torch SDPA per bucket of rows over gathered cache blocks
(paged.py), and on CPU the in-place decode kernel (cpu_paged_decode.py) for rows of a few
queries. Its builder plans the rows and buckets (paged_metadata.py) from the neutral step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from tidepool.attention import cpu_decoder_ops, cpu_paged_decode, paged
from tidepool.attention.abstract import AttentionSpec, DecoderAttentionBackend
from tidepool.attention.common import AttentionMetadataBuilder, CommonAttentionMetadata
from tidepool.attention.paged_metadata import (
    AttentionRow,
    PagedAttentionMetadata,
    build_group_metadata,
    causal_row_max_len,
    output_rows_of,
    plan_buckets,
    split_decode_rows,
    split_rows,
)
from tidepool.kv_cache.spec import KVCacheSpec

CAUSAL_MAX_PAD_FRACTION = 0.25
"""Attention buckets of a causal step may pad up to this share of their (queries x keys) area."""


class PagedSdpaBackend(DecoderAttentionBackend):
    name = "paged_sdpa"

    @classmethod
    def supports(cls, spec: AttentionSpec) -> bool:
        if spec.device.type == "cpu":
            cpu_decoder_ops.load()  # its KV-cache write: built now, not inside the first step
        return True  # torch ops on any device and dtype

    def metadata_builder(self, specs, device):
        return PagedSdpaBuilder(specs, device)

    def kv_cache_shape(self, num_blocks: int, spec: KVCacheSpec) -> tuple[int, ...]:
        return paged.head_major_shape(num_blocks, spec)

    def paged_attention(self, query, key, value, kv_cache, meta, scale, softcap=None):
        return paged.paged_attention(query, key, value, kv_cache, meta, scale, softcap)


PAGED_SDPA = PagedSdpaBackend()


class _RowPlan(NamedTuple):
    rows: list[AttentionRow]
    """Rows for the SDPA buckets."""
    spans: list[tuple[int, int]]
    decode_rows: list[AttentionRow]
    """Rows for the in-place kernel."""


class PagedSdpaBuilder(AttentionMetadataBuilder[PagedAttentionMetadata]):
    """Rows, buckets, masks and block gathers of a causal step (paged_metadata.py)."""

    def __init__(
        self,
        specs: Sequence[KVCacheSpec],
        device: torch.device,
        max_pad_fraction: float = CAUSAL_MAX_PAD_FRACTION,
    ) -> None:
        self.specs = tuple(specs)
        self.max_pad_fraction = max_pad_fraction
        self.causal_max_len = causal_row_max_len(self.specs)
        self.in_place_decode_len = 0
        """Rows of at most this many queries read the KV cache in place (0: every row in SDPA
        buckets): cpu_paged_decode.max_query_len where its kernel runs every view's cache."""
        if all(cpu_paged_decode.supports(device, s.dtype, s.head_size) for s in self.specs):
            self.in_place_decode_len = min(
                cpu_paged_decode.max_query_len(s.head_size) for s in self.specs
            )

    def build(self, common: CommonAttentionMetadata) -> PagedAttentionMetadata:
        context_lens, query_lens = common.context_lens, common.query_lens
        rows = split_rows(context_lens, query_lens, causal_max_len=self.causal_max_len)
        plans = [self._plan_rows(rows)]
        out_tokens: list[int] = []
        if common.output_seqs is not None:
            out_tokens, out_rows = output_rows_of(context_lens, query_lens, common.output_seqs)
            plans.append(self._plan_rows(out_rows))
        assert common.token_seq is not None and common.positions is not None
        tables_i32: dict[int, torch.Tensor | None] = {}
        for group in common.kv_groups:  # one int32 copy per table (views may share one)
            if id(group.block_table) not in tables_i32:
                table = group.block_table
                tables_i32[id(table)] = table.to(torch.int32) if self.in_place_decode_len else None
        groups = [
            tuple(
                build_group_metadata(
                    plan.rows,
                    plan.spans,
                    group.block_table,
                    common.token_seq,
                    common.positions,
                    group.spec,
                    common.dtype,
                    common.device,
                    plan.decode_rows,
                    tables_i32[id(group.block_table)],
                    slot_mapping=group.slot_mapping,
                )
                for group in common.kv_groups
            )
            for plan in plans
        ]
        reads_outputs = common.output_seqs is not None
        return PagedAttentionMetadata(
            common.num_tokens,
            groups[0],
            common.layer_groups,
            torch.tensor(out_tokens, dtype=torch.int64).to(common.device)
            if reads_outputs
            else None,
            groups[1] if reads_outputs else (),
        )

    def _plan_rows(self, rows: list[AttentionRow]) -> _RowPlan:
        bucketed, in_place = split_decode_rows(rows, self.in_place_decode_len)
        spec = self.specs[0]
        spans = plan_buckets(bucketed, spec.block_size, spec.num_kv_heads, self.max_pad_fraction)
        return _RowPlan(bucketed, spans, in_place)
