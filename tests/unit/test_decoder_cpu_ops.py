"""tidepool's CPU decoder kernels (csrc/cpu_decoder_ops.cpp) against the torch ops they replace,
and causal rows (whole prompts from position 0, is_causal SDPA on the step's own K/V) against the
padded buckets over the paged cache."""

from __future__ import annotations

import pytest
import torch
from cpu_isa import build_fixture

from tidepool.attention import cpu_decoder_ops, cpu_kernels
from tidepool.attention.backend import PAGED_SDPA
from tidepool.attention.paged import write_kv
from tidepool.attention.paged_metadata import build_group_metadata, plan_buckets, split_rows
from tidepool.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec
from tidepool.models.layers.rotary import apply_rotary

decoder_isa = build_fixture(cpu_kernels.BUILD_ISAS, cpu_decoder_ops.load, "the CPU decoder kernels")
"""Each kernel test runs once per build (AVX-512, AVX2 + FMA) the CPU can run."""
needs_kernels = pytest.mark.usefixtures("decoder_isa")


def _torch_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@needs_kernels
def test_rms_norm_matches_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 2 * 96, generator=g)[:, :96]  # rows with a stride
    weight = torch.randn(96, generator=g)
    out = cpu_decoder_ops.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, _torch_rms(x, weight, 1e-6), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 31, 33, 700])
def test_rms_norm_within_its_float32_bound_of_float64(rows):
    """Against float64 on the same inputs: the sum of H squares in float32 is within
    (H + 1)·u relative (u = 2^-24, any summation order), 1 / sqrt of it within half that plus
    2u, the two products 2u more: |out - ref| <= ((H + 1) / 2 + 5)·u·|ref|. Rows are
    independent: each row alone gives the same bits as in the batch."""
    g = torch.Generator().manual_seed(4)
    hidden = 200  # not a multiple of either ISA's vector width
    x = torch.randn(rows, hidden, generator=g) * 3
    weight = torch.randn(hidden, generator=g)
    out = cpu_decoder_ops.rms_norm(x, weight, 1e-6)
    ref = _torch_rms(x.double(), weight.double(), 1e-6)
    bound = ((hidden + 1) / 2 + 5) * 2.0**-24 * ref.abs()
    assert ((out.double() - ref).abs() <= bound).all()
    assert (out.double() - ref).abs().max() > 0 or rows == 1  # float32, not a float64 copy
    for r in sorted({0, rows // 2, rows - 1}):
        assert torch.equal(cpu_decoder_ops.rms_norm(x[r : r + 1], weight, 1e-6), out[r : r + 1])


@needs_kernels
@pytest.mark.parametrize("with_norm", [True, False], ids=["qk-norm", "rope-only"])
@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["full-rotary", "partial-rotary"])
def test_qk_norm_rope_matches_torch(with_norm, rotary_dim):
    g = torch.Generator().manual_seed(1)
    num_tokens, num_heads, num_kv_heads, head_size = 29, 4, 2, 64
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=g)
    qk = qkv[:, : (num_heads + num_kv_heads) * head_size].view(num_tokens, -1, head_size)
    angles = torch.rand(num_tokens, rotary_dim // 2, generator=g) * 50
    cos, sin = angles.cos(), angles.sin()
    q_weight = torch.randn(head_size, generator=g) if with_norm else None
    k_weight = torch.randn(head_size, generator=g) if with_norm else None
    q_ref, k_ref = qk[:, :num_heads].clone(), qk[:, num_heads:].clone()
    cpu_decoder_ops.qk_norm_rope_(qk, num_heads, q_weight, k_weight, 1e-6, cos, sin)
    q, k = qk[:, :num_heads], qk[:, num_heads:]
    if with_norm:
        q_ref, k_ref = _torch_rms(q_ref, q_weight, 1e-6), _torch_rms(k_ref, k_weight, 1e-6)
    q_ref = apply_rotary(q_ref, cos[:, None], sin[:, None])
    k_ref = apply_rotary(k_ref, cos[:, None], sin[:, None])
    assert (q[0] - q[1]).abs().max() > 1e-2  # different tokens differ
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_index_put(dtype):
    g = torch.Generator().manual_seed(2)
    kv_heads, num_blocks, block_size, head_size = 2, 6, 4, 16
    kv = torch.randn(9, 3 * kv_heads * head_size, generator=g).to(dtype)
    key = kv[:, : kv_heads * head_size].view(9, kv_heads, head_size)
    value = kv[:, kv_heads * head_size : 2 * kv_heads * head_size].view(9, kv_heads, head_size)
    slots = torch.tensor([5, 6, 7, 8, 20, 21, 22, 2, 3])
    cache = torch.zeros(2, kv_heads, num_blocks, block_size, head_size, dtype=dtype)
    assert cpu_decoder_ops.write_kv(cache, key, value, slots)
    expected = torch.zeros_like(cache)
    flat = expected.view(2, kv_heads, num_blocks * block_size, head_size)
    flat[0][:, slots] = key.transpose(0, 1)
    flat[1][:, slots] = value.transpose(0, 1)
    assert torch.equal(cache, expected)


def _paged_step(spec, context_lens, query_lens, causal_rows: bool, softcap) -> torch.Tensor:
    """One step's attention output, contexts' K/V written first as earlier steps would have."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, head_size, block_size = 4, spec.num_kv_heads, spec.head_size, spec.block_size
    max_blocks = max(
        -(-(c + q) // block_size) for c, q in zip(context_lens, query_lens, strict=True)
    )
    block_table = torch.zeros(len(query_lens), max_blocks, dtype=torch.int64)
    next_block = 1
    for request, (c, q) in enumerate(zip(context_lens, query_lens, strict=True)):
        num_blocks = -(-(c + q) // block_size)
        block_table[request, :num_blocks] = torch.arange(next_block, next_block + num_blocks)
        next_block += num_blocks
    kv_cache = torch.zeros(2, kv_heads, next_block, block_size, head_size)
    for request, context_len in enumerate(context_lens):
        positions = torch.arange(context_len)
        slots = block_table[request, positions // block_size] * block_size + positions % block_size
        keys = torch.randn(context_len, kv_heads, head_size, generator=g)
        write_kv(kv_cache, keys, torch.randn(keys.shape, generator=g), slots)
    token_request = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    positions = torch.cat(
        [torch.arange(c, c + q) for c, q in zip(context_lens, query_lens, strict=True)]
    )
    rows = split_rows(context_lens, query_lens, causal_rows=causal_rows)
    assert causal_rows or not any(r.causal for r in rows)
    spans = plan_buckets(rows, block_size, kv_heads, 0.25)
    meta = build_group_metadata(
        rows, spans, block_table, token_request, positions, spec, torch.float32, torch.device("cpu")
    )
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, heads, head_size, generator=g)
    key = torch.randn(num_tokens, kv_heads, head_size, generator=g)
    value = torch.randn(num_tokens, kv_heads, head_size, generator=g)
    return PAGED_SDPA.paged_attention(query, key, value, kv_cache, meta, head_size**-0.5, softcap)


@pytest.mark.parametrize(
    "spec",
    [FullAttentionSpec(4, 2, 16, torch.float32), SlidingWindowSpec(4, 2, 16, torch.float32, 64)],
    ids=["full", "sliding-window"],
)
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["sdpa", "softcap"])
def test_causal_rows_match_buckets(spec, softcap):
    # decodes, a chunk after a context, and prompts from 0 (two of one length share a call)
    context_lens, query_lens = [9, 7, 12, 0, 0, 0, 0], [1, 1, 20, 40, 23, 23, 5]
    causal = _paged_step(spec, context_lens, query_lens, True, softcap)
    bucketed = _paged_step(spec, context_lens, query_lens, False, softcap)
    assert (causal[30] - causal[31]).abs().max() > 1e-2
    torch.testing.assert_close(causal, bucketed, rtol=1e-5, atol=1e-5)
