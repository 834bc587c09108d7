"""Bidirectional attention over a packed batch on torch ops (CPU and CUDA).

Measured on the 2-core CPU (MiniLM shapes: 12 heads of 32, a bucket of 48 sequences of ~86
tokens): PyTorch's CPU flash SDPA 6.7 ms, per-sequence SDPA calls far more, and three batched
GEMM-sized ops (scaled QK^T with the padding mask added inside baddbmm, softmax, PV) 4.5 ms, so
short buckets use the explicit form. Its scores are float32 for bfloat16 inputs too: softmax in
bfloat16 is both slower on this CPU and less accurate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidepool.attention.metadata import AttentionBucket, EncoderAttentionMetadata


def encoder_attention(
    qkv: torch.Tensor, meta: EncoderAttentionMetadata, scale: float
) -> torch.Tensor:
    """qkv: [num_tokens, 3, num_heads, head_dim] → [num_tokens, num_heads * head_dim].

    Each sequence attends to itself only (cu_seqlens), in both directions.
    """
    num_tokens, _, num_heads, head_dim = qkv.shape
    if len(meta.buckets) == 1:
        return _attend_bucket(qkv, meta.buckets[0], scale)
    out = qkv.new_empty(num_tokens, num_heads * head_dim)
    for bucket in meta.buckets:
        out[bucket.start : bucket.end] = _attend_bucket(qkv, bucket, scale)
    return out


# Buckets up to this length use the explicit form; longer ones SDPA, whose streaming softmax
# stays in cache when the [max_len, max_len] score matrices would not.
EXPLICIT_MAX_LEN = 128


def _attend_bucket(qkv: torch.Tensor, bucket: AttentionBucket, scale: float) -> torch.Tensor:
    _, _, num_heads, head_dim = qkv.shape
    num_seqs, max_len = bucket.num_seqs, bucket.max_len
    if bucket.gather_index is None:
        padded = qkv[bucket.start : bucket.end]
    else:
        padded = qkv.index_select(0, bucket.gather_index)
    # [num_seqs * max_len, 3, H, D] → [3, num_seqs, H, max_len, D]
    qkv_heads = padded.view(num_seqs, max_len, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
    if max_len <= EXPLICIT_MAX_LEN:
        o = _explicit(qkv_heads, bucket, scale)
    else:
        q, k, v = qkv_heads.unbind(0)
        mask = None
        if bucket.key_bias is not None:
            mask = bucket.key_bias.view(num_seqs, num_heads, 1, max_len)[:, :1].to(q.dtype)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    # o: [num_seqs, H, max_len, D] → [num_seqs * max_len, H * D]
    o = o.transpose(1, 2).reshape(num_seqs * max_len, num_heads * head_dim)
    if bucket.valid_slots is not None:
        o = o.index_select(0, bucket.valid_slots)
    return o


def _explicit(qkv_heads: torch.Tensor, bucket: AttentionBucket, scale: float) -> torch.Tensor:
    _, num_seqs, num_heads, max_len, head_dim = qkv_heads.shape
    batch = num_seqs * num_heads
    # One copy makes q, k and v contiguous [num_seqs * H, max_len, D] for the batched GEMMs.
    q, k, v = qkv_heads.contiguous().view(3, batch, max_len, head_dim).unbind(0)
    if bucket.key_bias is None:
        scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale)
    else:
        bias = bucket.key_bias if q.dtype == torch.float32 else bucket.key_bias.to(q.dtype)
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)  # [num_seqs * H, L, L]
    if probs.dtype != v.dtype:
        probs = probs.to(v.dtype)
    return torch.bmm(probs, v).view(num_seqs, num_heads, max_len, head_dim)
