"""worker/memory.py: the oneDNN cache caps and the throttled heap trim, without a model."""

from __future__ import annotations

import os

import pytest
import torch

from tidepool import envs
from tidepool.worker import memory
from tidepool.worker.memory import CACHE_CAPACITY_VARIABLES, TRIM_INTERVAL_S, NativeMemory


@pytest.fixture
def clean_env(monkeypatch):
    for name in (*CACHE_CAPACITY_VARIABLES, "TIDEPOOL_ONEDNN_CACHE_CAPACITY", "LD_PRELOAD"):
        # setenv first, so that the undo also removes what NativeMemory.start sets.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def test_capacity_variable(clean_env):
    assert envs.onednn_cache_capacity() == "auto"
    clean_env.setenv("TIDEPOOL_ONEDNN_CACHE_CAPACITY", "64")
    assert envs.onednn_cache_capacity() == 64
    clean_env.setenv("TIDEPOOL_ONEDNN_CACHE_CAPACITY", "Torch")
    assert envs.onednn_cache_capacity() == "torch"
    clean_env.setenv("TIDEPOOL_ONEDNN_CACHE_CAPACITY", "-1")
    with pytest.raises(ValueError, match="TIDEPOOL_ONEDNN_CACHE_CAPACITY"):
        envs.onednn_cache_capacity()


def test_start_caps_both_caches_and_keeps_the_users_choice(clean_env):
    clean_env.setenv("LRU_CACHE_CAPACITY", "17")
    native = NativeMemory.start(torch.float32)
    assert native.policy.cache_capacity == 256
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "256"
    assert os.environ["LRU_CACHE_CAPACITY"] == "17"


def test_auto_capacity_follows_the_dtype(clean_env):
    assert NativeMemory.start(torch.bfloat16).policy.cache_capacity == 1024
    clean_env.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    clean_env.setenv("TIDEPOOL_ONEDNN_CACHE_CAPACITY", "64")
    assert NativeMemory.start(torch.bfloat16).policy.cache_capacity == 64
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"


def test_int8_keeps_torchs_capacity(clean_env):
    """An int8 model runs in float32 but its primitives build slowly, as bfloat16's do."""
    assert NativeMemory.start(torch.float32, "int8").policy.cache_capacity == 1024
    clean_env.setenv("TIDEPOOL_ONEDNN_CACHE_CAPACITY", "64")
    assert NativeMemory.start(torch.float32, "int8").policy.cache_capacity == 64


def test_torch_setting_changes_nothing(clean_env):
    clean_env.setenv("TIDEPOOL_ONEDNN_CACHE_CAPACITY", "torch")
    native = NativeMemory.start(torch.float32)
    assert native.policy.cache_capacity is None and not native.policy.trims
    assert not any(name in os.environ for name in CACHE_CAPACITY_VARIABLES)
    assert native.after_step(now=1e12) is False


def test_finds_glibc_malloc_trim_unless_another_allocator_is_preloaded(clean_env):
    if not os.path.exists("/proc/self/maps") or "libc.so.6" not in open("/proc/self/maps").read():
        pytest.skip("not glibc")
    assert NativeMemory.start(torch.float32).policy.trims
    assert memory._find_malloc_trim()(0) in (0, 1)
    clean_env.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert not NativeMemory.start(torch.float32).policy.trims


def test_after_step_trims_at_most_once_per_interval():
    calls: list[int] = []
    native = NativeMemory(memory.NativeMemoryPolicy(256, True), malloc_trim=calls.append)
    start = native._last_trim
    assert native.after_step(now=start + TRIM_INTERVAL_S / 2) is False
    assert native.after_step(now=start + TRIM_INTERVAL_S) is True
    # the clock restarts at the trim: the next step right after does not trim again.
    assert native.after_step() is False
    assert calls == [0] and native.num_trims == 1


def test_resident_set_bytes():
    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc")
    rss = memory.resident_set_bytes()
    assert rss is not None and 10 * 2**20 < rss < 2**40
    assert memory.resident_set_bytes(pid=2**31 - 1) is None
