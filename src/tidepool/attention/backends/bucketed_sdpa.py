"""The `bucketed_sdpa` encoder backend: torch SDPA per bucket of similar lengths
(torch_backend.py), on the padded layout (metadata.pad_buckets); runs wherever torch runs."""

from __future__ import annotations

from tidepool.attention import torch_backend
from tidepool.attention.abstract import AttentionSpec, EncoderAttentionBackend
from tidepool.attention.metadata import ENCODER_BUCKETS


class BucketedSdpaBackend(EncoderAttentionBackend):
    name = "bucketed_sdpa"
    packed_layout = False

    @classmethod
    def supports(cls, spec: AttentionSpec) -> bool:
        return True  # torch ops on any device and dtype

    def metadata_builder(self):
        return ENCODER_BUCKETS

    def attend(self, qkv, meta, scale, bias=None):
        return torch_backend.encoder_attention(qkv, meta, scale, bias)

    def attend_first_tokens(self, qkv, meta, scale, bias=None):
        return torch_backend.encoder_attention_first_tokens(qkv, meta, scale, bias)

    def attend_heads(self, q, k, v, meta, scale):
        return torch_backend.encoder_attention_heads(q, k, v, meta, scale)


BUCKETED_SDPA = BucketedSdpaBackend()
