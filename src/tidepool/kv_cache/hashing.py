"""Chained hashes of full KV-cache blocks: the keys of the prefix cache.

    block 0: h0 = H(NONE_HASH, tokens[0:16],  extra keys of block 0 (cache salt, token types))
    block 1: h1 = H(h0,        tokens[16:32], extra keys of block 1)
    ...      a hash names the block *and everything before it*, so equal hashes = equal prefixes.

Only full blocks are hashed; a partial last block is never cached.

Choice of hash: SHA-256 over a byte encoding (parent digest, token count, token ids as little-endian
int64, then `repr` of the extra keys). Python's `hash()` would be faster but is 64-bit (a
crafted collision would serve one user's KV to another) and is randomized per process for `str`
(a cache salt). SHA-256 is stable across processes and Python versions, so hashes can later be
shared between engines; its cost is paid once per full block (figures: docs/performance.md, 'Choices elsewhere in the code').
Extra keys must be built from None, bool, int, str and tuples of them: their `repr` is stable.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

from tidepool.request import Request

BlockHash = NewType("BlockHash", bytes)
"""32-byte SHA-256 digest of a full block and (through its parent) of every block before it."""

NONE_HASH = BlockHash(hashlib.sha256(b"tidepool/kv-cache/root").digest())
"""The parent of the first block. A fixed constant (not a per-process seed): hashes stay comparable
across processes; isolation between users is the cache salt's job."""

ExtraKeys = tuple[object, ...]


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None
) -> BlockHash:
    hasher = hashlib.sha256(parent_hash or NONE_HASH)
    hasher.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    if extra_keys:
        hasher.update(repr(extra_keys).encode())
    return BlockHash(hasher.digest())


def block_extra_keys(request: Request, start: int, end: int) -> ExtraKeys | None:
    """What besides the token ids decides the KV of tokens [start, end).

    Token type ids count only when some are non-zero (None means all zeros, so both share
    blocks). An image's placeholders count with its content hash and where the block cuts its
    range (the same placeholder ids of two images are different KV). Chaining carries a
    block's keys into every later hash.
    """
    keys: list[object] = []
    if request.token_type_ids is not None:
        token_types = tuple(request.token_type_ids[start:end])
        if any(token_types):
            keys.append(("token_types", token_types))
    for feature in request.mm_features:
        if (part := feature.overlap(start, end)) is not None:
            keys.append(("mm", feature.identifier, part[0] - feature.offset, part[1] - part[0]))
    return tuple(keys) or None


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    prompt, output = request.prompt_token_ids, request.output_token_ids
    num_prompt_tokens = len(prompt)
    if end <= num_prompt_tokens:
        return prompt[start:end]
    if start >= num_prompt_tokens:
        return output[start - num_prompt_tokens : end - num_prompt_tokens]
    return prompt[start:] + output[: end - num_prompt_tokens]


def update_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend `request.block_hashes` to cover every full block of its tokens; returns the list.

    Incremental: O(new full blocks) per call, so calling it every step of a decode is cheap.
    """
    hashes: list[BlockHash] = request.block_hashes  # type: ignore[assignment]
    num_full_blocks = request.num_tokens // block_size
    parent = hashes[-1] if hashes else None
    for block_index in range(len(hashes), num_full_blocks):
        start, end = block_index * block_size, (block_index + 1) * block_size
        extra_keys = block_extra_keys(request, start, end)
        parent = hash_block_tokens(parent, _token_slice(request, start, end), extra_keys)
        hashes.append(parent)
    return hashes
