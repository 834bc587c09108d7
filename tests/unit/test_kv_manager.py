"""KVCacheManager with one full-attention group: exact block ids through prefix hits, sharing,
LRU eviction, failed allocations, chunked prefill, decode, stats."""

from __future__ import annotations

import pytest
import torch

from tidepool.kv_cache import FullAttentionSpec, KVCacheConfig, KVCacheGroup, KVCacheManager
from tidepool.params import PoolingParams
from tidepool.request import Request

BLOCK_SIZE = 4
SPEC = FullAttentionSpec(BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32)


def _manager(num_blocks: int = 11, enable_caching: bool = True) -> KVCacheManager:
    """num_blocks=11: the null block plus 10 usable blocks, 1..10."""
    config = KVCacheConfig(num_blocks, (KVCacheGroup(SPEC, ("layer.0",)),))
    return KVCacheManager(config, enable_caching)


def _request(request_id: str, prompt: list[int], **kwargs: object) -> Request:
    return Request(request_id, prompt, PoolingParams(), **kwargs)  # type: ignore[arg-type]


def _prefill(kv: KVCacheManager, request: Request) -> list[int]:
    """Look up the prefix cache, allocate the whole prompt, mark it computed; new block ids."""
    hit = kv.get_computed_blocks(request)
    num_new_tokens = request.num_tokens - hit.num_computed_tokens
    new_blocks = kv.allocate_slots(request, num_new_tokens, hit.blocks)
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    return new_blocks.get_block_ids()[0]


def _ref_cnts(kv: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [kv.block_pool.blocks[block_id].ref_cnt for block_id in block_ids]


def test_fresh_allocation_and_shared_prefix() -> None:
    kv = _manager()
    a = _request("a", list(range(10)))
    hit = kv.get_computed_blocks(a)
    assert hit.num_computed_tokens == 0 and hit.blocks.get_block_ids() == ([],)
    assert _prefill(kv, a) == [1, 2, 3]
    assert kv.block_pool.num_cached_blocks == 2  # 10 tokens: 2 full blocks, block 3 partial

    b = _request("b", list(range(8)) + [100, 101, 102])
    hit = kv.get_computed_blocks(b)
    assert hit.num_computed_tokens == 8 and hit.blocks.get_block_ids() == ([1, 2],)
    new_blocks = kv.allocate_slots(b, 3, hit.blocks)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([4],)
    assert kv.get_block_ids("b") == ([1, 2, 4],)
    assert _ref_cnts(kv, [1, 2, 3, 4]) == [2, 2, 1, 1]
    assert kv.usage == pytest.approx(4 / 10)

    kv.free(a)
    assert _ref_cnts(kv, [1, 2, 3]) == [1, 1, 0]
    assert kv.block_pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 10, 3]
    kv.free(b)  # last block first: 4, then 2 and 1 reach ref_cnt 0
    assert kv.block_pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 10, 3, 4, 2, 1]
    assert kv.get_block_ids("b") == ([],) and kv.usage == 0.0


def test_hit_covers_full_blocks_only_and_never_the_last_token() -> None:
    kv = _manager()
    _prefill(kv, _request("a", list(range(10))))
    cases = {
        "exact 8-token prefix": (list(range(8)), 4),  # the last token is recomputed: 1 block
        "9 tokens": (list(range(9)), 8),
        "7 tokens": (list(range(7)), 4),
        "3 tokens": (list(range(3)), 0),
        "differs in block 1": ([0, 1, 2, 3, 4, 99, 6, 7, 8], 4),
        "differs in block 0": ([99, *range(1, 9)], 0),
    }
    for name, (prompt, num_hit_tokens) in cases.items():
        assert kv.get_computed_blocks(_request(name, prompt)).num_computed_tokens == num_hit_tokens


def test_lru_eviction_when_the_pool_is_full() -> None:
    kv = _manager()
    a = _request("a", list(range(10)))
    b = _request("b", list(range(8)) + [100, 101, 102])
    _prefill(kv, a)
    _prefill(kv, b)
    kv.free(a)
    kv.free(b)  # free queue: [5 6 7 8 9 10 3 4 2 1]; cached: 1 and 2
    assert _prefill(kv, _request("d", list(range(1000, 1028)))) == [5, 6, 7, 8, 9, 10, 3]
    assert _prefill(kv, _request("e", list(range(2000, 2008)))) == [4, 2]  # evicts block 2
    assert kv.get_computed_blocks(_request("a2", list(range(10)))).blocks.get_block_ids() == ([1],)
    assert kv.get_num_free_blocks() == 1


def test_allocate_slots_returns_none_without_side_effects() -> None:
    kv = _manager()
    a = _request("a", list(range(8)))
    _prefill(kv, a)
    kv.free(a)  # cached, free: blocks 1 and 2; queue [3 .. 10 2 1]
    queue_before = kv.block_pool.free_queue.block_ids()
    b = _request("b", list(range(8)) + list(range(500, 540)))  # 48 tokens
    hit = kv.get_computed_blocks(b)
    assert hit.blocks.get_block_ids() == ([1, 2],)
    # 48 slots = 12 blocks: 10 new + 2 hits that leave the free queue > 10 free blocks.
    assert kv.allocate_slots(b, 40, hit.blocks) is None
    assert kv.get_block_ids("b") == ([],)
    assert kv.block_pool.free_queue.block_ids() == queue_before
    assert _ref_cnts(kv, [1, 2]) == [0, 0] and kv.block_pool.num_cached_blocks == 2
    # 8 tokens less fits exactly: 8 new + the 2 touched hits.
    new_blocks = kv.allocate_slots(b, 32, hit.blocks)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([3, 4, 5, 6, 7, 8, 9, 10],)
    assert kv.get_block_ids("b") == ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10],)
    assert kv.get_num_free_blocks() == 0


def test_chunked_prefill_caches_blocks_as_they_fill() -> None:
    kv = _manager()
    request = _request("r", list(range(10)))
    for num_new_tokens, expected_ids, num_cached in [(4, [1], 1), (4, [2], 2), (2, [3], 2)]:
        new_blocks = kv.allocate_slots(request, num_new_tokens)
        assert new_blocks is not None and new_blocks.get_block_ids() == (expected_ids,)
        request.num_computed_tokens += num_new_tokens
        assert kv.block_pool.num_cached_blocks == num_cached


def test_decode_allocates_a_block_every_block_size_tokens_and_caches_outputs() -> None:
    kv = _manager()
    request = _request("r", list(range(6)))
    assert _prefill(kv, request) == [1, 2]
    for sampled, expected_ids in [(50, []), (51, []), (52, [3])]:
        request.output_token_ids.append(sampled)  # sampled last step, computed this step
        new_blocks = kv.allocate_slots(request, 1)
        assert new_blocks is not None and new_blocks.get_block_ids() == (expected_ids,)
        request.num_computed_tokens += 1
    assert kv.get_block_ids("r") == ([1, 2, 3],)
    assert len(request.block_hashes) == 2 and kv.block_pool.num_cached_blocks == 2
    # A prompt equal to prompt + outputs hits the blocks that generation filled.
    hit = kv.get_computed_blocks(_request("again", [*range(6), 50, 51, 52]))
    assert hit.blocks.get_block_ids() == ([1, 2],)


def test_preempted_request_hits_its_own_blocks_on_resume() -> None:
    kv = _manager()
    request = _request("r", list(range(10)))
    assert _prefill(kv, request) == [1, 2, 3]
    kv.free(request)  # preempted: queue [4 .. 10 3 2 1]
    request.num_computed_tokens = 0
    hit = kv.get_computed_blocks(request)
    assert hit.num_computed_tokens == 8
    new_blocks = kv.allocate_slots(request, 2, hit.blocks)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([4],)
    assert kv.get_block_ids("r") == ([1, 2, 4],)


def test_prefix_cache_stats_count_tokens() -> None:
    kv = _manager()
    _prefill(kv, _request("a", list(range(10))))
    _prefill(kv, _request("b", list(range(8)) + [100, 101, 102]))
    stats = kv.prefix_cache_stats
    assert (stats.num_requests, stats.num_query_tokens, stats.num_hit_tokens) == (2, 21, 8)
    assert stats.hit_rate == pytest.approx(8 / 21)
    assert kv.take_prefix_cache_stats() == stats
    assert kv.prefix_cache_stats.num_requests == 0


def test_caching_disabled() -> None:
    kv = _manager(enable_caching=False)
    a = _request("a", list(range(10)))
    assert _prefill(kv, a) == [1, 2, 3]
    assert a.block_hashes == [] and kv.block_pool.num_cached_blocks == 0
    kv.free(a)
    assert kv.get_computed_blocks(_request("b", list(range(10)))).num_computed_tokens == 0
    assert kv.prefix_cache_stats.num_requests == 0


def test_reset_prefix_cache() -> None:
    kv = _manager()
    a = _request("a", list(range(10)))
    _prefill(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(_request("b", list(range(10)))).num_computed_tokens == 0


def test_num_new_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError, match="num_new_tokens must be >= 1"):
        _manager().allocate_slots(_request("r", [1, 2]), 0)
