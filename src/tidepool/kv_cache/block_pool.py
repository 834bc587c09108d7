"""The block pool: every KV block of every group, their ref counts, the free queue, the prefix cache.

A block is in exactly one of three states:

    in use      ref_cnt > 0, in one or more requests' block tables (shared prefixes: ref_cnt > 1)
    free+cached ref_cnt == 0, in the free queue, still reachable from the hash map: a prefix hit
                `touch`es it back into use; `get_new_blocks` may evict it (drop the hash) and reuse it
    free        ref_cnt == 0, in the free queue, no hash

Free queue, least recently freed first (evicted first):

    head <-> b7 <-> b3 <-> b4 <-> ... <-> tail     popleft() for new blocks, append() when freed,
                                                   remove(b) in O(1) when a cached block is hit

Block 0 is the null block: never handed out, never freed, never cached. A sliding-window group puts it
in a block table where a block was dropped because it fell out of the window.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tidepool.kv_cache.hashing import BlockHash

NULL_BLOCK_ID = 0

CacheKey = tuple[BlockHash, int]
"""(block hash, group id): equal tokens in two groups are two different blocks."""


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "cache_key", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.cache_key: CacheKey | None = None
        """Set while the block is in the prefix cache (in use or free)."""
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    @property
    def block_hash(self) -> BlockHash | None:
        return None if self.cache_key is None else self.cache_key[0]

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID

    def __repr__(self) -> str:
        cached = "" if self.cache_key is None else f", hash={self.cache_key[0].hex()[:8]}"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks themselves: O(1) popleft / append / remove."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: no None checks at the ends
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free, next_block.prev_free = next_block, prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids from head (next to be reused) to tail; O(n), for tests and debugging."""
        block_ids = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            block_ids.append(block.block_id)
            block = block.next_free
        return block_ids


class BlockPool:
    """All `num_blocks` blocks; block 0 is the null block, so `num_blocks - 1` can be handed out."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self._cached_blocks: dict[CacheKey, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        """Free blocks, cached ones included (they are evicted on demand)."""
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks in use, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash, group_id: int) -> KVCacheBlock | None:
        return self._cached_blocks.get((block_hash, group_id))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free queue (ref_cnt 1, no hash)."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"asked for {num_blocks} blocks, {self.get_num_free_blocks()} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self.evict_cached_hash(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free one leaves the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block, in order; those reaching 0 go to the queue's tail.

        Callers pass a request's blocks last-first, so its tail blocks (least likely to be shared)
        are evicted before its prefix.
        """
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt < 1:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_blocks(
        self,
        block_hashes: Sequence[BlockHash],
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int,
    ) -> None:
        """Enter blocks[num_cached_blocks:num_full_blocks] into the prefix cache.

        `block_hashes[i]` is the hash of block i of the request. Null blocks (dropped from a window)
        and blocks that already have a hash (prefix hits) are skipped. If another block already holds
        a hash, the first one stays cached and this one is not (it is freed without a hash).
        """
        if not self.enable_caching:
            return
        for block_index in range(num_cached_blocks, num_full_blocks):
            block = blocks[block_index]
            if block.is_null or block.cache_key is not None:
                continue
            key = (block_hashes[block_index], group_id)
            if key not in self._cached_blocks:
                block.cache_key = key
                self._cached_blocks[key] = block

    def evict_cached_hash(self, block: KVCacheBlock) -> None:
        """Take the block out of the prefix cache (no-op if it has no hash); it keeps its data
        and references."""
        if block.cache_key is not None:
            del self._cached_blocks[block.cache_key]
            block.cache_key = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no block is in use. Returns success."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for block in self._cached_blocks.values():
            block.cache_key = None
        self._cached_blocks.clear()
        return True

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached_blocks)
