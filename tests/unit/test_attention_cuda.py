"""The torch-op attention backends on a CUDA device give what they give on the CPU: bucketed SDPA
(encoders, padded layout) and paged SDPA (decoders, over the paged KV cache). Marked `gpu`;
skipped where torch sees no CUDA device (the default test run needs none)."""

from __future__ import annotations

import pytest
import torch

from tidepool.attention.backend import BUCKETED_SDPA, PAGED_SDPA
from tidepool.attention.metadata import build_encoder_metadata, pad_buckets
from tidepool.attention.paged import write_kv
from tidepool.attention.paged_metadata import build_group_metadata, plan_buckets, split_rows
from tidepool.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# float32 on both sides (TF32 is off for matmuls by default): only summation orders differ.
ATOL = 1e-4


def _encoder_outputs(qkv: torch.Tensor, seq_lens: list[int], device: torch.device):
    heads, head_dim = qkv.shape[2], qkv.shape[3]
    meta = build_encoder_metadata(seq_lens, device, num_heads=heads, dtype=qkv.dtype)
    layout = pad_buckets(meta)
    slots = qkv.to(device).index_select(0, layout.token_index)
    scale = head_dim**-0.5
    out = BUCKETED_SDPA.attend(slots, layout.metadata, scale).index_select(0, layout.slot_of_token)
    first = BUCKETED_SDPA.attend_first_tokens(slots, layout.metadata, scale)
    return out.cpu(), first.cpu()


def test_bucketed_sdpa_on_cuda_matches_cpu():
    torch.manual_seed(0)
    seq_lens = [57, 55, 50, 31, 30, 12, 12, 5, 1]
    qkv = torch.randn(sum(seq_lens), 3, 4, 32)
    cpu_out, cpu_first = _encoder_outputs(qkv, seq_lens, torch.device("cpu"))
    gpu_out, gpu_first = _encoder_outputs(qkv, seq_lens, torch.device("cuda"))
    assert (cpu_out[0] - cpu_out[57]).abs().max() > 1e-2  # different sequences differ
    assert (gpu_out - cpu_out).abs().max().item() <= ATOL
    assert (gpu_first - cpu_first).abs().max().item() <= ATOL


def _paged_outputs(spec, device: torch.device) -> torch.Tensor:
    """Decodes A (context 9) and B (7) and a prefill C (6 tokens) over 4-token blocks; the
    contexts' K/V are written first, as earlier steps would have."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, head_size, block_size = 4, spec.num_kv_heads, spec.head_size, spec.block_size
    context_lens, query_lens = [9, 7, 0], [1, 1, 6]
    block_table = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 0, 0]])
    kv_cache = torch.zeros(2, kv_heads, 8, block_size, head_size, device=device)
    for request, context_len in enumerate(context_lens):
        positions = torch.arange(context_len)
        slots = block_table[request, positions // block_size] * block_size + positions % block_size
        keys = torch.randn(context_len, kv_heads, head_size, generator=g)
        values = torch.randn(context_len, kv_heads, head_size, generator=g)
        write_kv(kv_cache, keys.to(device), values.to(device), slots.to(device))
    token_request = torch.repeat_interleave(torch.arange(3), torch.tensor(query_lens))
    positions = torch.cat(
        [torch.arange(c, c + q) for c, q in zip(context_lens, query_lens, strict=True)]
    )
    rows = split_rows(context_lens, query_lens)
    spans = plan_buckets(rows, block_size, kv_heads, 0.25)
    meta = build_group_metadata(
        rows, spans, block_table, token_request, positions, spec, torch.float32, device
    )
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, heads, head_size, generator=g)
    key = torch.randn(num_tokens, kv_heads, head_size, generator=g)
    value = torch.randn(num_tokens, kv_heads, head_size, generator=g)
    out = PAGED_SDPA.paged_attention(
        query.to(device), key.to(device), value.to(device), kv_cache, meta, head_size**-0.5
    )
    return out.cpu()


@pytest.mark.parametrize(
    "spec",
    [
        FullAttentionSpec(4, 2, 16, torch.float32),
        SlidingWindowSpec(4, 2, 16, torch.float32, 5),
    ],
    ids=["full", "sliding-window"],
)
def test_paged_sdpa_on_cuda_matches_cpu(spec):
    cpu_out = _paged_outputs(spec, torch.device("cpu"))
    gpu_out = _paged_outputs(spec, torch.device("cuda"))
    assert cpu_out.shape == (8, 4 * 16)
    assert (cpu_out[0] - cpu_out[1]).abs().max() > 1e-2
    assert (gpu_out - cpu_out).abs().max().item() <= ATOL
