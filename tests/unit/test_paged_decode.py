"""tidepool's in-place decode attention (csrc/cpu_paged_decode.cpp) against paged SDPA over the
same cache: the same step planned twice, once with every row in SDPA buckets (gathered blocks,
additive masks) and once with the few-query rows handed to the kernel (paged_metadata's
split_decode_rows), for every block size the engine and tests use, full attention and sliding
windows, GQA ratios 1 / 2 / 4, soft-capping, contexts that end on, before and after block
boundaries, and rows of one and of several queries; each test once per ISA build the CPU runs
(AVX-512 and AVX2 + FMA, tests/cpu_isa.py: TIDEPOOL_CPU_ISA chooses the build the engine takes)."""

from __future__ import annotations

import pytest
import torch
from cpu_isa import build_fixture
from tolerances import assert_close

from tidepool.attention import cpu_kernels, cpu_paged_decode
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

decode_isa = build_fixture(cpu_kernels.BUILD_ISAS, cpu_paged_decode.load, "the paged decode kernel")

NUM_HEADS = 4
# Contexts ending before, on and after block boundaries (block sizes 1, 4, 16), long ones too.
DECODE_CONTEXTS = [0, 1, 3, 4, 5, 15, 16, 17, 33, 70]


def _step(
    spec, context_lens, query_lens, in_place: bool, softcap, dtype=torch.float32, max_len=None
):
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
        rows, decode_rows = split_decode_rows(rows, max_len or cpu_paged_decode.MAX_QUERY_LEN)
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


def _compare(spec, context_lens, query_lens, softcap, dtype=torch.float32, max_len=None):
    expected = _step(spec, context_lens, query_lens, False, softcap, dtype)
    actual = _step(spec, context_lens, query_lens, True, softcap, dtype, max_len)
    assert (expected[0] - expected[-1]).abs().max() > 1e-2  # rows differ: a mix-up would show
    max_keys = max(c + q for c, q in zip(context_lens, query_lens, strict=True))
    if dtype == torch.float32:
        assert_close(actual, expected, depth=1, reduction=max(max_keys, spec.head_size))
    else:  # both sides compute in float32 from the same bf16 values; outputs rounded to bf16
        torch.testing.assert_close(actual.float(), expected.float(), rtol=1.6e-2, atol=1.6e-2)


@needs_kernel
@pytest.mark.parametrize("block_size", [1, 4, 16, 32], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa2", "gqa4"])
@pytest.mark.parametrize("window", [None, 8], ids=["full", "window8"])
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["nocap", "softcap"])
def test_decodes_match_sdpa(decode_isa, block_size, kv_heads, window, softcap):
    if window is None:
        spec = FullAttentionSpec(block_size, kv_heads, 64, torch.float32)
    else:
        spec = SlidingWindowSpec(block_size, kv_heads, 64, torch.float32, window)
    context_lens = DECODE_CONTEXTS[::-1]  # the runner's order: longest first
    _compare(spec, context_lens, [1] * len(context_lens), softcap)


@needs_kernel
@pytest.mark.parametrize("window", [None, 6], ids=["full", "window6"])
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["nocap", "softcap"])
def test_rows_of_several_queries_match_sdpa(decode_isa, window, softcap):
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
@pytest.mark.parametrize("head_size", [128, 256, 40, 72])
def test_head_sizes(decode_isa, head_size):
    """Heads of 16k and 16k + 8 floats (AVX-512's masked half vector at a head's end)."""
    spec = FullAttentionSpec(16, 2, head_size, torch.float32)
    _compare(spec, [50, 17, 16, 2], [1, 1, 1, 1], None)


@needs_kernel
def test_bfloat16_cache(decode_isa):
    spec = SlidingWindowSpec(16, 2, 64, torch.bfloat16, 20)
    _compare(spec, [70, 33, 16, 4], [1, 1, 1, 2], 5.0, dtype=torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("window", [None, 256], ids=["full", "window256"])
def test_gemma2_benchmark_shape(decode_isa, window):
    """The Gemma-2 workload's layers (benchmarks/generate_vs_vllm.py): heads of 128, GQA 2,
    soft-cap 50, windows of 256 over contexts of 500-1,000 tokens (many blocks, the window
    starting inside a block), decodes beside a short chunk."""
    if window is None:
        spec = FullAttentionSpec(16, 2, 128, torch.float32)
    else:
        spec = SlidingWindowSpec(16, 2, 128, torch.float32, window)
    _compare(spec, [999, 700, 517, 255, 40], [1, 1, 1, 1, 5], 50.0)


@needs_kernel
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("window", [None, 40], ids=["full", "window40"])
@pytest.mark.parametrize("softcap", [None, 50.0], ids=["nocap", "softcap"])
def test_long_rows_match_sdpa(decode_isa, head_size, block_size, window, softcap):
    """The kernel's GEMM-shaped path (rows of >= 8 queries, heads of 64k): prompt chunks after a
    context and tiles of long prompts (8-512 queries: one query tile, several, a partial last
    one), windows shorter and longer than a tile, contexts ending inside blocks, beside decodes."""
    if window is None:
        spec = FullAttentionSpec(block_size, 2, head_size, torch.float32)
    else:
        spec = SlidingWindowSpec(block_size, 2, head_size, torch.float32, window)
    context_lens = [300, 77, 1, 3, 5, 31]  # from 0 they would be causal rows (SDPA)
    query_lens = [1, 1, 600, 100, 8, 45]  # 600: tiles of 512 and 88
    _compare(spec, context_lens, query_lens, softcap, max_len=cpu_paged_decode.LONG_ROW_QUERY_LEN)


@needs_kernel
def test_long_rows_bfloat16(decode_isa):
    spec = SlidingWindowSpec(16, 2, 64, torch.bfloat16, 20)
    lens = cpu_paged_decode.LONG_ROW_QUERY_LEN
    _compare(spec, [70, 2, 3], [1, 60, 33], 5.0, torch.bfloat16, lens)


@needs_kernel
def test_tanh_soft_cap_matches_torch(decode_isa):
    """The kernel's vector tanh (soft-capping) against float64 tanh across both of its branches
    (|x| below and above 0.625) and saturation, read through the output: two keys with scores
    a and 0, V = e0 and 0, so output[0] = p(key 0) = sigmoid(cap * tanh(a / cap))."""
    cap = 2.0
    kv_cache = torch.zeros(2, 1, 2, 2, 16)
    kv_cache[1, 0, 1, 0, 0] = 1.0  # V of key 0 = e0, key 1 = 0: output[0] = p(key 0)
    table = torch.tensor([[1]], dtype=torch.int32)
    lens = [torch.tensor([v], dtype=torch.int32) for v in (2, 0, 1)]
    for a in torch.linspace(-12, 12, 97).tolist():
        query = torch.zeros(1, 1, 16)
        query[0, 0, 0] = a
        kv_cache[0, 0, 1, 0, 0] = 1.0  # q . k0 = a, q . k1 = 0
        out = torch.empty(1, 16)
        cpu_paged_decode.paged_decode(query, kv_cache, table, *lens, None, 1.0, cap, out)
        s = cap * torch.tanh(torch.tensor(a, dtype=torch.float64) / cap)
        expected = torch.sigmoid(s).item()
        assert abs(out[0, 0].item() - expected) <= 2e-6 * expected, (a, out[0, 0].item())


@needs_kernel
def test_refuses_bad_rows(decode_isa):
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
def test_engine_decodes_in_place_and_matches_sdpa(decode_isa, tiny_decoder_llm, monkeypatch):
    """The runner hands decodes to the kernel where it runs (a sliding-window + full model),
    and greedy tokens equal those of the SDPA buckets (in_place_decode_len 0)."""
    from tidepool import SamplingParams
    from tidepool.attention import paged

    llm = tiny_decoder_llm("qwen2-hybrid")
    runner = llm.engine.model_runner
    assert runner.in_place_decode_len == cpu_paged_decode.max_query_len(
        runner.attention_views[0][1].head_size
    )
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
    monkeypatch.setattr(runner, "in_place_decode_len", 0)
    calls.clear()
    sdpa = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert not calls
    assert in_place == sdpa


@needs_kernel
def test_engine_long_rows_in_place_match_sdpa(decode_isa, tmp_path, monkeypatch):
    """A Gemma 2 with heads of 64 (window 16, soft-cap): prompts longer than the window and
        prefill chunks after a context are non-causal rows of many queries, which the runner hands
        to the kernel's GEMM-shaped path; greedy tokens equal those of the SDPA buckets and of
    transformers' eager Gemma 2."""
    import transformers
    from tiny_decoders import save_tokenizer

    from tidepool import LLM, SamplingParams
    from tidepool.attention import paged

    vocab = save_tokenizer(tmp_path)
    config = transformers.Gemma2Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=16,
        query_pre_attn_scalar=64, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        max_position_embeddings=512, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "eager"  # soft-capping needs it (tests/models/test_gemma.py)
    torch.manual_seed(5)
    hf = transformers.Gemma2ForCausalLM(config).eval()
    hf.save_pretrained(str(tmp_path))
    llm = LLM(
        str(tmp_path), device="cpu", dtype="float32", long_prefill_token_threshold=48,
        enable_prefix_caching=False,
    )  # fmt: skip
    runner = llm.engine.model_runner
    assert runner.in_place_decode_len == cpu_paged_decode.LONG_ROW_QUERY_LEN
    query_lens: list[int] = []
    kernel = paged.cpu_paged_decode.paged_decode

    def counted(*args):
        query_lens.extend(args[5].tolist())
        return kernel(*args)

    monkeypatch.setattr(paged.cpu_paged_decode, "paged_decode", counted)
    g = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(5, vocab, (n,), generator=g).tolist()}
        for n in (130, 40, 75, 9)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    in_place = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert max(query_lens) >= 40  # long rows took the kernel
    monkeypatch.setattr(runner, "in_place_decode_len", 0)
    query_lens.clear()
    sdpa = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert not query_lens
    assert in_place == sdpa
    for prompt, tokens in zip(prompts, in_place, strict=True):
        ids = torch.tensor([prompt["prompt_token_ids"]])
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert out[0, ids.shape[1] :].tolist() == list(tokens)
