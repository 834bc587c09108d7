"""KVCacheManager: the scheduler's only view of the KV cache (block ids and token counts, no tensors).

Per step, for each request the scheduler calls:

    waiting request:  hit = get_computed_blocks(req)                  (prefix-cache lookup, no side effects)
                      allocate_slots(req, num_new_tokens, hit.blocks)   (None: not enough blocks, try later)
    running request:  allocate_slots(req, num_new_tokens)               (None: preempt someone, retry)
    finished / preempted:  free(req)

`allocate_slots` also enters the blocks that this step fills into the prefix cache, so a request
scheduled later in the same step can hit them: the runner must write the KV of all scheduled tokens
of a layer before that layer's attention reads it (true for write-then-attend backends).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from tidepool.kv_cache.block_pool import BlockPool, KVCacheBlock
from tidepool.kv_cache.group_manager import SingleTypeManager, make_manager
from tidepool.kv_cache.hashing import BlockHash, update_block_hashes
from tidepool.kv_cache.spec import KVCacheConfig
from tidepool.request import Request


@dataclass(frozen=True)
class KVCacheBlocks:
    """Blocks per KV-cache group (index = group id), all groups covering the same token range."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    @classmethod
    def empty(cls, num_groups: int) -> KVCacheBlocks:
        return cls(tuple(() for _ in range(num_groups)))

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([block.block_id for block in group_blocks] for group_blocks in self.blocks)


class ComputedBlocks(NamedTuple):
    """A prefix-cache hit: pass `blocks` to `allocate_slots`; the request may skip its first
    `num_computed_tokens` tokens (a multiple of block_size, < its number of tokens)."""

    blocks: KVCacheBlocks
    num_computed_tokens: int


@dataclass
class PrefixCacheStats:
    num_requests: int = 0
    """Lookups (`get_computed_blocks` calls with caching on)."""
    num_query_tokens: int = 0
    """Tokens of the looked-up requests."""
    num_hit_tokens: int = 0
    """Tokens served from the cache."""

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class KVCacheManager:
    def __init__(self, config: KVCacheConfig, enable_caching: bool = True) -> None:
        self.config = config
        self.block_size = config.block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(config.num_blocks, enable_caching)
        self.managers: list[SingleTypeManager] = [
            make_manager(group.spec, self.block_pool, group_id)
            for group_id, group in enumerate(config.groups)
        ]
        self._stats = PrefixCacheStats()

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest prefix of the request that every group has cached. Takes no references: pass the
        result to `allocate_slots` before any other allocation, or drop it."""
        if not self.enable_caching:
            return ComputedBlocks(KVCacheBlocks.empty(self.num_groups), 0)
        block_hashes = update_block_hashes(request, self.block_size)
        # The last token is always recomputed: its hidden state gives the logits / pooled output.
        max_length = max(request.num_tokens - 1, 0)
        hit_blocks, num_hit_blocks = self._find_longest_cache_hit(block_hashes, max_length)
        num_hit_tokens = num_hit_blocks * self.block_size
        self._stats.num_requests += 1
        self._stats.num_query_tokens += request.num_tokens
        self._stats.num_hit_tokens += num_hit_tokens
        return ComputedBlocks(KVCacheBlocks(hit_blocks), num_hit_tokens)

    def _find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """(hit blocks per group, number of hit blocks): the longest length every group serves.

        Prefix-closed groups (full attention) are asked once and give an upper bound. Sliding-window
        groups are asked at the bound; one that serves less lowers it, and every group whose last
        answer is longer than the new bound is asked again (a sliding-window hit cannot simply be
        truncated: it needs the blocks just before the new end). The bound only falls, so it stops.
        """
        num_hit_blocks = min(max_length // self.block_size, len(block_hashes))
        hits: dict[int, list[KVCacheBlock]] = {}
        for manager in self.managers:
            if manager.prefix_closed:
                hits[manager.group_id] = manager.find_longest_cache_hit(
                    block_hashes, num_hit_blocks * self.block_size
                )
                num_hit_blocks = min(num_hit_blocks, len(hits[manager.group_id]))
        converged = False
        while not converged:
            converged = True
            for manager in self.managers:
                group_hit = hits.get(manager.group_id)
                if manager.prefix_closed or (
                    group_hit is not None and len(group_hit) == num_hit_blocks
                ):
                    continue
                group_hit = manager.find_longest_cache_hit(
                    block_hashes, num_hit_blocks * self.block_size
                )
                hits[manager.group_id] = group_hit
                if len(group_hit) < num_hit_blocks:
                    num_hit_blocks, converged = len(group_hit), False
        blocks = tuple(hits[group_id][:num_hit_blocks] for group_id in range(self.num_groups))
        return blocks, num_hit_blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_reserved_blocks: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` tokens after `request.num_computed_tokens` plus the hit.

        Returns the newly allocated blocks per group, or None when the pool has too few free
        blocks (leaving `num_reserved_blocks` of them untouched: reserved for others); then nothing
        was allocated, touched or cached (sliding-window blocks that left the window may have been
        freed: they are dead either way).

            |<- num_computed_tokens ->|<- hit ->|<- num_new_tokens ->|
            |   already has blocks    | touched | new blocks as needed |
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        request_id = request.request_id
        hits = (new_computed_blocks or KVCacheBlocks.empty(self.num_groups)).blocks
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, request.num_computed_tokens)
        num_computed_tokens = request.num_computed_tokens + len(hits[0]) * self.block_size
        num_slot_tokens = num_computed_tokens + num_new_tokens
        num_blocks_to_allocate = sum(
            manager.get_num_blocks_to_allocate(request_id, num_slot_tokens, group_hits)
            for manager, group_hits in zip(self.managers, hits, strict=True)
        )
        if num_blocks_to_allocate > self.block_pool.get_num_free_blocks() - num_reserved_blocks:
            return None
        for manager, group_hits in zip(self.managers, hits, strict=True):
            manager.save_new_computed_blocks(request_id, group_hits)
        new_blocks = tuple(
            manager.allocate_new_blocks(request_id, num_slot_tokens) for manager in self.managers
        )
        if self.enable_caching:
            block_hashes = update_block_hashes(request, self.block_size)
            for manager in self.managers:
                manager.cache_blocks(request_id, block_hashes, num_computed_tokens + num_new_tokens)
        return KVCacheBlocks(new_blocks)

    def get_num_new_tokens_that_fit(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_reserved_blocks: int = 0,
    ) -> int:
        """The most of `num_new_tokens` that `allocate_slots` could place now: all of them, or the
        largest count ending on a block boundary (0: not even that). Allocates nothing."""
        request_id = request.request_id
        hits = (new_computed_blocks or KVCacheBlocks.empty(self.num_groups)).blocks
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, request.num_computed_tokens)
        start = request.num_computed_tokens + len(hits[0]) * self.block_size
        num_free_blocks = self.block_pool.get_num_free_blocks() - num_reserved_blocks

        def fits(num_slot_tokens: int) -> bool:
            return num_free_blocks >= sum(
                manager.get_num_blocks_to_allocate(request_id, num_slot_tokens, group_hits)
                for manager, group_hits in zip(self.managers, hits, strict=True)
            )

        if fits(start + num_new_tokens):
            return num_new_tokens
        # Binary search over block boundaries strictly inside the range (fits() is monotone).
        low, high = start // self.block_size + 1, (start + num_new_tokens - 1) // self.block_size
        num_fitting = 0
        while low <= high:
            middle = (low + high) // 2
            if fits(middle * self.block_size):
                num_fitting, low = middle * self.block_size - start, middle + 1
            else:
                high = middle - 1
        return num_fitting

    def get_num_blocks_to_hold(self, num_tokens: int) -> int:
        """Blocks of all groups that one request keeps once `num_tokens` tokens are computed:
        all of them in full-attention groups, those of the window in sliding-window groups."""
        return sum(manager.get_num_blocks_to_hold(num_tokens) for manager in self.managers)

    def get_num_blocks_at_peak(self, num_tokens: int, max_num_chunk_tokens: int) -> int:
        """Most blocks of all groups one request holds at once while its first `num_tokens`
        tokens are computed in chunks of at most `max_num_chunk_tokens` (each group's peak; they
        may fall in different steps, so the sum is an upper bound)."""
        return sum(
            manager.get_num_blocks_at_peak(num_tokens, max_num_chunk_tokens)
            for manager in self.managers
        )

    def get_num_blocks_to_reserve(
        self,
        request: Request,
        max_num_chunk_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> int:
        """Most free blocks the request may still take, all groups together, before its prompt
        ends (chunks of at most `max_num_chunk_tokens`): per group, its peak less what it holds
        that counts towards it. With `new_computed_blocks` (a waiting request's hit): what it
        would need if admitted with them. Reserving this much for every prompt in progress means
        no prompt runs out of blocks (see Scheduler: admission)."""
        hits = (new_computed_blocks or KVCacheBlocks.empty(self.num_groups)).blocks
        return sum(
            manager.get_num_blocks_to_reserve(
                request.request_id, request.num_prompt_tokens, max_num_chunk_tokens, group_hits
            )
            for manager, group_hits in zip(self.managers, hits, strict=True)
        )

    def get_num_blocks_held(self, request_id: str) -> int:
        """Blocks of all groups in the request's tables now (null blocks not counted)."""
        return sum(
            sum(1 for block in manager.get_blocks(request_id) if not block.is_null)
            for manager in self.managers
        )

    def remove_skipped_blocks(self, request: Request) -> None:
        """Free the blocks no future token of the request attends to (sliding-window groups)
        as soon as its tokens are computed, rather than at its next allocation: the next
        schedule() then sees them free before it admits or preempts anyone."""
        for manager in self.managers:
            manager.remove_skipped_blocks(request.request_id, request.num_computed_tokens)

    def free(self, request: Request) -> None:
        """Release the request's blocks (they stay in the prefix cache until evicted)."""
        for manager in self.managers:
            manager.free(request.request_id)

    def uncache_unwritten_blocks(self, request: Request, num_new_tokens: int) -> None:
        """A step that was to compute `num_new_tokens` tokens of the request failed: it wrote
        none of their KV, but `allocate_slots` already entered the blocks it was to fill into the
        prefix cache. Drop their hashes, or a later request could hit them and read garbage."""
        first = request.num_computed_tokens // self.block_size
        end = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        for group_blocks in self.get_blocks(request.request_id).blocks:
            for block in group_blocks[first:end]:
                self.block_pool.evict_cached_hash(block)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(manager.get_blocks(request_id) for manager in self.managers))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table per group (0 = null block where dropped from a window)."""
        return self.get_blocks(request_id).get_block_ids()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return replace(self._stats)

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        """The stats since the last call (for a metrics logger), then start from zero."""
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; fails (False) while any block is in use."""
        return self.block_pool.reset_prefix_cache()
