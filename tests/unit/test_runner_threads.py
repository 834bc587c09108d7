"""Small CPU encoder steps run on one thread; the thread count comes back after the step."""

from __future__ import annotations

import pytest
import torch

from tidepool.worker.model_runner import (
    SINGLE_THREAD_MAX_TOKENS,
    SINGLE_THREAD_MAX_TOKENS_QUANTIZED,
    _threads_for_step,
)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_small_step_runs_on_one_thread_and_restores(two_threads):
    cpu = torch.device("cpu")
    limit = SINGLE_THREAD_MAX_TOKENS[torch.bfloat16]
    with _threads_for_step(limit, torch.bfloat16, cpu):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), _threads_for_step(8, torch.float32, cpu):
        assert torch.get_num_threads() == 1
        raise RuntimeError("a failing step still gives the threads back")
    assert torch.get_num_threads() == 2


def test_large_steps_and_other_devices_keep_all_threads(two_threads):
    cpu = torch.device("cpu")
    with _threads_for_step(SINGLE_THREAD_MAX_TOKENS[torch.bfloat16] + 1, torch.bfloat16, cpu):
        assert torch.get_num_threads() == 2
    with _threads_for_step(SINGLE_THREAD_MAX_TOKENS[torch.float32] + 1, torch.float32, cpu):
        assert torch.get_num_threads() == 2
    with _threads_for_step(4, torch.bfloat16, torch.device("meta")):
        assert torch.get_num_threads() == 2


def test_quantized_steps_use_their_own_limit(two_threads):
    cpu = torch.device("cpu")
    limit = SINGLE_THREAD_MAX_TOKENS_QUANTIZED["int8"]
    with _threads_for_step(limit, torch.float32, cpu, quantization="int8"):
        assert torch.get_num_threads() == 1
    with _threads_for_step(limit + 1, torch.float32, cpu, quantization="int8"):
        assert torch.get_num_threads() == 2
