"""Paged KV-cache bookkeeping: specs and pool sizing, block hashes, the block pool, per-group
managers, and the KVCacheManager facade the scheduler talks to. No tensors live here."""

from __future__ import annotations

from tidepool.kv_cache.block_pool import BlockPool, KVCacheBlock
from tidepool.kv_cache.hashing import BlockHash, hash_block_tokens, update_block_hashes
from tidepool.kv_cache.manager import (
    ComputedBlocks,
    KVCacheBlocks,
    KVCacheManager,
    PrefixCacheStats,
)
from tidepool.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    group_layers,
    plan_kv_cache,
)

__all__ = [
    "BlockHash",
    "BlockPool",
    "ComputedBlocks",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheGroup",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheTensor",
    "PrefixCacheStats",
    "SlidingWindowSpec",
    "group_layers",
    "hash_block_tokens",
    "plan_kv_cache",
    "update_block_hashes",
]
