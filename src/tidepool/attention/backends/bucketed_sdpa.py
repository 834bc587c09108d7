"""The `bucketed_sdpa` encoder backend: torch SDPA per bucket of similar lengths
(torch_backend.py); runs wherever torch runs. Its builder lays the step out as padded buckets
(metadata.PaddedBucketsBuilder): the layers run on the slots (`rows`), every bucket a plain
slice, so attention gathers nothing."""

from __future__ import annotations

from tidepool.attention import torch_backend
from tidepool.attention.abstract import (
    BANDED,
    PACKED_BUCKETS,
    PADDED_BUCKETS,
    AttentionSpec,
    EncoderAttentionBackend,
)
from tidepool.attention.metadata import PADDED_BUCKETS_BUILDER, PaddedBucketsBuilder


class BucketedSdpaBackend(EncoderAttentionBackend):
    name = "bucketed_sdpa"
    provides = frozenset({BANDED, PACKED_BUCKETS, PADDED_BUCKETS})

    @classmethod
    def supports(cls, spec: AttentionSpec) -> bool:
        return True  # torch ops on any device and dtype

    def metadata_builder(self) -> PaddedBucketsBuilder:
        return PADDED_BUCKETS_BUILDER

    def attend(self, qkv, meta, scale, bias=None):
        return torch_backend.encoder_attention(qkv, meta, scale, bias)

    def attend_first_tokens(self, qkv, meta, scale, bias=None):
        return torch_backend.encoder_attention_first_tokens(qkv, meta, scale, bias)

    def attend_heads(self, q, k, v, meta, scale):
        return torch_backend.encoder_attention_heads(q, k, v, meta, scale)

    def attend_banded(self, q, k, v, meta, scale, window, causal=False):
        return torch_backend.encoder_attention_heads(
            q, k, v, meta, scale, window, meta.band_masks, causal
        )


BUCKETED_SDPA = BucketedSdpaBackend()
