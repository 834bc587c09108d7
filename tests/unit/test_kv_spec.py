"""Specs, grouping layers into KV-cache groups (hybrid and uniform), sizing the shared pool."""

from __future__ import annotations

import pytest
import torch

from tidepool.kv_cache import spec as spec_module
from tidepool.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheGroup,
    SlidingWindowSpec,
    group_layers,
    plan_kv_cache,
)

FULL = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
SLIDING = SlidingWindowSpec(16, 8, 128, torch.bfloat16, sliding_window=4096)
PAGE = 2 * 16 * 8 * 128 * 2  # K and V, bf16: 64 KiB


def _hybrid_layers(num_full: int, num_sliding: int) -> dict:
    layers: dict = {f"full.{i}": FULL for i in range(num_full)}
    layers.update({f"swa.{i}": SLIDING for i in range(num_sliding)})
    return layers


def test_page_size_counts_k_and_v() -> None:
    assert FULL.page_size_bytes == PAGE == 65536
    assert SlidingWindowSpec(4, 1, 8, torch.float32, 8).page_size_bytes == 2 * 4 * 8 * 4


def test_specs_are_frozen_hashable_and_validated() -> None:
    assert FULL == FullAttentionSpec(16, 8, 128, torch.bfloat16) and hash(FULL)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        SlidingWindowSpec(16, 8, 128, torch.bfloat16, sliding_window=0)
    with pytest.raises(ValueError, match="block_size"):
        FullAttentionSpec(0, 8, 128, torch.bfloat16)


def test_equal_specs_form_one_group_and_encoder_layers_are_skipped() -> None:
    groups = group_layers({"l0": FULL, "enc": None, "l1": FULL})
    assert groups == [KVCacheGroup(FULL, ("l0", "l1"))]
    assert group_layers({"enc.0": None, "enc.1": None}) == []


def test_hybrid_layers_split_into_equal_size_groups_full_first() -> None:
    layers = {f"swa.{i}": SLIDING for i in range(8)}
    layers.update({f"full.{i}": FULL for i in range(4)})
    groups = group_layers(layers)
    assert [(type(g.spec).__name__, g.layer_names) for g in groups] == [
        ("FullAttentionSpec", ("full.0", "full.1", "full.2", "full.3")),
        ("SlidingWindowSpec", ("swa.0", "swa.1", "swa.2", "swa.3")),
        ("SlidingWindowSpec", ("swa.4", "swa.5", "swa.6", "swa.7")),
    ]


def test_nearly_equal_types_pad_instead_of_adding_a_group() -> None:
    groups = group_layers(_hybrid_layers(num_full=5, num_sliding=6))  # 6 < 1.25 * 5
    assert [len(group.layer_names) for group in groups] == [5, 6]


def test_uniform_switch_turns_sliding_layers_into_full_attention() -> None:
    groups = group_layers(_hybrid_layers(4, 8), uniform=True)
    assert len(groups) == 1 and groups[0].spec == FULL
    assert len(groups[0].layer_names) == 12


def test_mixed_block_sizes_are_rejected() -> None:
    other = FullAttentionSpec(32, 8, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="one block_size"):
        group_layers({"a": FULL, "b": other})


def test_plan_from_bytes_shares_one_tensor_per_slot() -> None:
    groups = group_layers(_hybrid_layers(4, 8))
    config = plan_kv_cache(groups, kv_cache_memory_bytes=10 * 4 * PAGE + 5)
    assert config.bytes_per_block == 4 * PAGE
    assert config.num_blocks == 10 and config.block_size == 16
    tensors = config.tensors
    assert [t.shared_by for t in tensors] == [
        ("full.0", "swa.0", "swa.4"),
        ("full.1", "swa.1", "swa.5"),
        ("full.2", "swa.2", "swa.6"),
        ("full.3", "swa.3", "swa.7"),
    ]
    assert all(t.size_bytes == 10 * PAGE for t in tensors)
    assert sum(t.size_bytes for t in tensors) <= 10 * 4 * PAGE + 5


def test_hybrid_blocks_are_cheaper_than_uniform_ones() -> None:
    budget = 120 * PAGE
    hybrid = plan_kv_cache(group_layers(_hybrid_layers(4, 8)), kv_cache_memory_bytes=budget)
    uniform = plan_kv_cache(
        group_layers(_hybrid_layers(4, 8), uniform=True), kv_cache_memory_bytes=budget
    )
    assert (hybrid.num_blocks, uniform.num_blocks) == (30, 10)


def test_different_page_sizes_are_sized_by_the_largest() -> None:
    small = SlidingWindowSpec(16, 4, 128, torch.bfloat16, sliding_window=512)
    groups = group_layers({"full.0": FULL, "swa.0": small})
    config = plan_kv_cache(groups, kv_cache_memory_bytes=3 * PAGE)
    assert config.page_size_bytes == PAGE and config.num_blocks == 3
    assert config.tensors[0].shared_by == ("full.0", "swa.0")


def test_plan_arguments_are_checked() -> None:
    groups = group_layers({"l0": FULL})
    with pytest.raises(ValueError, match="exactly one"):
        plan_kv_cache(groups)
    with pytest.raises(ValueError, match="exactly one"):
        plan_kv_cache(groups, kv_cache_memory_bytes=PAGE, memory_fraction=0.5)
    with pytest.raises(ValueError, match="need at least 2"):
        plan_kv_cache(groups, kv_cache_memory_bytes=PAGE)
    with pytest.raises(ValueError, match="no KV-cache groups"):
        plan_kv_cache([], kv_cache_memory_bytes=PAGE)
    with pytest.raises(ValueError, match="memory_fraction"):
        plan_kv_cache(groups, memory_fraction=1.5)


def test_plan_from_memory_fraction(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 1 << 30
    monkeypatch.setattr(spec_module, "device_memory_bytes", lambda device: (6 * gib, 8 * gib))
    # The process may use half of 8 GiB; 2 GiB are in use already: 2 GiB are left for the cache.
    config = plan_kv_cache(group_layers({"l0": FULL}), memory_fraction=0.5)
    assert config.num_blocks == 2 * gib // PAGE


def test_max_blocks_per_request() -> None:
    assert FULL.max_num_blocks_per_request(max_model_len=8192, max_num_batched_tokens=2048) == 512
    # window 4096 + chunk 2048 tokens live at once: cdiv(4095 + 2048, 16) + 1 = 385 blocks
    assert SLIDING.max_num_blocks_per_request(8192, 2048) == 385
    assert SLIDING.max_num_blocks_per_request(1024, 2048) == 64
