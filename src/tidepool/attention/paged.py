"""Causal attention over the paged KV cache, on torch ops (CPU and CUDA): the kernels and the
cache tensors. What each step attends to is planned in paged_metadata.py.

KV cache of one layer, head-major inside each KV-cache tensor:

    kv_cache [2, num_kv_heads, num_blocks, block_size, head_size]     (K = [0], V = [1])

Block b of the layer is the slice [:, :, b]. On CPU, rows of a few queries (decodes) read their
blocks in place (cpu_paged_decode.py, where it builds); elsewhere, and for the SDPA buckets, a
step gathers each request's blocks with one
`index_select` along the block axis of a [2 * num_kv_heads, num_blocks, block_size * head_size]
view: contiguous rows of block_size * head_size values, and the result is already the
[heads * seqs, keys, head_size] layout that attention wants. The page-major layout [num_blocks,
2, heads, block_size, head_size] needs a second copy to bring heads forward and measured about
twice as slow (docs/performance.md, 'Choices elsewhere in the code').
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tidepool.attention import cpu_decoder_ops, cpu_paged_decode
from tidepool.attention.paged_metadata import GroupAttentionMetadata, PagedBucket
from tidepool.kv_cache.spec import KVCacheConfig, KVCacheSpec


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key, value: [num_tokens, num_kv_heads, head_size] → their slots in kv_cache."""
    # On CPU one copy per (token, head) row in tidepool's kernel: index_put_ took 1% of a pass.
    if cpu_decoder_ops.write_kv(kv_cache, key, value, slot_mapping):
        return
    _, num_kv_heads, num_blocks, block_size, head_size = kv_cache.shape
    slots = kv_cache.view(2, num_kv_heads, num_blocks * block_size, head_size)
    # Advanced-index assignment (index_put_) beats index_copy_ here (docs/performance.md, 'Choices elsewhere in the code').
    slots[0][:, slot_mapping] = key.transpose(0, 1)
    slots[1][:, slot_mapping] = value.transpose(0, 1)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: GroupAttentionMetadata,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """query [T, Hq, D], key / value [T, Hkv, D] of this step's tokens → [T, Hq * D].

    Writes this step's K/V into the cache first, then each bucket reads every key it needs
    (earlier chunks, prefix-cache hits and this step's tokens alike) from the cache; the rows of
    `meta.decode` (a few queries each) read their keys from the cache blocks in place
    (cpu_paged_decode.py), no gather.
    `softcap` (Gemma 2): scores become softcap * tanh(scores / softcap) before the mask and the
    softmax; SDPA has no such hook, so capped layers take an explicit matmul-softmax-matmul path.
    """
    write_kv(kv_cache, key, value, meta.slot_mapping)
    num_tokens, num_heads, head_size = query.shape
    if len(meta.buckets) == 1 and meta.decode is None:
        return _attend(query, key, value, kv_cache, meta.buckets[0], scale, softcap)
    out = query.new_empty(num_tokens, num_heads * head_size)
    if meta.decode is not None:
        rows = meta.decode
        cpu_paged_decode.paged_decode(
            query,
            kv_cache,
            rows.block_table,
            rows.seq_lens,
            rows.query_starts,
            rows.query_lens,
            rows.window,
            scale,
            softcap,
            out,
        )
    for bucket in meta.buckets:
        out[bucket.start : bucket.end] = _attend(
            query, key, value, kv_cache, bucket, scale, softcap
        )
    return out


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    bucket: PagedBucket,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    if bucket.causal:
        return _attend_causal_rows(query, key, value, bucket, scale, softcap)
    return _attend_bucket(query, kv_cache, bucket, scale, softcap)


def _attend_causal_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bucket: PagedBucket,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Whole prompts of one length from position 0: SDPA with `is_causal` on views of this
    step's q / k / v, [rows, heads, L, D] with the token stride of the packed tensors (no copy).
    SDPA's CPU output is [rows, L, heads, D] in memory, so the final reshape is free too."""
    rows, q_len = bucket.num_rows, bucket.query_len
    num_heads, num_kv_heads, head_size = query.shape[1], key.shape[1], query.shape[2]
    span = slice(bucket.start, bucket.end)
    q = query[span].view(rows, q_len, num_heads, head_size).transpose(1, 2)
    k = key[span].view(rows, q_len, num_kv_heads, head_size).transpose(1, 2)
    v = value[span].view(rows, q_len, num_kv_heads, head_size).transpose(1, 2)
    if softcap is None:
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
    else:
        group = num_heads // num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        mask = torch.full((q_len, q_len), -torch.inf, dtype=q.dtype, device=q.device).triu_(1)
        o = _sdpa(q, k, v, mask, scale, softcap)
    return o.transpose(1, 2).reshape(rows * q_len, num_heads * head_size)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """SDPA with K/V heads broadcast over q's head axis (k, v: [N, 1, keys, D]); with `softcap`,
    the same on explicit ops, in transformers' eager order: scale, cap, mask, float32 softmax."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    # q [N, G, Q, D] @ k^T [N, 1, D, K] → scores [N, G, Q, K]; the mask [N, 1, Q, K] broadcasts.
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale / softcap).tanh_().mul_(softcap)
    probs = torch.softmax(scores.add_(mask), dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _attend_bucket(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    bucket: PagedBucket,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    _, num_kv_heads, num_blocks, block_size, head_size = kv_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    rows, q_len, k_len = bucket.num_rows, bucket.query_len, bucket.key_len
    assert bucket.block_index is not None and bucket.mask is not None
    pages = kv_cache.view(2 * num_kv_heads, num_blocks, block_size * head_size)
    # [2 * Hkv, rows * blocks, block_size * D] → K, V: [Hkv * rows, 1, keys, D]
    kv = pages.index_select(1, bucket.block_index).view(2, num_kv_heads * rows, 1, k_len, head_size)
    if bucket.query_gather is None:
        q = query[bucket.start : bucket.end]
    else:
        q = query.index_select(0, bucket.query_gather)
    q = q.view(rows, q_len, num_kv_heads, group, head_size)
    if q_len == 1:
        # Decode: the `group` query heads of a KV head act as `group` queries of one head.
        q = q.view(rows, num_kv_heads, group, head_size).transpose(0, 1)
        q = q.reshape(num_kv_heads * rows, 1, group, head_size)
        o = _sdpa(q, kv[0], kv[1], bucket.mask, scale, softcap)
        return (
            o.view(num_kv_heads, rows, num_heads * head_size // num_kv_heads)
            .transpose(0, 1)
            .reshape(rows, num_heads * head_size)
        )
    q = q.permute(2, 0, 3, 1, 4).reshape(num_kv_heads * rows, group, q_len, head_size)
    o = _sdpa(q, kv[0], kv[1], bucket.mask, scale, softcap)
    # [Hkv * rows, group, q_len, D] → [rows * q_len, Hq * D]
    o = o.view(num_kv_heads, rows, group, q_len, head_size).permute(1, 3, 0, 2, 4)
    o = o.reshape(rows * q_len, num_heads * head_size)
    if bucket.valid_slots is not None:
        o = o.index_select(0, bucket.valid_slots)
    return o


# ----------------------------------------------------------------------------- cache tensors


def head_major_shape(num_blocks: int, spec: KVCacheSpec) -> tuple[int, ...]:
    """This module's layout (the module docstring): [2, num_kv_heads, num_blocks, block_size,
    head_size]."""
    return (2, spec.num_kv_heads, num_blocks, spec.block_size, spec.head_size)


def allocate_kv_caches(
    kv_config: KVCacheConfig,
    layer_specs: dict[str, KVCacheSpec | None],
    device: torch.device,
    cache_shape: Callable[[int, KVCacheSpec], tuple[int, ...]] = head_major_shape,
) -> dict[str, torch.Tensor]:
    """One zeroed buffer per KV-cache tensor slot; each layer sharing it gets a view of the
    shape its backend lays the cache out in (`cache_shape(num_blocks, spec)`: the decoder
    backend's kv_cache_shape; the paged SDPA backend's is head_major_shape).

    Layers that share a buffer must agree on num_kv_heads and head_size bytes, so that block b is
    the same bytes in every view (true for the hybrid models we know: Gemma 2/3, GPT-OSS).
    """
    caches: dict[str, torch.Tensor] = {}
    num_blocks = kv_config.num_blocks
    for tensor in kv_config.tensors:
        buffer = _zeroed_bytes(tensor.size_bytes, device)
        shapes = set()
        for name in tensor.shared_by:
            spec = layer_specs[name]
            assert spec is not None
            row = (spec.num_kv_heads, spec.head_size * spec.dtype.itemsize)
            shapes.add(row)
            if len(shapes) > 1 or spec.page_size_bytes != kv_config.page_size_bytes:
                raise NotImplementedError(
                    f"layers {tensor.shared_by} share a KV-cache tensor but differ in KV heads or "
                    "head size; the head-major layout needs them equal"
                )
            caches[name] = buffer.view(spec.dtype).view(cache_shape(num_blocks, spec))
    return caches


def _zeroed_bytes(num_bytes: int, device: torch.device) -> torch.Tensor:
    # Zeroed now, not lazily (calloc): a page's first write costs a page fault plus zeroing,
    # which made KV writes many times slower until the block pool had cycled through the whole
    # cache. Paying it at start-up keeps step times steady (vLLM does the same; figures in
    # docs/performance.md, 'Choices elsewhere in the code').
    return torch.zeros(num_bytes, dtype=torch.uint8, device=device)
