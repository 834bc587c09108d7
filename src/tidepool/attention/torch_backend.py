"""Bidirectional attention over a packed batch on torch ops (CPU and CUDA).

Each bucket (sequences of similar length, see metadata.py) is one SDPA call with a key-padding
mask. SDPA for every bucket beat an explicit form (QK^T via baddbmm with the mask fused, float32
softmax, PV) on long buckets (its streaming softmax stays in cache where [len, len] score
matrices do not) and tied on short ones; a per-sequence SDPA loop pays framework overhead per
call (figures: docs/performance.md, 'Choices in the encoder path').

These functions are the `bucketed_sdpa` backend (backends/bucketed_sdpa.py);
`encoder_attention_heads` also runs the sliding-window layers of the transformers backend's
encoders under any backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidepool.attention.metadata import AttentionBucket, EncoderAttentionMetadata
from tidepool.attention.relative_bias import RelativePositionBias


def encoder_attention(
    qkv: torch.Tensor,
    meta: EncoderAttentionMetadata,
    scale: float,
    bias: RelativePositionBias | None = None,
) -> torch.Tensor:
    """qkv: [num_tokens, 3, num_heads, head_dim] → [num_tokens, num_heads * head_dim].

    Each sequence attends to itself only (cu_seqlens), in both directions. On the padded layout
    (metadata.pad_buckets) every bucket is a plain slice and padding slots' outputs are garbage
    that nobody reads. `bias` adds a relative position bias to the scores (a dense mask per
    bucket, made once per step).
    """
    num_tokens, _, num_heads, head_dim = qkv.shape
    if len(meta.buckets) == 1 and meta.buckets[0].valid_slots is None:
        o = _attend_bucket(qkv, meta.buckets[0], scale, bias)
        return o.transpose(1, 2).reshape(num_tokens, num_heads * head_dim)
    out = qkv.new_empty(num_tokens, num_heads * head_dim)
    for bucket in meta.buckets:
        o = _attend_bucket(qkv, bucket, scale, bias)  # [num_seqs, H, max_len, D]
        if bucket.valid_slots is None:
            # One copy, straight into the output rows: [num_seqs, max_len, H, D] ← o^T.
            out[bucket.start : bucket.end].view(
                bucket.num_seqs, bucket.max_len, num_heads, head_dim
            ).copy_(o.transpose(1, 2))
        else:
            rows = o.transpose(1, 2).reshape(bucket.num_seqs * bucket.max_len, -1)
            out[bucket.start : bucket.end] = rows.index_select(0, bucket.valid_slots)
    return out


def encoder_attention_first_tokens(
    qkv: torch.Tensor,
    meta: EncoderAttentionMetadata,
    scale: float,
    bias: RelativePositionBias | None = None,
) -> torch.Tensor:
    """Queries at each sequence's first slot only, keys and values at all its slots.

    qkv: [num_slots, 3, num_heads, head_dim] on a layout whose buckets are plain slices
    (metadata.pad_buckets) → [num_seqs, num_heads * head_dim], in sequence order. Each bucket is
    one SDPA call with q_len 1 and the same key mask as `encoder_attention`, so a sequence's first
    row is the one `encoder_attention` gives it.
    """
    _, _, num_heads, head_dim = qkv.shape
    outs: list[torch.Tensor] = []
    for bucket in meta.buckets:
        assert bucket.gather_index is None, "needs the padded layout (pad_buckets)"
        q, k, v, mask = _bucket_inputs(qkv, bucket, bias)
        if bias is not None:
            mask = mask[:, :, :1]  # type: ignore[index]  # the first query's row
        # q: [num_seqs, H, 1, D] (each sequence's first slot); o: [num_seqs, H, 1, D]
        o = F.scaled_dot_product_attention(q[:, :, :1], k, v, attn_mask=mask, scale=scale)
        outs.append(o.reshape(bucket.num_seqs, num_heads * head_dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def encoder_attention_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: EncoderAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    band_masks: dict[tuple[int, int, bool], torch.Tensor] | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """q: [num_rows, heads, D], k / v: [num_rows, kv_heads, D] (strided views; kv_heads dividing
    heads, broadcast by SDPA) → [num_rows, heads * D], on the padded layout or on packed rows
    (buckets gathered). With `sliding_window` key k is visible to query q when |q - k| <
    sliding_window (ModernBERT's local layers); `causal`: only keys k <= q of the query's own
    sequence (CLIP's text tower, a causal encoder), and with a window 0 <= q - k < sliding_window
    (transformers' causal convention); `band_masks` caches those masks for the step."""
    num_tokens, num_heads, head_dim = q.shape
    buckets = meta.buckets
    if len(buckets) == 1:
        return _attend_bucket_heads(q, k, v, buckets[0], scale, sliding_window, band_masks, causal)
    out = q.new_empty(num_tokens, num_heads * head_dim)
    for bucket in buckets:
        out[bucket.start : bucket.end] = _attend_bucket_heads(
            q, k, v, bucket, scale, sliding_window, band_masks, causal
        )
    return out


def _attend_bucket_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bucket: AttentionBucket,
    scale: float,
    sliding_window: int | None,
    band_masks: dict[tuple[int, int, bool], torch.Tensor] | None,
    causal: bool = False,
) -> torch.Tensor:
    num_seqs, max_len = bucket.num_seqs, bucket.max_len

    def padded(t: torch.Tensor) -> torch.Tensor:
        # [tokens, H, D] → [num_seqs, H, max_len, D]
        if bucket.gather_index is None:
            rows = t[bucket.start : bucket.end]
        else:
            rows = t.index_select(0, bucket.gather_index)
        return rows.view(num_seqs, max_len, t.shape[1], t.shape[2]).transpose(1, 2)

    mask = bucket.key_mask  # [num_seqs, 1, 1, max_len] or None
    if causal or (sliding_window is not None and sliding_window < max_len):
        band = _band_mask(max_len, sliding_window, q.device, band_masks, causal)
        mask = band if mask is None else mask & band
    o = F.scaled_dot_product_attention(
        padded(q),
        padded(k),
        padded(v),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    # [num_seqs, H, max_len, D] → [num_seqs * max_len, H * D]
    o = o.transpose(1, 2).reshape(num_seqs * max_len, -1)
    if bucket.valid_slots is not None:
        o = o.index_select(0, bucket.valid_slots)
    return o


def _band_mask(
    length: int,
    window: int | None,
    device: torch.device,
    cache: dict[tuple[int, int, bool], torch.Tensor] | None,
    causal: bool = False,
) -> torch.Tensor:
    """[length, length] bool, True where |q - k| < window (causal: 0 <= q - k < window, no
    window: 0 <= q - k); made once per step and shape."""
    key = (length, -1 if window is None else window, causal)
    band = None if cache is None else cache.get(key)
    if band is None:
        idx = torch.arange(length, device=device)
        distance = idx[:, None] - idx[None, :]  # q - k
        if causal:
            band = distance >= 0
            if window is not None:
                band &= distance < window
        else:
            assert window is not None
            band = distance.abs() < window
        if cache is not None:
            cache[key] = band
    return band


def _attend_bucket(
    qkv: torch.Tensor,
    bucket: AttentionBucket,
    scale: float,
    bias: RelativePositionBias | None = None,
) -> torch.Tensor:
    """One bucket as a padded batch → [num_seqs, H, max_len, D]."""
    q, k, v, mask = _bucket_inputs(qkv, bucket, bias)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _bucket_inputs(
    qkv: torch.Tensor, bucket: AttentionBucket, bias: RelativePositionBias | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The bucket's q, k, v as [num_seqs, H, max_len, D] views, and its key mask (the additive
    one when it is in qkv's dtype; with `bias`, the bias plus -inf at padding keys)."""
    _, _, num_heads, head_dim = qkv.shape
    num_seqs, max_len = bucket.num_seqs, bucket.max_len
    if bucket.gather_index is None:
        padded = qkv[bucket.start : bucket.end]
    else:
        padded = qkv.index_select(0, bucket.gather_index)
    # [num_seqs * max_len, 3, H, D] → [3, num_seqs, H, max_len, D]
    qkv_heads = padded.view(num_seqs, max_len, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv_heads.unbind(0)
    if bias is not None:
        return q, k, v, bias.with_key_mask(bucket.start, bucket.key_mask, max_len, qkv.dtype)
    mask = bucket.key_mask
    if bucket.key_bias is not None and bucket.key_bias.dtype == qkv.dtype:
        mask = bucket.key_bias
    return q, k, v, mask
