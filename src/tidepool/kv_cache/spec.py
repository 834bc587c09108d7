"""KV-cache specs per layer, grouping layers into KV-cache groups, sizing the one shared block pool.

Memory layout (same idea as vLLM's hybrid allocator). Layers with equal specs form a type; each type
is cut into groups of `group_size` layers, so every group has (at most) the same number of layers.
Group j's i-th layer and group k's i-th layer share one tensor: a block id belongs to exactly one
group at a time (the pool hands it out once), so the layers of different groups never write the same
block. Worked example, 8 sliding-window layers S0..S7 and 4 full-attention layers F0..F3:

    group_size = 4            groups: G0 = [F0 F1 F2 F3]  G1 = [S0 S1 S2 S3]  G2 = [S4 S5 S6 S7]
    tensor slot 0: F0 S0 S4   each slot is a [num_blocks, page_size_bytes] buffer;
    tensor slot 1: F1 S1 S5   block b of G1 lives at row b of every slot, seen through S0..S3
    tensor slot 2: F2 S2 S6   bytes per block = page_size_bytes * group_size (4 pages here, not 12)
    tensor slot 3: F3 S3 S7

So a hybrid model pays for a block once per slot, and sliding-window groups that hold only the blocks
inside their window leave the rest of the pool to the full-attention group.

Page sizes: all groups must share one `block_size` (one chain of block hashes per request). When
their page sizes differ, each slot row is as large as the largest page; a layer with a smaller page
uses the first `page_size_bytes` of its row (a strided view, wasting the rest). Real hybrid models
(Gemma 2/3, GPT-OSS, Mistral) have equal page sizes, so nothing is wasted there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

# Imported into this module's namespace: plan_kv_cache reads it from here (tests patch it here).
from tidepool.devices import device_memory_bytes

# Fewer layers than this fraction of the largest type -> pad groups to the largest type rather than
# creating an extra, mostly empty group (vLLM uses the same 1.25 rule).
_GROUP_PAD_RATIO = 1.25


def _cdiv(num: int, den: int) -> int:
    return -(-num // den)


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer stores per block. Subclasses say which tokens stay attendable.

    A layer without a spec (`None` in a layer map) keeps no cache: encoder (bidirectional) attention.
    """

    block_size: int
    """Tokens per block."""
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if min(self.block_size, self.num_kv_heads, self.head_size) < 1:
            raise ValueError(f"block_size, num_kv_heads and head_size must be >= 1: {self}")

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: K and V, [2, block_size, num_kv_heads, head_size]."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

    def max_num_blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Most blocks one request can hold at once in a group of this spec."""
        return _cdiv(max_model_len, self.block_size)


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Causal attention over every earlier token: blocks are kept until the request ends."""


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """Token p attends to positions [p - sliding_window + 1, p]; older blocks can be dropped."""

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    def max_num_blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        # A chunk of T new tokens needs the window-1 tokens before it as well; +1 for misalignment.
        num_live_tokens = self.sliding_window - 1 + max_num_batched_tokens
        full = super().max_num_blocks_per_request(max_model_len, max_num_batched_tokens)
        return min(full, _cdiv(num_live_tokens, self.block_size) + 1)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one spec and one block table per request."""

    spec: KVCacheSpec
    layer_names: tuple[str, ...]


@dataclass(frozen=True)
class KVCacheTensor:
    """One buffer of `size_bytes` ([num_blocks, page_size_bytes]) seen by every layer in `shared_by`."""

    size_bytes: int
    shared_by: tuple[str, ...]


def _as_uniform(spec: KVCacheSpec) -> KVCacheSpec:
    if isinstance(spec, SlidingWindowSpec):
        return FullAttentionSpec(spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype)
    return spec


def group_layers(
    layer_specs: dict[str, KVCacheSpec | None], *, uniform: bool = False
) -> list[KVCacheGroup]:
    """Group layers by spec into groups of equal size (see the module docstring).

    `uniform=True` treats sliding-window layers as full attention (they keep every block; the model
    still applies its window), which gives one group when the head shapes agree: the baseline that
    the hybrid layout is measured against. Full-attention groups come first.
    """
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        if spec is None:
            continue
        key = _as_uniform(spec) if uniform else spec
        by_spec.setdefault(key, []).append(name)
    if not by_spec:
        return []
    block_sizes = {spec.block_size for spec in by_spec}
    if len(block_sizes) > 1:
        raise ValueError(
            f"all KV-cache layers must share one block_size, got {sorted(block_sizes)}"
        )
    min_layers = min(len(names) for names in by_spec.values())
    max_layers = max(len(names) for names in by_spec.values())
    group_size = max_layers if max_layers < min_layers * _GROUP_PAD_RATIO else min_layers
    ordered = sorted(by_spec.items(), key=lambda item: not isinstance(item[0], FullAttentionSpec))
    return [
        KVCacheGroup(spec, tuple(names[start : start + group_size]))
        for spec, names in ordered
        for start in range(0, len(names), group_size)
    ]


@dataclass(frozen=True)
class KVCacheConfig:
    """The planned pool: `num_blocks` block ids (0 is the null block), shared by every group."""

    num_blocks: int
    groups: tuple[KVCacheGroup, ...]

    @property
    def block_size(self) -> int:
        return self.groups[0].spec.block_size

    @property
    def page_size_bytes(self) -> int:
        """Row size of every tensor slot: the largest page of any group."""
        return max(group.spec.page_size_bytes for group in self.groups)

    @property
    def num_tensor_slots(self) -> int:
        return max(len(group.layer_names) for group in self.groups)

    @property
    def bytes_per_block(self) -> int:
        return self.page_size_bytes * self.num_tensor_slots

    @property
    def tensors(self) -> tuple[KVCacheTensor, ...]:
        """Slot i is shared by the i-th layer of every group that has one."""
        size_bytes = self.num_blocks * self.page_size_bytes
        return tuple(
            KVCacheTensor(
                size_bytes,
                tuple(g.layer_names[slot] for g in self.groups if slot < len(g.layer_names)),
            )
            for slot in range(self.num_tensor_slots)
        )


def plan_kv_cache(
    groups: list[KVCacheGroup],
    kv_cache_memory_bytes: int | None = None,
    memory_fraction: float | None = None,
    *,
    device: torch.device | None = None,
) -> KVCacheConfig:
    """Size one pool from an explicit byte budget or from a fraction of the device's memory.

    `memory_fraction` caps the whole process at `fraction * total` and gives the KV cache what is
    left after what is in use now, so call it after the model is loaded (and, on GPU, after a
    profiling forward pass so activations are counted). Exactly one of the two must be given.
    """
    if not groups:
        raise ValueError("no KV-cache groups: the model has no layer that keeps a KV cache")
    if (kv_cache_memory_bytes is None) == (memory_fraction is None):
        raise ValueError("give exactly one of kv_cache_memory_bytes and memory_fraction")
    if memory_fraction is not None:
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        free, total = device_memory_bytes(device or torch.device("cpu"))
        kv_cache_memory_bytes = int(memory_fraction * total) - (total - free)
    assert kv_cache_memory_bytes is not None
    config = KVCacheConfig(num_blocks=0, groups=tuple(groups))
    num_blocks = max(kv_cache_memory_bytes, 0) // config.bytes_per_block
    if num_blocks < 2:
        raise ValueError(
            f"KV-cache budget of {kv_cache_memory_bytes} bytes holds {num_blocks} blocks of "
            f"{config.bytes_per_block} bytes; need at least 2 (block 0 is the null block)"
        )
    return replace(config, num_blocks=num_blocks)
