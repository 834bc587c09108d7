"""BlockPool: null block, allocation order, LRU free queue, touch, caching, eviction (exact ids)."""

from __future__ import annotations

import pytest

from tidepool.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from tidepool.kv_cache.hashing import hash_block_tokens

GROUP = 0


def _hashes(num_blocks: int, block_size: int = 4) -> list:
    hashes, parent = [], None
    for block_index in range(num_blocks):
        start = block_index * block_size
        parent = hash_block_tokens(parent, list(range(start, start + block_size)))
        hashes.append(parent)
    return hashes


def _ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def test_fresh_pool_reserves_null_block_and_allocates_in_order() -> None:
    pool = BlockPool(num_blocks=6, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 5
    assert pool.free_queue.block_ids() == [1, 2, 3, 4, 5]
    blocks = pool.get_new_blocks(3)
    assert _ids(blocks) == [1, 2, 3]
    assert [block.ref_cnt for block in blocks] == [1, 1, 1]
    assert pool.get_num_free_blocks() == 2
    assert pool.usage == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="asked for 3 blocks, 2 free"):
        pool.get_new_blocks(3)


def test_freed_blocks_go_to_tail_in_given_order() -> None:
    pool = BlockPool(num_blocks=6, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))  # a request frees its last block first
    assert pool.free_queue.block_ids() == [4, 5, 3, 2, 1]
    assert _ids(pool.get_new_blocks(3)) == [4, 5, 3]


def test_shared_block_is_freed_only_at_ref_cnt_zero() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.free_queue.block_ids() == [2, 3]
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.free_queue.block_ids() == [2, 3, 1]
    with pytest.raises(ValueError, match="double free of block 1"):
        pool.free_blocks([block])


def test_touch_takes_a_free_cached_block_out_of_the_queue() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    hashes = _hashes(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(hashes, blocks, 0, 2, GROUP)
    pool.free_blocks(reversed(blocks))
    assert pool.free_queue.block_ids() == [3, 4, 2, 1]
    hit = pool.get_cached_block(hashes[1], GROUP)
    assert hit is blocks[1]
    pool.touch([pool.null_block, hit])
    assert hit.ref_cnt == 1 and pool.null_block.ref_cnt == 0
    assert pool.free_queue.block_ids() == [3, 4, 1]


def test_reusing_a_cached_block_evicts_its_hash() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    hashes = _hashes(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(hashes, blocks, 0, 2, GROUP)
    pool.free_blocks(reversed(blocks))  # queue: [2, 1]
    assert pool.num_cached_blocks == 2
    (reused,) = pool.get_new_blocks(1)
    assert reused.block_id == 2 and reused.block_hash is None
    assert pool.get_cached_block(hashes[1], GROUP) is None
    assert pool.get_cached_block(hashes[0], GROUP) is blocks[0]
    assert pool.num_cached_blocks == 1


def test_cache_full_blocks_skips_null_hits_and_duplicates() -> None:
    pool = BlockPool(num_blocks=6, enable_caching=True)
    hashes = _hashes(3)
    first = pool.get_new_blocks(2)
    pool.cache_full_blocks(hashes, first, 0, 2, GROUP)
    # A second request holding the same tokens in other blocks: the first block stays the cached one.
    second = [pool.null_block, *pool.get_new_blocks(2)]
    pool.cache_full_blocks(hashes, second, 0, 3, GROUP)
    assert pool.get_cached_block(hashes[1], GROUP) is first[1]
    assert second[1].block_hash is None
    assert pool.get_cached_block(hashes[2], GROUP) is second[2]
    assert pool.null_block.block_hash is None
    # The same hash in another group is another block.
    assert pool.get_cached_block(hashes[0], group_id=1) is None


def test_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(_hashes(2), blocks, 0, 2, GROUP)
    assert pool.num_cached_blocks == 0 and blocks[0].block_hash is None


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    hashes = _hashes(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(hashes, blocks, 0, 2, GROUP)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and pool.get_cached_block(hashes[0], GROUP) is None
    assert all(block.block_hash is None for block in blocks)


def test_free_queue_remove_head_middle_tail() -> None:
    blocks = [KVCacheBlock(block_id) for block_id in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[0])
    queue.remove(blocks[2])
    queue.remove(blocks[4])
    assert queue.block_ids() == [1, 3] and queue.num_free_blocks == 2
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[2])
    queue.append(blocks[2])
    assert queue.popleft() is blocks[1]
    assert queue.block_ids() == [3, 2]


def test_pool_needs_a_block_besides_the_null_block() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(num_blocks=1, enable_caching=True)
