"""A toy attention backend written the way a new one is added: this one module, plus one registry
entry (`register_encoder_backend` / `register_decoder_backend`, attention/backend.py).

It attends each sequence on its own, accumulating in float64: a reference, not a fast path. It
owns its metadata (built from the runner's neutral step description, attention/common.py) and
its KV-cache layout, which is page-major ([num_blocks, block_size, 2, num_kv_heads, head_size]),
unlike the paged SDPA backend's head-major one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tidepool.attention.abstract import (
    AttentionSpec,
    DecoderAttentionBackend,
    EncoderAttentionBackend,
)
from tidepool.attention.common import AttentionMetadataBuilder, CommonAttentionMetadata, LayerRows
from tidepool.kv_cache.spec import KVCacheSpec, SlidingWindowSpec


def _attend_one(q, k, v, scale, visible=None, softcap=None):
    """q [Q, Hq, D], k / v [K, Hkv, D] → [Q, Hq * D] in q's dtype, float64 inside."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (
        q.double(),
        k.double().repeat_interleave(group, 1),
        v.double().repeat_interleave(group, 1),
    )
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out.reshape(out.shape[0], -1)


# ----------------------------------------------------------------------------- encoder


@dataclass(frozen=True)
class EncoderSteps:
    """This backend's encoder metadata: each sequence's start, length and key count; the
    layers run on the packed tokens (rows), which the models read with seq_lens."""

    rows: LayerRows
    starts: list[int]
    seq_lens: list[int]
    key_lens: list[int]


class EncoderStepsBuilder(AttentionMetadataBuilder[EncoderSteps]):
    def build(self, common: CommonAttentionMetadata) -> EncoderSteps:
        starts = common.query_start_loc.tolist()
        keys = common.key_lens or common.seq_lens
        rows = LayerRows.packed(common.query_start_loc.to(common.device))
        return EncoderSteps(rows, starts[:-1], common.seq_lens, keys)


class ReferenceEncoderBackend(EncoderAttentionBackend):
    name = "reference_float64"
    # provides nothing beyond the kernel calls: a model that needs more is refused

    @classmethod
    def supports(cls, spec: AttentionSpec) -> bool:
        return True

    def metadata_builder(self) -> EncoderStepsBuilder:
        return EncoderStepsBuilder()

    def attend_heads(self, q, k, v, meta, scale, first_token_only=False):
        out = []
        for start, n, keys in zip(meta.starts, meta.seq_lens, meta.key_lens, strict=True):
            queries = q[start : start + (1 if first_token_only else n)]
            kv = slice(start, start + keys)
            out.append(_attend_one(queries, k[kv], v[kv], scale).to(q.dtype))
        return torch.cat(out)

    def attend(self, qkv, meta, scale, bias=None):
        _no_bias(bias)
        q, k, v = qkv.unbind(1)
        return self.attend_heads(q, k, v, meta, scale)

    def attend_first_tokens(self, qkv, meta, scale, bias=None):
        _no_bias(bias)
        q, k, v = qkv.unbind(1)
        return self.attend_heads(q, k, v, meta, scale, first_token_only=True)


def _no_bias(bias) -> None:
    if bias is not None:
        raise NotImplementedError("the reference backend takes no relative position bias")


# ----------------------------------------------------------------------------- decoder


@dataclass(frozen=True)
class SeqRows:
    """One view's attention for the step: per query row block, which sequence and positions."""

    slot_mapping: torch.Tensor
    query_starts: list[int]
    query_lens: list[int]
    first_positions: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor
    window: int | None


@dataclass(frozen=True)
class DecoderSteps:
    num_tokens: int
    groups: tuple[SeqRows, ...]
    layer_groups: tuple[int, ...]
    output_rows: torch.Tensor | None
    output_groups: tuple[SeqRows, ...]

    def for_layer(self, layer_index: int) -> SeqRows:
        return self.groups[self.layer_groups[layer_index]]

    def for_output_rows(self, layer_index: int) -> SeqRows:
        return self.output_groups[self.layer_groups[layer_index]]


class DecoderStepsBuilder(AttentionMetadataBuilder[DecoderSteps]):
    def build(self, common: CommonAttentionMetadata) -> DecoderSteps:
        loc, seq_lens, query_lens = (
            common.query_start_loc.tolist(),
            common.seq_lens,
            common.query_lens,
        )

        def rows(group, out_only: bool) -> SeqRows:
            window = (
                group.spec.sliding_window if isinstance(group.spec, SlidingWindowSpec) else None
            )
            if not out_only:
                firsts = [s - q for s, q in zip(seq_lens, query_lens, strict=True)]
                return SeqRows(
                    group.slot_mapping,
                    loc[:-1],
                    query_lens,
                    firsts,
                    seq_lens,
                    group.block_table,
                    window,
                )
            marks = common.output_seqs
            picked = [i for i, m in enumerate(marks) if m]
            return SeqRows(
                group.slot_mapping,
                list(range(len(picked))),
                [1] * len(picked),
                [seq_lens[i] - 1 for i in picked],
                [seq_lens[i] for i in picked],
                group.block_table[picked],
                window,
            )

        groups = tuple(rows(g, False) for g in common.kv_groups)
        if common.output_seqs is None:
            return DecoderSteps(common.num_tokens, groups, common.layer_groups, None, ())
        last = [loc[i + 1] - 1 for i, m in enumerate(common.output_seqs) if m]
        return DecoderSteps(
            common.num_tokens,
            groups,
            common.layer_groups,
            torch.tensor(last, dtype=torch.int64, device=common.device),
            tuple(rows(g, True) for g in common.kv_groups),
        )


class ReferenceDecoderBackend(DecoderAttentionBackend):
    name = "reference_float64"

    @classmethod
    def supports(cls, spec: AttentionSpec) -> bool:
        return True

    def metadata_builder(self, specs: Sequence[KVCacheSpec], device: torch.device):
        return DecoderStepsBuilder()

    def kv_cache_shape(self, num_blocks: int, spec: KVCacheSpec) -> tuple[int, ...]:
        return (num_blocks, spec.block_size, 2, spec.num_kv_heads, spec.head_size)

    def paged_attention(self, query, key, value, kv_cache, meta, scale, softcap=None):
        num_blocks, block_size, _, num_kv_heads, head_size = kv_cache.shape
        slots = kv_cache.view(num_blocks * block_size, 2, num_kv_heads, head_size)
        slots[meta.slot_mapping] = torch.stack((key, value), 1)
        out = []
        for r, (start, q_len, first, seq_len) in enumerate(
            zip(
                meta.query_starts, meta.query_lens, meta.first_positions, meta.seq_lens, strict=True
            )
        ):
            key_pos = torch.arange(seq_len)
            kv = slots[
                meta.block_table[r, key_pos // block_size] * block_size + key_pos % block_size
            ]
            query_pos = torch.arange(first, first + q_len)
            visible = key_pos[None, :] <= query_pos[:, None]
            if meta.window is not None:
                visible &= key_pos[None, :] > query_pos[:, None] - meta.window
            q = query[start : start + q_len]
            out.append(_attend_one(q, kv[:, 0], kv[:, 1], scale, visible, softcap).to(query.dtype))
        if not out:  # a step whose requests all go on (no output rows)
            return query.new_empty(0, query.shape[1] * head_size)
        return torch.cat(out)


REFERENCE_ENCODER = ReferenceEncoderBackend()
REFERENCE_DECODER = ReferenceDecoderBackend()
