"""Hybrid models: a full-attention and a sliding-window group drawing from one pool; the hit is the
longest prefix every group serves; the uniform switch as the baseline."""

from __future__ import annotations

import torch

from tidepool.kv_cache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheManager,
    SlidingWindowSpec,
    group_layers,
    plan_kv_cache,
)
from tidepool.kv_cache.hashing import update_block_hashes
from tidepool.params import PoolingParams
from tidepool.request import Request

BLOCK_SIZE = 4
FULL = FullAttentionSpec(BLOCK_SIZE, 1, 8, torch.float32)
SLIDING = SlidingWindowSpec(BLOCK_SIZE, 1, 8, torch.float32, sliding_window=8)
LAYERS = {"full.0": FULL, "swa.0": SLIDING}


def _manager(num_blocks: int = 21) -> KVCacheManager:
    """Group 0 = full attention, group 1 = sliding window; blocks 1..20 shared."""
    return KVCacheManager(KVCacheConfig(num_blocks, tuple(group_layers(LAYERS))))


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, PoolingParams())


def _step(kv: KVCacheManager, request: Request, num_new_tokens: int) -> tuple[list[int], ...]:
    new_blocks = kv.allocate_slots(request, num_new_tokens)
    assert new_blocks is not None
    request.num_computed_tokens += num_new_tokens
    return new_blocks.get_block_ids()


def test_groups_draw_from_one_pool() -> None:
    kv = _manager()
    assert [type(manager.spec) for manager in kv.managers] == [FullAttentionSpec, SlidingWindowSpec]
    assert _step(kv, _request("a", list(range(20))), 20) == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    assert kv.get_num_free_blocks() == 10


def test_hit_is_the_longest_prefix_both_groups_serve() -> None:
    kv = _manager()
    a = _request("a", list(range(20)))
    assert _step(kv, a, 8) == ([1, 2], [3, 4])
    assert _step(kv, a, 8) == ([5, 6], [7, 8])
    assert _step(kv, a, 4) == ([9], [10])  # sliding blocks 4, 3 (tokens 0-7) freed first
    assert kv.get_block_ids("a") == ([1, 2, 5, 6, 9], [0, 0, 7, 8, 10])
    assert kv.block_pool.free_queue.block_ids() == [*range(11, 21), 4, 3]
    # x takes every free block, evicting the cached sliding blocks 3 and 4 (a's tokens 0-7).
    assert _step(kv, _request("x", list(range(500, 524))), 24) == (
        [11, 12, 13, 14, 15, 16],
        [17, 18, 19, 20, 4, 3],
    )

    # Full attention alone would serve 8 tokens; the sliding group lost the window before token 8.
    b = _request("b", list(range(8)) + [900, 901, 902, 903])
    hit = kv.get_computed_blocks(b)
    assert hit.num_computed_tokens == 0 and hit.blocks.get_block_ids() == ([], [])
    # Up to token 16 both serve: the sliding group needs only tokens 8-15 (blocks 7, 8).
    c = _request("c", list(range(16)) + [900, 901, 902, 903])
    hit = kv.get_computed_blocks(c)
    assert hit.num_computed_tokens == 16
    assert hit.blocks.get_block_ids() == ([1, 2, 5, 6], [0, 0, 7, 8])

    assert kv.allocate_slots(c, 4, hit.blocks) is None  # the pool is empty
    assert [kv.block_pool.blocks[i].ref_cnt for i in (1, 2, 5, 6, 7, 8)] == [1] * 6
    assert kv.get_block_ids("c") == ([], [])

    kv.free(a)  # full blocks last-first, then the sliding ones (the null block is skipped)
    assert kv.block_pool.free_queue.block_ids() == [9, 6, 5, 2, 1, 10, 8, 7]
    hit = kv.get_computed_blocks(c)
    new_blocks = kv.allocate_slots(c, 4, hit.blocks)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([9], [10])
    assert kv.get_block_ids("c") == ([1, 2, 5, 6, 9], [0, 0, 7, 8, 10])


def test_two_sliding_windows_iterate_to_a_common_hit() -> None:
    wide = SlidingWindowSpec(BLOCK_SIZE, 1, 8, torch.float32, sliding_window=8)  # needs 2 blocks
    narrow = SlidingWindowSpec(BLOCK_SIZE, 1, 8, torch.float32, sliding_window=4)  # needs 1
    groups = (KVCacheGroup(wide, ("wide.0",)), KVCacheGroup(narrow, ("narrow.0",)))
    kv = KVCacheManager(KVCacheConfig(21, groups))
    request = _request("r", list(range(24)))
    hashes = update_block_hashes(request, BLOCK_SIZE)
    pool = kv.block_pool
    for group_id, block_indices in ((0, (0, 2, 3)), (1, (0, 2, 4))):
        for block_index, block in zip(block_indices, pool.get_new_blocks(3), strict=True):
            table = [pool.null_block] * len(hashes)
            table[block_index] = block
            pool.cache_full_blocks(hashes, table, block_index, block_index + 1, group_id)
    # wide alone: 4 blocks (2, 3 cached); narrow alone: 5 (4 cached). Together: narrow at 4 -> 3;
    # wide at 3 needs blocks 1 and 2, block 1 is missing -> only the run at block 0 -> 1; narrow at
    # 1 -> 1. Wide block ids 1, 2, 3 hold blocks 0, 2, 3; narrow ids 4, 5, 6 hold blocks 0, 2, 4.
    hit = kv.get_computed_blocks(request)
    assert hit.num_computed_tokens == 4
    assert hit.blocks.get_block_ids() == ([1], [4])


def test_uniform_switch_keeps_every_block_hybrid_keeps_the_window() -> None:
    page = FULL.page_size_bytes
    peaks = {}
    for uniform in (False, True):
        config = plan_kv_cache(
            group_layers(LAYERS, uniform=uniform), kv_cache_memory_bytes=64 * page
        )
        kv = KVCacheManager(config)
        request = _request("r", list(range(40)))
        peak_bytes = 0
        for _ in range(5):  # chunked prefill, 8 tokens a step
            _step(kv, request, 8)
            num_used_blocks = config.num_blocks - 1 - kv.get_num_free_blocks()
            peak_bytes = max(peak_bytes, num_used_blocks * config.bytes_per_block)
        peaks[uniform] = (config.num_blocks, peak_bytes // page)
        if uniform:
            assert kv.get_block_ids("r") == (list(range(1, 11)),)
        else:
            # Each step frees the two sliding blocks that left the window, then takes 2 + 2.
            assert kv.get_block_ids("r") == (
                [1, 2, 5, 6, 9, 10, 13, 14, 17, 18],
                [0, 0, 0, 0, 0, 0, 15, 16, 19, 20],
            )
    # Hybrid: 10 full blocks + 4 window blocks of 1 page; uniform: 10 blocks of 2 pages.
    assert peaks == {False: (64, 14), True: (32, 20)}
