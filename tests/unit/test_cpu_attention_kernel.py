"""tidepool's variable-length CPU attention kernel (csrc/cpu_encoder_attention.cpp) against a
float64 per-sequence reference, and the encoders on it against the SDPA path.

Tolerances: float32 inputs, max abs diff against float64 SDPA on the same inputs no more than
twice PyTorch's own float32 SDPA's, and <= 1e-5: outputs are convex combinations of values
|v| < 8, the kernel's exp is within ~2e-7 relative and it sums in float32 (measured 2-3e-6 for
both); a wrong key, a missing key or a shifted row moves outputs by > 1e-2. bfloat16 inputs: the kernel computes in float32 and rounds once, so the error is one
bfloat16 rounding of the output: <= 2^-8 relative (+1e-3 absolute for outputs near 0).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from cpu_isa import build_fixture

from tidepool.attention import cpu_kernels
from tidepool.kernels import cpu_features

kernel_isa = build_fixture(cpu_kernels.BUILD_ISAS, cpu_kernels.load_isa, "the kernel")
"""Each test that uses the kernel runs once per build the CPU can run (on AVX-512 CPUs the AVX2
build runs as well)."""
requires_kernel = pytest.mark.usefixtures("kernel_isa")

# Lengths around the kernel's tiles (8 query rows, 32 keys) and vector width (16), and long ones.
SEQ_LENS = [300, 129, 64, 33, 32, 31, 17, 16, 15, 9, 8, 7, 2, 1]


def _reference(qkv, starts, lens, scale, dtype=torch.float64, key_lens=None) -> torch.Tensor:
    """Per-sequence SDPA in `dtype`, returned as float64; with `key_lens`, sequence i's keys
    and values are its first key_lens[i] rows (its queries all of its rows)."""
    out = torch.zeros(qkv.shape[0], qkv.shape[2] * qkv.shape[3], dtype=torch.float64)
    for i, (s, n) in enumerate(zip(starts, lens, strict=True)):
        q, k, v = qkv[s : s + n].to(dtype).permute(1, 2, 0, 3)  # [3, H, n, D]
        if key_lens is not None:
            k, v = k[:, : key_lens[i]], v[:, : key_lens[i]]
        out[s : s + n] = (
            F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1).reshape(n, -1)
        )
    return out


def _packed(lens: list[int], heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(sum(lens), 3, heads, head_dim, generator=g) * 1.5).to(dtype)
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    return qkv, starts


def _run(qkv, starts, lens, scale, first=False, key_lens=None):
    q, k, v = qkv.unbind(1)
    keys = None if key_lens is None else torch.tensor(key_lens)
    return cpu_kernels.encoder_attention(
        q, k, v, torch.tensor(starts), torch.tensor(lens), scale, first, key_lens=keys
    )


# (length, key count) around the tiles: key counts at and next to 1, 8, 16, 32 and 64 keys, each
# with as many queries, one more, a query tile more and many more.
KEY_CASES = sorted(
    {
        (min(keys + extra, 300), keys)
        for keys in (1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65)
        for extra in (0, 1, 8, 23, 200)
    },
    reverse=True,
)
KEY_LENS = [keys for _, keys in KEY_CASES]
KEY_SEQ_LENS = [length for length, _ in KEY_CASES]


@requires_kernel
@pytest.mark.parametrize("head_dim,heads", [(32, 3), (64, 2), (128, 1)])
def test_float32_matches_float64_reference(head_dim, heads):
    qkv, starts = _packed(SEQ_LENS, heads, head_dim, torch.float32)
    scale = head_dim**-0.5
    out = _run(qkv, starts, SEQ_LENS, scale)
    ref = _reference(qkv, starts, SEQ_LENS, scale)
    torch_fp32 = _reference(qkv.double(), starts, SEQ_LENS, scale, dtype=torch.float32)
    assert out.shape == (sum(SEQ_LENS), heads * head_dim)
    err = (out.double() - ref).abs().max().item()
    assert err <= min(1e-5, 2 * (torch_fp32 - ref).abs().max().item()), err


@requires_kernel
def test_bfloat16_is_one_rounding_from_the_reference():
    qkv, starts = _packed(SEQ_LENS, 4, 32, torch.bfloat16)
    out = _run(qkv, starts, SEQ_LENS, 0.25)
    ref = _reference(qkv, starts, SEQ_LENS, 0.25)
    assert out.dtype == torch.bfloat16
    err = (out.double() - ref).abs()
    assert (err <= ref.abs() * 2**-8 + 1e-3).all(), err.max().item()


@requires_kernel
def test_first_token_only_gives_each_sequences_first_row():
    qkv, starts = _packed(SEQ_LENS, 3, 32, torch.float32, seed=1)
    full = _run(qkv, starts, SEQ_LENS, 0.2)
    first = _run(qkv, starts, SEQ_LENS, 0.2, first=True)
    assert first.shape == (len(SEQ_LENS), 96)
    torch.testing.assert_close(first, full[starts], rtol=0, atol=0)


@requires_kernel
def test_sequences_never_see_each_other_and_threads_do_not_matter():
    qkv, starts = _packed(SEQ_LENS, 2, 32, torch.float32, seed=2)
    base = _run(qkv, starts, SEQ_LENS, 0.3)
    other = qkv.clone()
    other[starts[1] : starts[1] + SEQ_LENS[1]] += 1.0  # change sequence 1 only
    changed = _run(other, starts, SEQ_LENS, 0.3)
    rows = torch.zeros(qkv.shape[0], dtype=torch.bool)
    rows[starts[1] : starts[1] + SEQ_LENS[1]] = True
    assert torch.equal(changed[~rows], base[~rows])
    assert (changed[rows] - base[rows]).abs().max() > 1e-2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(qkv, starts, SEQ_LENS, 0.3)
        torch.set_num_threads(2)
        two = _run(qkv, starts, SEQ_LENS, 0.3)
    finally:
        torch.set_num_threads(threads)
    # One (sequence, head) is one task on one thread: the split between threads changes nothing.
    assert torch.equal(one, base) and torch.equal(two, base)


@requires_kernel
def test_bad_arguments_get_a_clear_error():
    qkv, starts = _packed([4, 4], 2, 48, torch.float32)
    with pytest.raises(RuntimeError, match="head_dim must be 32, 64 or 128"):
        _run(qkv, starts, [4, 4], 0.2)
    qkv, starts = _packed([4, 4], 2, 32, torch.float16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        _run(qkv, starts, [4, 4], 0.2)


@requires_kernel
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 6e-2)])
def test_encoder_on_the_kernel_matches_the_sdpa_path(dtype, atol, tmp_path):
    """A tiny BERT, the same packed step through the kernel (packed layout) and through SDPA
    (padded layout): hidden states agree (bfloat16: both round every layer's activations, so
    differences of a few bf16 ulps at |x| ~ 4 are expected)."""
    from transformers import BertConfig

    from tidepool.attention.backend import BUCKETED_SDPA, CPU_KERNEL, select_encoder_backend
    from tidepool.attention.common import encoder_step
    from tidepool.models.bert import BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=120,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    model = BertModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "LayerNorm.weight" in name else torch.randn_like(p) * 0.1)
    model = model.to(dtype)
    model.set_attention_backend(
        select_encoder_backend(model.attention_spec(torch.device("cpu"), dtype))
    )
    lens = [70, 66, 40, 9, 3, 1]
    ids = torch.randint(0, 120, (sum(lens),))
    pos = torch.cat([torch.arange(n) for n in lens])
    step = encoder_step(lens, torch.device("cpu"), dtype, num_heads=2)
    with torch.inference_mode():
        assert model.attention_backend is CPU_KERNEL
        meta = CPU_KERNEL.metadata_builder().build(step)  # each backend's own metadata
        fast = model(ids, pos, meta)
        fast_cls = model(ids, pos, meta, first_token_only=True)
        model.set_attention_backend(BUCKETED_SDPA)
        meta = BUCKETED_SDPA.metadata_builder().build(step)
        slow = model(ids, pos, meta)
        slow_cls = model(ids, pos, meta, first_token_only=True)
    assert (fast.float() - slow.float()).abs().max().item() <= atol
    assert (fast_cls.float() - slow_cls.float()).abs().max().item() <= atol
    starts = torch.tensor([0, 70, 136, 176, 185, 188])
    assert (fast_cls.float() - fast[starts].float()).abs().max().item() <= atol


@pytest.mark.skipif(
    not any(cpu_features.cpu_has(isa) for isa in cpu_kernels.BUILD_ISAS)
    or not shutil.which(os.environ.get("CXX", "c++")),
    reason="only where a build can run: x86-64 with AVX2 + FMA or AVX-512, and a C++ compiler",
)
def test_the_kernel_is_on_by_default_where_it_can_run(monkeypatch):
    """Without a cap the best build runs: AVX-512 where the CPU has it, else AVX2 (+ FMA)."""
    monkeypatch.delenv("TIDEPOOL_CPU_ISA", raising=False)
    cpu_features.reset()
    expected = "avx512" if cpu_features.cpu_has("avx512") else "avx2"
    assert cpu_kernels.chosen_isa() == expected
    assert cpu_kernels.supports(torch.device("cpu"), torch.float32, 32)
    assert cpu_kernels.supports(torch.device("cpu"), torch.bfloat16, 64)
    assert not cpu_kernels.supports(torch.device("cpu"), torch.float16, 32)
    assert not cpu_kernels.supports(torch.device("cpu"), torch.float32, 48)


def test_sdpa_setting_turns_it_off(monkeypatch):
    monkeypatch.setenv("TIDEPOOL_CPU_ATTENTION", "sdpa")
    monkeypatch.setattr(cpu_kernels, "_state", {})
    assert cpu_kernels.load() is None
    assert not cpu_kernels.supports(torch.device("cpu"), torch.float32, 32)
    monkeypatch.setenv("TIDEPOOL_CPU_ATTENTION", "bogus")
    monkeypatch.setattr(cpu_kernels, "_state", {})
    with pytest.raises(ValueError, match="auto, native or sdpa"):
        cpu_kernels.load()


@requires_kernel
def test_rows_outside_qkv_are_refused():
    qkv, _ = _packed([4, 4], 2, 32, torch.float32)
    with pytest.raises(RuntimeError, match="outside q's"):
        _run(qkv, [0, 6], [4, 4], 0.2)
    assert not cpu_kernels.supports(
        torch.device("cpu"), torch.float32, 32, cpu_kernels.MAX_SEQ_LEN + 1
    )


@requires_kernel
def test_the_op_and_python_agree_on_the_longest_sequence():
    """The C++ check is built from cpu_kernels.MAX_SEQ_LEN: a sequence of that length runs, one
    token more is refused by the op itself (not only by supports())."""
    limit = cpu_kernels.MAX_SEQ_LEN
    qkv, _ = _packed([limit + 1], 1, 32, torch.float32)
    out = _run(qkv[:limit], [0], [limit], 0.2, first=True)
    assert out.shape == (1, 32) and torch.isfinite(out).all()
    with pytest.raises(RuntimeError, match=f"length outside 1..{limit}"):
        _run(qkv, [0], [limit + 1], 0.2, first=True)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_separate_head_major_views_and_grouped_kv_heads(dtype):
    """q / k / v as [1, heads, tokens, D] tensors seen as [tokens, heads, D] (what Hugging Face
    attention layers hand over), with 2 key/value heads for 6 query heads: equal to the reference
    on k / v repeated per query head."""
    g = torch.Generator().manual_seed(3)
    total, heads, kv_heads, head_dim = sum(SEQ_LENS), 6, 2, 32
    query = torch.randn(1, heads, total, head_dim, generator=g).to(dtype)
    key = torch.randn(1, kv_heads, total, head_dim, generator=g).to(dtype)
    value = torch.randn(1, kv_heads, total, head_dim, generator=g).to(dtype)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    starts = [0]
    for n in SEQ_LENS[:-1]:
        starts.append(starts[-1] + n)
    out = cpu_kernels.encoder_attention(q, k, v, torch.tensor(starts), torch.tensor(SEQ_LENS), 0.2)
    repeat = heads // kv_heads
    qkv = torch.stack([q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)], 1)
    ref = _reference(qkv, starts, SEQ_LENS, 0.2)
    err = (out.double() - ref).abs()
    if dtype == torch.float32:
        assert err.max().item() <= 1e-5
    else:
        assert (err <= ref.abs() * 2**-8 + 1e-3).all(), err.max().item()


@requires_kernel
@pytest.mark.parametrize("head_dim,heads", [(32, 3), (64, 2), (128, 1)])
def test_key_counts_match_the_float64_reference(head_dim, heads):
    """key_lens < length (a ColBERT query's [MASK] expansion, not attended to): every row is a
    query over its sequence's first key_lens[i] keys, around the tile edges."""
    qkv, starts = _packed(KEY_SEQ_LENS, heads, head_dim, torch.float32, seed=4)
    scale = head_dim**-0.5
    out = _run(qkv, starts, KEY_SEQ_LENS, scale, key_lens=KEY_LENS)
    ref = _reference(qkv, starts, KEY_SEQ_LENS, scale, key_lens=KEY_LENS)
    err = (out.double() - ref).abs().max().item()
    assert err <= 1e-5, err
    # Guard: the key counts matter (all keys give other outputs).
    full = _reference(qkv, starts, KEY_SEQ_LENS, scale)
    assert (full - ref).abs().max().item() > 1e-2
    first = _run(qkv, starts, KEY_SEQ_LENS, scale, first=True, key_lens=KEY_LENS)
    torch.testing.assert_close(first, out[starts], rtol=0, atol=0)


@requires_kernel
def test_key_counts_in_bfloat16_with_grouped_heads():
    g = torch.Generator().manual_seed(5)
    total, heads, kv_heads = sum(KEY_SEQ_LENS), 4, 2
    q = torch.randn(total, heads, 32, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(total, kv_heads, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    starts = [0]
    for n in KEY_SEQ_LENS[:-1]:
        starts.append(starts[-1] + n)
    out = cpu_kernels.encoder_attention(
        q,
        k,
        v,
        torch.tensor(starts),
        torch.tensor(KEY_SEQ_LENS),
        0.2,
        key_lens=torch.tensor(KEY_LENS),
    )
    qkv = torch.stack([q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)], 1)
    ref = _reference(qkv, starts, KEY_SEQ_LENS, 0.2, key_lens=KEY_LENS)
    err = (out.double() - ref).abs()
    assert (err <= ref.abs() * 2**-8 + 1e-3).all(), err.max().item()


@requires_kernel
def test_key_counts_equal_to_the_lengths_change_nothing_and_bad_ones_are_refused():
    qkv, starts = _packed(SEQ_LENS, 2, 32, torch.float32, seed=6)
    base = _run(qkv, starts, SEQ_LENS, 0.3)
    assert torch.equal(_run(qkv, starts, SEQ_LENS, 0.3, key_lens=SEQ_LENS), base)
    with pytest.raises(RuntimeError, match="key_lens 0 outside 1..4"):
        _run(qkv[:8], [0, 4], [4, 4], 0.3, key_lens=[2, 0])
    with pytest.raises(RuntimeError, match="key_lens 5 outside 1..4"):
        _run(qkv[:8], [0, 4], [4, 4], 0.3, key_lens=[5, 4])
    with pytest.raises(RuntimeError, match="one entry per sequence"):
        _run(qkv[:8], [0, 4], [4, 4], 0.3, key_lens=[4])


@pytest.mark.parametrize("entry", ["attend", "attend_heads", "attend_first_tokens"])
def test_every_backend_honours_key_counts(entry):
    """The metadata's key_lens through each encoder backend that runs here (SDPA: the buckets'
    key masks, packed rows gathered; the kernel: its key counts) against the reference."""
    from tidepool.attention.backend import ENCODER_BACKENDS, AttentionSpec
    from tidepool.attention.common import encoder_step

    spec = AttentionSpec(torch.device("cpu"), torch.float32, 32, 512)
    lens, keys = KEY_SEQ_LENS, KEY_LENS
    qkv, starts = _packed(lens, 2, 32, torch.float32, seed=7)
    step = encoder_step(lens, torch.device("cpu"), torch.float32, num_heads=2, key_lens=keys)
    ref = _reference(qkv, starts, lens, 0.2, key_lens=keys)
    for backend in [b for b in ENCODER_BACKENDS.values() if b.supports(spec)]:
        # Each backend's own metadata, on the rows its builder chose (SDPA: padded buckets
        # whose key masks carry the counts; the kernel: the packed tokens and its key counts).
        meta = backend.metadata_builder().build(step)
        rows = meta.rows.gather(qkv)
        if entry == "attend_heads":
            q, k, v = rows.unbind(1)
            out = meta.rows.to_tokens(backend.attend_heads(q, k, v, meta, 0.2))
        elif entry == "attend":
            out = meta.rows.to_tokens(backend.attend(rows, meta, 0.2))
        else:
            out = backend.attend_first_tokens(rows, meta, 0.2)
        expected = ref[starts] if entry == "attend_first_tokens" else ref
        err = (out.double() - expected).abs().max().item()
        assert err <= 1e-5, (backend.name, err)
