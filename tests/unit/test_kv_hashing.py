"""Chained block hashes: stable, full blocks only, incremental, extra keys."""

from __future__ import annotations

import hashlib
import struct

from tidepool.kv_cache.hashing import NONE_HASH, hash_block_tokens, update_block_hashes
from tidepool.params import PoolingParams
from tidepool.request import Request


def _request(prompt: list[int], **kwargs: object) -> Request:
    return Request("r", prompt, PoolingParams(), **kwargs)  # type: ignore[arg-type]


def test_hash_is_sha256_of_a_documented_encoding() -> None:
    # Pinned: a change of encoding would silently split caches shared across processes.
    expected = hashlib.sha256(NONE_HASH + struct.pack("<I3q", 3, 1, 2, 3)).digest()
    assert hash_block_tokens(None, [1, 2, 3]) == expected
    assert len(expected) == 32


def test_hash_depends_on_parent_tokens_and_extra_keys() -> None:
    first = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2]) == first
    assert hash_block_tokens(first, [1, 2]) != first
    assert hash_block_tokens(None, [2, 1]) != first
    assert hash_block_tokens(None, [1, 2], ("salt",)) != first


def test_only_full_blocks_are_hashed_and_updates_are_incremental() -> None:
    request = _request(list(range(10)))
    hashes = update_block_hashes(request, block_size=4)
    assert hashes is request.block_hashes and len(hashes) == 2
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    before = list(hashes)
    request.output_token_ids += [10]
    assert len(update_block_hashes(request, 4)) == 2  # 11 tokens: still 2 full blocks
    request.output_token_ids += [11, 12]
    hashes = update_block_hashes(request, 4)
    assert hashes[:2] == before and len(hashes) == 3
    # A block spanning prompt and output hashes like the same tokens all in the prompt.
    assert hashes == update_block_hashes(_request(list(range(13))), 4)


def test_token_type_ids_count_only_when_non_zero() -> None:
    plain = update_block_hashes(_request(list(range(8))), 4)
    zeros = update_block_hashes(_request(list(range(8)), token_type_ids=[0] * 8), 4)
    pair = update_block_hashes(_request(list(range(8)), token_type_ids=[0] * 6 + [1] * 2), 4)
    assert zeros == plain
    assert pair[0] == plain[0] and pair[1] != plain[1]
