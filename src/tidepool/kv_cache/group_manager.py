"""Per-group block tables: allocation, freeing, and the rules that differ by attention type.

A subclass overrides `find_longest_cache_hit` (which cached blocks let a request skip work) and
`remove_skipped_blocks` (which blocks no future token can attend to), and with them what follows
from the second: how many blocks a request keeps (`get_num_blocks_to_hold`), holds at most while
a prompt runs in chunks (`get_num_blocks_at_peak`), and may get back from the pool when it drops
them (`_num_blocks_credited`). Everything else is shared.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from tidepool.kv_cache.block_pool import BlockPool, KVCacheBlock
from tidepool.kv_cache.hashing import BlockHash
from tidepool.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


def _cdiv(num: int, den: int) -> int:
    return -(-num // den)


class SingleTypeManager(ABC):
    """Block tables of one KV-cache group (one spec), drawing blocks from the shared pool.

    Contract: a request's block list covers its tokens from position 0, block i holding tokens
    [i * block_size, (i + 1) * block_size); entries may be the pool's null block where blocks were
    dropped or never needed (they are always a prefix of the list).
    """

    prefix_closed: ClassVar[bool]
    """True when a hit of length L implies a hit at every shorter length (so truncating is valid)."""

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free blocks that `num_tokens` slots would consume: new blocks plus hits now in the free
        queue (touching them takes them out of it)."""
        num_held = len(self.get_blocks(request_id)) + len(new_computed_blocks)
        num_new_blocks = max(_cdiv(num_tokens, self.block_size) - num_held, 0)
        num_evictable_hits = sum(
            1 for block in new_computed_blocks if block.ref_cnt == 0 and not block.is_null
        )
        return num_new_blocks + num_evictable_hits

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Take a reference on prefix-cache hits and start the request's block list with them."""
        if not new_computed_blocks:
            return
        if self.get_blocks(request_id):
            raise ValueError(f"request {request_id} already has blocks; hits are for new requests")
        self.block_pool.touch(new_computed_blocks)
        self.req_to_blocks[request_id] = list(new_computed_blocks)
        self._num_cached_blocks[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Extend the request's blocks to cover `num_tokens` tokens; returns the new ones."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new_blocks = _cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(
        self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> None:
        """Enter the blocks that are full once `num_tokens` tokens are computed into the cache."""
        num_cached_blocks = self._num_cached_blocks.get(request_id, 0)
        num_full_blocks = min(num_tokens // self.block_size, len(block_hashes))
        if num_full_blocks <= num_cached_blocks:
            return
        blocks = self.get_blocks(request_id)
        self.block_pool.cache_full_blocks(
            block_hashes, blocks, num_cached_blocks, num_full_blocks, self.group_id
        )
        self._num_cached_blocks[request_id] = num_full_blocks

    def free(self, request_id: str) -> None:
        """Release all blocks of the request, last block first (evicted first)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self._num_cached_blocks.pop(request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_num_blocks_to_hold(self, num_tokens: int) -> int:
        """Blocks a request keeps once `num_tokens` tokens are computed (and skipped ones dropped)."""
        return _cdiv(num_tokens, self.block_size)

    def get_num_blocks_at_peak(self, num_tokens: int, max_num_chunk_tokens: int) -> int:
        """Most blocks a request holds at once in this group while its tokens [0, num_tokens) are
        computed in chunks of at most `max_num_chunk_tokens`, wherever the chunks start (prefix
        hits and short chunks included). Full attention keeps every block: the last chunk holds
        them all."""
        return _cdiv(num_tokens, self.block_size)

    def get_num_blocks_to_reserve(
        self,
        request_id: str,
        num_tokens: int,
        max_num_chunk_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> int:
        """Most blocks the request may still take from the free pool, in this group, before its
        tokens [0, num_tokens) are computed: its peak less the blocks that count towards the peak
        without coming from the pool (`new_computed_blocks`: a prefix hit it is about to take)."""
        num_peak = self.get_num_blocks_at_peak(num_tokens, max_num_chunk_tokens)
        return max(num_peak - self._num_blocks_credited(request_id, new_computed_blocks), 0)

    def _num_blocks_credited(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Full attention drops no block before the request ends: every block it holds counts,
        and so does every hit that another request holds (touching it takes nothing from the pool;
        a hit in the free queue is taken from it)."""
        num_held = sum(1 for block in self.get_blocks(request_id) if not block.is_null)
        return num_held + sum(
            1 for block in new_computed_blocks if block.ref_cnt > 0 and not block.is_null
        )

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """Cached blocks that let a request skip its first len(result) * block_size tokens, with
        len(result) * block_size <= max_length. Null blocks stand for blocks not needed."""

    @abstractmethod
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks no token at position >= num_computed_tokens attends to (null in the table)."""


class FullAttentionManager(SingleTypeManager):
    prefix_closed = True

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        hit: list[KVCacheBlock] = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash, self.group_id)
            if block is None:
                break
            hit.append(block)
        return hit

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        return  # every earlier token stays attendable


class SlidingWindowManager(SingleTypeManager):
    """Token p attends to [p - window + 1, p]; the next token to compute is at num_computed_tokens.

    Worked example, block_size 4, window 6. After 12 computed tokens the next token (12) attends to
    positions 7..12, so tokens 0..6 are skipped: block 0 (tokens 0-3) is wholly outside and freed,
    block 1 (4-7) still holds token 7:

        tokens     0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 ...
        table      [null,    b2,       b3,         b4]

    A prefix hit of L tokens needs only the cdiv(window - 1, block_size) = 2 blocks before L.
    """

    prefix_closed = False

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        super().__init__(spec, block_pool, group_id)
        assert isinstance(spec, SlidingWindowSpec)
        self.sliding_window = spec.sliding_window
        self.num_hit_blocks_needed = _cdiv(spec.sliding_window - 1, self.block_size)
        self._peak_cache: dict[tuple[int, int], int] = {}
        """(num_tokens, max_num_chunk_tokens) -> get_num_blocks_at_peak (a pure function of them)."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        # Search from the right for the first run of `num_hit_blocks_needed` cached blocks; the
        # blocks before the run are out of the window and stay null. Hashes are chained, so a cached
        # block i proves the whole prefix up to it was computed, even if older blocks were evicted.
        num_blocks = min(max_length // self.block_size, len(block_hashes))
        null_block = self.block_pool.null_block
        if self.num_hit_blocks_needed == 0:
            return [null_block] * num_blocks
        hit = [null_block] * num_blocks
        num_contiguous = 0
        for block_index in range(num_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(block_hashes[block_index], self.group_id)
            if block is None:
                num_contiguous = 0
                continue
            hit[block_index] = block
            num_contiguous += 1
            if num_contiguous == self.num_hit_blocks_needed:
                return hit[: block_index + num_contiguous]
        # No run long enough; a shorter run starting at block 0 still counts (nothing before it).
        return hit[:num_contiguous]

    def _num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no token at position >= num_computed_tokens attends to."""
        return max(num_computed_tokens - self.sliding_window + 1, 0) // self.block_size

    def get_num_blocks_to_hold(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size) - self._num_skipped_blocks(num_tokens)

    def get_num_blocks_at_peak(self, num_tokens: int, max_num_chunk_tokens: int) -> int:
        """A step that computes tokens [start, start + chunk) first drops the skipped blocks, then
        holds every later block up to the one of its last token:

            held(start) = cdiv(min(start + max_num_chunk_tokens, num_tokens), block_size)
                          - _num_skipped_blocks(start)

        The skip count is constant on runs of block_size starts and the first term grows with the
        start, so the maximum is at the last start of a run, W - 2 + k * block_size (k >= 1), or
        at the last token. Worked example, block 16, window 64, chunks of 128, prompt 512: a chunk
        starting at token 62 + 16k still sees token 16k - 1 (block k - 1) and ends at token
        189 + 16k (block k + 11): 13 blocks, the blocks of W - 1 + C tokens and the one they
        straddle. Chunks that start on block boundaries hold 12; the peak covers any start.
        """
        key = (num_tokens, max_num_chunk_tokens)
        num_peak = self._peak_cache.get(key)
        if num_peak is not None:
            return num_peak
        num_peak, start, last = 0, self.sliding_window - 2 + self.block_size, num_tokens - 1
        while True:
            start = min(start, last)
            end = min(start + max_num_chunk_tokens, num_tokens)
            num_held = _cdiv(end, self.block_size) - self._num_skipped_blocks(start)
            num_peak = max(num_peak, num_held)
            if start >= last:
                break
            start += self.block_size
        self._peak_cache[key] = num_peak
        return num_peak

    def _num_blocks_credited(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """The window drops blocks while the prompt runs. A block the request holds alone goes back
        to the pool when dropped (and may be taken again), so it counts; a block shared with
        another request does not go back, so it does not. Hits never count (one in the free
        queue is taken from it; one another request holds is shared), and a hit that another
        request holds alone takes that request's credit for it: one more block to reserve."""
        num_held_alone = sum(
            1 for block in self.get_blocks(request_id) if block.ref_cnt == 1 and not block.is_null
        )
        num_credit_taken = sum(
            1 for block in new_computed_blocks if block.ref_cnt == 1 and not block.is_null
        )
        return num_held_alone - num_credit_taken

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.get_blocks(request_id)
        num_skipped_blocks = min(self._num_skipped_blocks(num_computed_tokens), len(blocks))
        removed_blocks = []
        for block_index in range(num_skipped_blocks - 1, -1, -1):
            if blocks[block_index].is_null:
                break  # everything before was removed by an earlier call
            removed_blocks.append(blocks[block_index])
            blocks[block_index] = self.block_pool.null_block
        self.block_pool.free_blocks(removed_blocks)


MANAGER_TYPES: dict[type[KVCacheSpec], type[SingleTypeManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}
"""Spec type -> manager class; a new attention type registers here."""


def make_manager(spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> SingleTypeManager:
    manager_type = MANAGER_TYPES.get(type(spec))
    if manager_type is None:
        raise ValueError(f"no KV-cache manager registered for {type(spec).__name__}")
    return manager_type(spec, block_pool, group_id)
