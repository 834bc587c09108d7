"""One sliding-window group (block_size 4, window 8): which block ids become the null block (0) at
each step of a chunked prefill and a decode, and prefix hits searched from the right."""

from __future__ import annotations

import torch

from tidepool.kv_cache import KVCacheConfig, KVCacheGroup, KVCacheManager, SlidingWindowSpec
from tidepool.kv_cache.group_manager import SlidingWindowManager
from tidepool.kv_cache.hashing import update_block_hashes
from tidepool.params import PoolingParams
from tidepool.request import Request

BLOCK_SIZE = 4
SPEC = SlidingWindowSpec(BLOCK_SIZE, 1, 8, torch.float32, sliding_window=8)


def _manager(num_blocks: int = 11) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_blocks, (KVCacheGroup(SPEC, ("swa.0",)),)))


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, PoolingParams())


def _step(kv: KVCacheManager, request: Request, num_new_tokens: int) -> list[int]:
    new_blocks = kv.allocate_slots(request, num_new_tokens)
    assert new_blocks is not None
    request.num_computed_tokens += num_new_tokens
    return new_blocks.get_block_ids()[0]


def test_chunked_prefill_then_decode_drops_blocks_outside_the_window() -> None:
    kv = _manager()
    request = _request("r", list(range(20)))
    # Token p attends to [p - 7, p]. Before computing from position c, blocks wholly below c - 7
    # are freed and become 0 in the table.
    assert _step(kv, request, 8) == [1, 2]
    assert _step(kv, request, 8) == [3, 4]  # c = 8: token 8 still needs token 1 (block 0)
    assert kv.get_block_ids("r") == ([1, 2, 3, 4],)
    assert _step(kv, request, 4) == [5]  # c = 16: tokens 0-8 dead, blocks 0 and 1 freed
    assert kv.get_block_ids("r") == ([0, 0, 3, 4, 5],)
    assert kv.block_pool.free_queue.block_ids() == [6, 7, 8, 9, 10, 2, 1]
    assert kv.block_pool.num_cached_blocks == 5  # dropped blocks stay cached while free

    decode = [  # (position c of the new token, new block ids, block table after the step)
        (20, [6], [0, 0, 0, 4, 5, 6]),  # tokens <= 12 dead: block 2 (tokens 8-11) freed
        (21, [], [0, 0, 0, 4, 5, 6]),
        (22, [], [0, 0, 0, 4, 5, 6]),
        (23, [], [0, 0, 0, 0, 5, 6]),  # tokens <= 15 dead: block 3 freed
        (24, [7], [0, 0, 0, 0, 5, 6, 7]),
    ]
    for position, new_block_ids, table in decode:
        assert request.num_computed_tokens == position
        request.output_token_ids.append(100 + position)
        assert _step(kv, request, 1) == new_block_ids
        assert kv.get_block_ids("r") == (table,)
    assert kv.block_pool.free_queue.block_ids() == [8, 9, 10, 2, 1, 3, 4]
    kv.free(request)
    assert kv.block_pool.free_queue.block_ids() == [8, 9, 10, 2, 1, 3, 4, 7, 6, 5]


def test_hit_needs_only_the_blocks_inside_the_window_searched_from_the_right() -> None:
    kv = _manager()
    a = _request("a", list(range(20)))
    assert _step(kv, a, 20) == [1, 2, 3, 4, 5]
    kv.free(a)  # all five cached; queue [6 7 8 9 10 5 4 3 2 1]
    b = _request("b", list(range(20)) + [100, 101, 102, 103])
    hit = kv.get_computed_blocks(b)
    # cdiv(window - 1, block_size) = 2 blocks before the hit point; the rest are null.
    assert hit.num_computed_tokens == 20 and hit.blocks.get_block_ids() == ([0, 0, 0, 4, 5],)

    assert _step(kv, _request("x", list(range(500, 524))), 24) == [6, 7, 8, 9, 10, 5]
    hit = kv.get_computed_blocks(b)  # block 5 (tokens 16-19) was evicted: the hit moves left
    assert hit.num_computed_tokens == 16 and hit.blocks.get_block_ids() == ([0, 0, 3, 4],)
    new_blocks = kv.allocate_slots(b, 8, hit.blocks)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([2, 1],)
    assert kv.get_block_ids("b") == ([0, 0, 3, 4, 2, 1],)
    assert kv.get_num_free_blocks() == 0


def test_runs_of_cached_blocks_shorter_than_the_window_do_not_count() -> None:
    kv = _manager(num_blocks=21)
    request = _request("r", list(range(24)))
    hashes = update_block_hashes(request, BLOCK_SIZE)
    pool = kv.block_pool
    blocks = pool.get_new_blocks(6)
    for block_index in (0, 1, 3):  # cached: blocks 0, 1, 3; missing: 2, 4, 5
        pool.cache_full_blocks(hashes, blocks, block_index, block_index + 1, group_id=0)
    manager = kv.managers[0]
    assert isinstance(manager, SlidingWindowManager)
    assert manager.num_hit_blocks_needed == 2

    def hit_ids(max_length: int) -> list[int]:
        return [block.block_id for block in manager.find_longest_cache_hit(hashes, max_length)]

    assert hit_ids(23) == [1, 2]  # block 3 alone is too short a run; 1 and 2 before the gap
    assert hit_ids(8) == [1, 2]
    assert hit_ids(7) == [1]  # a run starting at block 0 needs nothing before it
    assert hit_ids(3) == []


def test_dropping_a_shared_block_only_drops_a_reference() -> None:
    kv = _manager()
    a = _request("a", list(range(16)))
    assert _step(kv, a, 16) == [1, 2, 3, 4]
    b = _request("b", list(range(16)) + [100, 101, 102, 103])
    hit = kv.get_computed_blocks(b)
    assert hit.blocks.get_block_ids() == ([0, 0, 3, 4],)  # b never references blocks 1 and 2
    new_blocks = kv.allocate_slots(b, 4, hit.blocks)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([5],)
    b.num_computed_tokens = 20
    assert [kv.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [1, 1, 2, 2, 1]
    b.output_token_ids.append(7)
    assert _step(kv, b, 1) == [6]  # position 20: block 2 (id 3) leaves b's window
    assert kv.get_block_ids("b") == ([0, 0, 0, 4, 5, 6],)
    assert kv.block_pool.blocks[3].ref_cnt == 1  # still a's
    assert kv.get_block_ids("a") == ([1, 2, 3, 4],)
