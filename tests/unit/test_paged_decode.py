"""tidepool's in-place decode attention (csrc/cpu_paged_decode.cpp) against paged SDPA over the
same cache: the same step planned twice, once with every row in SDPA buckets (gathered blocks,
additive masks) and once with the few-query rows handed to the kernel (paged_metadata's
split_decode_rows), for every block size the engine and tests use, full attention and sliding
windows, GQA ratios 1 / 2 / 4, soft-capping, contexts that end on, before and after block
boundaries, and rows of one and of several queries."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close

from tidepool.attention import cpu_paged_decode
from tidepool.attention.paged import paged_attention, write_kv
from tidepool.attention.paged_metadata import (
    build_group_metadata,
    plan_buckets,
    split_decode_rows,
    split_rows,
)
from tidepool.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec

needs_kernel = pytest.mark.skipif(
    cpu_paged_decode.load() is None, reason="the paged decode kernel is not built here"
)

NUM_HEADS = 4
# Contexts ending before, on and after block boundaries (block sizes 1, 4, 16), long ones too.
DECODE_CONTEXTS = [0, 1, 3, 4, 5, 15, 16, 17, 33, 70]


def _step(spec, context_lens, query_lens, in_place: bool, softcap, dtype=torch.float32):
    """One step's attention output over a cache holding the contexts' K/V (as earlier steps
    would have written it); blocks handed out in a shuffled order, so rows do not read
    neighbouring blocks by accident."""
    g = torch.Generator().manual_seed(3)
    kv_heads, head_size, block_size = spec.num_kv_heads, spec.head_size, spec.block_size
    blocks_per_row = [
        -(-(c + q) // block_size) for c, q in zip(context_lens, query_lens, strict=True)
    ]
    total = sum(blocks_per_row)
    ids = (torch.randperm(total, generator=g) + 1).tolist()  # block 0 is the null block
    block_table = torch.zeros(len(query_lens), max(blocks_per_row), dtype=torch.int64)
    for request, n in enumerate(blocks_per_row):
        block_table[request, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    kv_cache = torch.randn(2, kv_heads, total + 1, block_size, head_size, generator=g)
    kv_cache = kv_cache.to(dtype)  # stale values everywhere: nothing may read past a row's end
    for request, context_len in enumerate(context_lens):
        positions = torch.arange(context_len)
        slots = block_table[request, positions // block_size] * block_size + positions % block_size
        keys = torch.randn(context_len, kv_heads, head_size, generator=g).to(dtype)
        write_kv(kv_cache, keys, torch.randn(keys.shape, generator=g).to(dtype), slots)
    token_request = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    positions = torch.cat(
        [torch.arange(c, c + q) for c, q in zip(context_lens, query_lens, strict=True)]
    )
    rows = split_rows(context_lens, query_lens)
    decode_rows = []
    if in_place:
        rows, decode_rows = split_decode_rows(rows, cpu_paged_decode.MAX_QUERY_LEN)
        assert decode_rows
    spans = plan_buckets(rows, block_size, kv_heads, 0.25)
    meta = build_group_metadata(
        rows,
        spans,
        block_table,
        token_request,
        positions,
        spec,
        dtype,
        torch.device("cpu"),
        decode_rows=decode_rows,
    )
    assert (meta.decode is not None) == in_place
    num_tokens = sum(query_lens)
    qkv = torch.randn(num_tokens, (NUM_HEADS + 2 * kv_heads) * head_size, generator=g).to(dtype)
    # q / k / v as the models pass them: strided views of the fused QKV output.
    query = qkv[:, : NUM_HEADS * head_size].view(num_tokens, NUM_HEADS, head_size)
    key = qkv[:, NUM_HEADS * head_size : (NUM_HEADS + kv_heads) * head_size]
    value = qkv[:, (NUM_HEADS + kv_heads) * head_size :]
    key = key.reshape(num_tokens, kv_heads, head_size)
    value = value.reshape(num_tokens, kv_heads, head_size)
    return paged_attention(query, key, value, kv_cache, meta, head_size**-0.5, softcap)


def _compare(spec, context_lens, query_lens, softcap, dtype=torch.float32):
    expected = _step(spec, context_lens, query_lens, False, softcap, dtype)
    actual = _step(spec, context_lens, query_lens, True, softcap, dtype)
    assert (expected[0] - expected[-1]).abs().max() > 1e-2  # rows differ: a mix-up would show
    max_keys = max(c + q for c, q in zip(context_lens, query_lens, strict=True))
    if dtype == torch.float32:
        assert_close(actual, expected, depth=1, reduction=max(max_keys, spec.head_size))
    else:  # both sides compute in float32 from the same bf16 values; outputs rounded to bf16
        torch.testing.assert_close(actual.float(), expected.float(), rtol=1.6e-2, atol=1.6e-2)


@needs_kernel
@pytest.mark.parametrize("block_size", [1, 4, 16], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa2", "gqa4"])
@pytest.mark.parametrize("window", [None, 8], ids=["full", "window8"])
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["nocap", "softcap"])
def test_decodes_match_sdpa(block_size, kv_heads, window, softcap):
    if window is None:
        spec = FullAttentionSpec(block_size, kv_heads, 64, torch.float32)
    else:
        spec = SlidingWindowSpec(block_size, kv_heads, 64, torch.float32, window)
    context_lens = DECODE_CONTEXTS[::-1]  # the runner's order: longest first
    _compare(spec, context_lens, [1] * len(context_lens), softcap)


@needs_kernel
@pytest.mark.parametrize("window", [None, 6], ids=["full", "window6"])
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["nocap", "softcap"])
def test_rows_of_several_queries_match_sdpa(window, softcap):
    """Decodes beside rows of 2-16 queries (speculative-like rows, short prompts from 0, a
    chunk after a context) and a long prompt that stays in its causal SDPA row."""
    block_size = 4
    if window is None:
        spec = FullAttentionSpec(block_size, 2, 32, torch.float32)
    else:
        spec = SlidingWindowSpec(block_size, 2, 32, torch.float32, window)
    context_lens = [21, 9, 3, 0, 0, 13, 0]
    query_lens = [1, 1, 1, 40, 16, 3, 5]
    _compare(spec, context_lens, query_lens, softcap)


@needs_kernel
@pytest.mark.parametrize("head_size", [128, 256, 40])
def test_head_sizes(head_size):
    spec = FullAttentionSpec(16, 2, head_size, torch.float32)
    _compare(spec, [50, 17, 16, 2], [1, 1, 1, 1], None)


@needs_kernel
def test_bfloat16_cache():
    spec = SlidingWindowSpec(16, 2, 64, torch.bfloat16, 20)
    _compare(spec, [70, 33, 16, 4], [1, 1, 1, 2], 5.0, dtype=torch.bfloat16)


@needs_kernel
def test_refuses_bad_rows():
    """A row whose keys run past its block table is refused, not read out of bounds."""
    spec = FullAttentionSpec(4, 2, 32, torch.float32)
    kv_cache = torch.zeros(2, 2, 3, 4, 32)
    query = torch.zeros(1, 4, 32)
    out = torch.empty(1, 128)
    table = torch.tensor([[1, 2]], dtype=torch.int32)  # 8 keys at most
    lens = [torch.tensor([v], dtype=torch.int32) for v in (9, 0, 1)]
    with pytest.raises(RuntimeError, match="table width"):
        cpu_paged_decode.paged_decode(query, kv_cache, table, *lens, None, 1.0, None, out)
    bad_block = torch.tensor([[1, 7]], dtype=torch.int32)
    lens[0] = torch.tensor([8], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_paged_decode.paged_decode(query, kv_cache, bad_block, *lens, None, 1.0, None, out)
    assert spec.head_size == 32


@needs_kernel
def test_engine_decodes_in_place_and_matches_sdpa(tiny_decoder_llm, monkeypatch):
    """The runner hands decodes to the kernel where it runs (a sliding-window + full model),
    and greedy tokens equal those of the SDPA buckets (in_place_decode_len 0)."""
    from tidepool import SamplingParams
    from tidepool.attention import paged

    llm = tiny_decoder_llm("qwen2-hybrid")
    runner = llm.engine.model_runner
    assert runner.attn_builder.in_place_decode_len == cpu_paged_decode.MAX_QUERY_LEN
    calls = []
    kernel = paged.cpu_paged_decode.paged_decode

    def counted(*args):
        calls.append(args[6])  # the window
        return kernel(*args)

    monkeypatch.setattr(paged.cpu_paged_decode, "paged_decode", counted)
    prompts = ["The quick brown fox", "Paged attention stores keys and values in blocks."]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)  # past the window
    in_place = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert set(calls) == {None, 16}  # both groups' layers decoded in place
    monkeypatch.setattr(runner.attn_builder, "in_place_decode_len", 0)
    calls.clear()
    sdpa = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert not calls
    assert in_place == sdpa
