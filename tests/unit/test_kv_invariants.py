"""Seeded random workload on a hybrid manager; after every operation the bookkeeping must agree with
itself, and every prefix hit must point at blocks that really hold the request's tokens."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from tidepool.kv_cache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheManager,
    SlidingWindowSpec,
    group_layers,
)
from tidepool.params import PoolingParams
from tidepool.request import Request

BLOCK_SIZE = 4
WINDOW = 8
LAYERS = {
    "full.0": FullAttentionSpec(BLOCK_SIZE, 1, 8, torch.float32),
    "swa.0": SlidingWindowSpec(BLOCK_SIZE, 1, 8, torch.float32, sliding_window=WINDOW),
}
PREFIXES = [[7] * 9, list(range(13)), list(range(100, 106))]


class Simulation:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.kv = KVCacheManager(KVCacheConfig(31, tuple(group_layers(LAYERS))))
        self.running: list[Request] = []
        self.num_requests = 0
        # (group id, block id) -> the tokens whose KV the block holds, up to its end
        self.content: dict[tuple[int, int], tuple[int, ...]] = {}
        # request id -> num_computed_tokens when allocate_slots last ran (blocks dead by then are gone)
        self.computed_at_allocate: dict[str, int] = {}

    def new_request(self) -> None:
        prompt = self.rng.choice(PREFIXES)[: self.rng.randint(1, 13)]
        prompt = prompt + [self.rng.randint(0, 3) for _ in range(self.rng.randint(0, 12))]
        request = Request(f"r{self.num_requests}", prompt or [1], PoolingParams())
        self.num_requests += 1
        hit = self.kv.get_computed_blocks(request)
        tokens = tuple(request.all_token_ids)
        for group_id, blocks in enumerate(hit.blocks.blocks):
            for block_index, block in enumerate(blocks):
                end = (block_index + 1) * BLOCK_SIZE
                assert block.is_null or self.content[group_id, block.block_id] == tokens[:end]
        # The first token after the hit attends to the WINDOW - 1 tokens before it: all present.
        sliding_hit = hit.blocks.blocks[1]
        num_window_blocks = -(-(WINDOW - 1) // BLOCK_SIZE)
        assert not any(block.is_null for block in sliding_hit[-num_window_blocks:])
        before = self.snapshot()
        num_new_tokens = self.rng.randint(1, request.num_tokens - hit.num_computed_tokens)
        if self.kv.allocate_slots(request, num_new_tokens, hit.blocks) is None:
            assert self.snapshot() == before
            return
        self.computed_at_allocate[request.request_id] = 0
        request.num_computed_tokens = hit.num_computed_tokens + num_new_tokens
        self.record_content(request)
        self.running.append(request)

    def step(self, request: Request) -> None:
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(self.rng.randint(0, 3))
        num_new_tokens = self.rng.randint(1, request.num_tokens - request.num_computed_tokens)
        self.computed_at_allocate[request.request_id] = request.num_computed_tokens
        if self.kv.allocate_slots(request, num_new_tokens) is None:
            self.finish(request)  # preempted
            return
        request.num_computed_tokens += num_new_tokens
        self.record_content(request)

    def finish(self, request: Request) -> None:
        self.kv.free(request)
        self.running.remove(request)

    def record_content(self, request: Request) -> None:
        tokens = tuple(request.all_token_ids)
        num_full_blocks = request.num_computed_tokens // BLOCK_SIZE
        for group_id, block_ids in enumerate(self.kv.get_block_ids(request.request_id)):
            for block_index, block_id in enumerate(block_ids[:num_full_blocks]):
                if block_id:
                    self.content[group_id, block_id] = tokens[: (block_index + 1) * BLOCK_SIZE]

    def snapshot(self) -> tuple[list[int], list[int], int]:
        pool = self.kv.block_pool
        return (
            pool.free_queue.block_ids(),
            [b.ref_cnt for b in pool.blocks],
            pool.num_cached_blocks,
        )

    def check_invariants(self) -> None:
        pool = self.kv.block_pool
        references: Counter[int] = Counter()
        owner: dict[int, int] = {}
        for request in self.running:
            tables = self.kv.get_block_ids(request.request_id)
            num_computed_tokens = self.computed_at_allocate[request.request_id]
            num_dead_blocks = max(num_computed_tokens - WINDOW + 1, 0) // BLOCK_SIZE
            for group_id, block_ids in enumerate(tables):
                assert len(block_ids) * BLOCK_SIZE >= request.num_computed_tokens
                for block_id in block_ids:
                    if block_id:
                        references[block_id] += 1
                        assert owner.setdefault(block_id, group_id) == group_id
            sliding = tables[1]
            assert all(block_id == 0 for block_id in sliding[:num_dead_blocks])
            num_nulls = sliding.count(0)
            assert sliding[:num_nulls] == [0] * num_nulls  # nulls form a prefix
        free_ids = pool.free_queue.block_ids()
        assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks()
        assert pool.null_block.ref_cnt == 0 and 0 not in free_ids
        for block in pool.blocks[1:]:
            assert block.ref_cnt == references[block.block_id]
            assert (block.ref_cnt == 0) == (block.block_id in free_ids)
            if block.cache_key is not None:
                assert pool.get_cached_block(*block.cache_key) is block


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_keeps_bookkeeping_consistent(seed: int) -> None:
    sim = Simulation(seed)
    for _ in range(400):
        roll = sim.rng.random()
        if roll < 0.3 or not sim.running:
            sim.new_request()
        elif roll < 0.85:
            sim.step(sim.rng.choice(sim.running))
        else:
            sim.finish(sim.rng.choice(sim.running))
        sim.check_invariants()
    stats = sim.kv.prefix_cache_stats
    assert stats.num_hit_tokens > 0  # the workload does exercise the prefix cache
