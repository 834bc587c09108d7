"""The CPU attention kernel's AMX-bf16 modes (csrc/cpu_encoder_attention.cpp, matmul="bf16" and
"bf16x3") against a float64 reference, with bounds derived from bf16 rounding, and which models
get them (attention/backend.py).

u = 2^-8 is bf16's unit roundoff (8 significant bits, round to nearest even); A|V| below is the
attention of |V| with the reference weights (per output element: sum_j w_ij |v_j|).

- "bf16" rounds Q, K, V and P once. The reference takes Q, K, V rounded the same way, so what is
  left is P's rounding: out_i = sum_j fl(p_ij) v_j / sum_j p_ij moves by at most u A|V|, plus
  float32 accumulation of the scores (1e-4).
- "bf16x3" splits x = hi + lo with |x - hi - lo| <= u^2 |x| and drops lo*lo (<= u^2 |x y|): each
  product is within 3u^2 relative, a score within e = 3u^2 scale sum_d |q_d k_d|, and to first
  order the output within max_j e_ij * A|V - o| <= e_max (A|V| + |o|) (we allow twice that for
  the second-order terms), plus P's and V's splits (3u^2 A|V|) and float32's 1e-5.
- bfloat16 inputs have lo = 0: "bf16x3" is then exact on the inputs (only P is split) and keeps
  the float32 path's bound (one bf16 rounding of the output, 2^-8 |ref| + 1e-3); "bf16" adds P's
  rounding, u A|V|.
A wrong, missing or shifted key moves outputs by > 1e-2 (the float32 tests' guard), well above
these bounds for the data here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidepool.attention import cpu_kernels
from tidepool.attention.relative_bias import RelativePositionBias, bidirectional_bucket

U = 2.0**-8

requires_amx = pytest.mark.skipif(
    not cpu_kernels.amx_bf16_available(),
    reason="the AMX modes need a CPU with AMX-bf16 (and the kernel built)",
)

# Lengths at and around the AMX blocks (32 query rows, 16 and 32 keys) and long ones.
SEQ_LENS = [512, 255, 100, 64, 33, 32, 17, 16, 15, 2, 1]


def _starts(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens[:-1]:
        out.append(out[-1] + n)
    return out


def _qkv(lens, heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(sum(lens), 3, heads, head_dim, generator=g) * 1.5).to(dtype)


def _reference(qkv, lens, scale, key_lens=None, bias=None):
    """Per sequence in float64: (out, A|V|, e_max): the output, the attention of |V|, and each
    query row's largest scale * sum_d |q_d k_d| over its keys (broadcast over the row)."""
    n_rows, _, heads, dim = qkv.shape
    out, abs_v, mags = (torch.zeros(n_rows, heads * dim, dtype=torch.float64) for _ in range(3))
    for i, (s, n) in enumerate(zip(_starts(lens), lens, strict=True)):
        q, k, v = qkv[s : s + n].double().permute(1, 2, 0, 3)  # [3, H, n, D]
        if key_lens is not None:
            k, v = k[:, : key_lens[i]], v[:, : key_lens[i]]
        mask = None if bias is None else bias.dense(n, torch.float64)[:, :, : k.shape[1]]
        rows = slice(s, s + n)
        out[rows] = (
            F.scaled_dot_product_attention(q, k, v, mask, scale=scale)
            .transpose(0, 1)
            .reshape(n, -1)
        )
        abs_v[rows] = (
            F.scaled_dot_product_attention(q, k, v.abs(), mask, scale=scale)
            .transpose(0, 1)
            .reshape(n, -1)
        )
        mag = (scale * q.abs() @ k.abs().transpose(1, 2)).amax(-1)  # [H, n]
        mags[rows] = mag.t().repeat_interleave(dim, 1)
    return out, abs_v, mags


def _run(qkv, lens, scale, matmul, first=False, key_lens=None, bias=None):
    q, k, v = qkv.unbind(1)
    keys = None if key_lens is None else torch.tensor(key_lens)
    return cpu_kernels.encoder_attention(
        q, k, v, torch.tensor(_starts(lens)), torch.tensor(lens), scale, first, bias, keys, matmul
    )


def _check_float32_inputs(qkv, lens, scale, key_lens=None, bias=None) -> None:
    """Both AMX modes within their bounds; bf16x3 much closer than bf16 (its lo terms work)."""
    bf16 = _run(qkv, lens, scale, "bf16", key_lens=key_lens, bias=bias).double()
    rounded = qkv.to(torch.bfloat16).float()
    ref_rounded, abs_v, _ = _reference(rounded, lens, scale, key_lens, bias)
    err = (bf16 - ref_rounded).abs()
    assert (err <= U * abs_v + 1e-4).all(), (err - U * abs_v).max().item()

    x3 = _run(qkv, lens, scale, "bf16x3", key_lens=key_lens, bias=bias).double()
    ref, abs_v, mags = _reference(qkv, lens, scale, key_lens, bias)
    e = 3 * U**2 * mags
    bound = 2 * e * (abs_v + ref.abs()) + 3 * U**2 * abs_v + 1e-5
    err3 = (x3 - ref).abs()
    assert (err3 <= bound).all(), (err3 - bound).max().item()
    assert err3.max() < (bf16 - ref).abs().max() / 10


@requires_amx
@pytest.mark.parametrize("head_dim,heads", [(32, 3), (64, 2), (128, 1)])
def test_amx_modes_within_their_rounding_bounds(head_dim, heads):
    _check_float32_inputs(_qkv(SEQ_LENS, heads, head_dim, torch.float32), SEQ_LENS, head_dim**-0.5)


@requires_amx
@pytest.mark.parametrize("head_dim", [32, 64])
def test_amx_modes_on_bfloat16_inputs(head_dim):
    qkv = _qkv(SEQ_LENS, 2, head_dim, torch.bfloat16, seed=1)
    scale = head_dim**-0.5
    ref, abs_v, _ = _reference(qkv, SEQ_LENS, scale)
    for matmul, extra in (("bf16x3", 0.0), ("bf16", U)):
        out = _run(qkv, SEQ_LENS, scale, matmul)
        assert out.dtype == torch.bfloat16
        err = (out.double() - ref).abs()
        bound = ref.abs() * 2**-8 + 1e-3 + extra * abs_v
        assert (err <= bound).all(), (matmul, (err - bound).max().item())


@requires_amx
def test_amx_key_counts_and_first_tokens():
    """ColBERT's key counts (keys: each sequence's first key_lens[i] rows, around the blocks),
    and the first-token-only output equal to the full output's first rows."""
    lens = [300, 100, 40, 33, 17, 16, 9, 1]
    keys = [31, 65, 33, 32, 1, 16, 8, 1]
    qkv = _qkv(lens, 2, 32, torch.float32, seed=2)
    _check_float32_inputs(qkv, lens, 0.2, key_lens=keys)
    for matmul in ("bf16", "bf16x3"):
        full = _run(qkv, lens, 0.2, matmul, key_lens=keys)
        first = _run(qkv, lens, 0.2, matmul, first=True, key_lens=keys)
        torch.testing.assert_close(first, full[_starts(lens)], rtol=0, atol=0)


@requires_amx
def test_amx_with_a_relative_position_bias():
    """MPNet's bias by key - query distance, added to the float32 scores in the AMX modes too."""
    lens = [257, 64, 31, 17, 1]
    g = torch.Generator().manual_seed(3)
    table = torch.randn(32, 2, generator=g) * 2.0
    bias = RelativePositionBias.build(table, bidirectional_bucket, max(lens))
    qkv = _qkv(lens, 2, 64, torch.float32, seed=3)
    _check_float32_inputs(qkv, lens, 0.125, bias=bias)
    # Guard: the bias matters at this size.
    no_bias, _, _ = _reference(qkv, lens, 0.125)
    with_bias, _, _ = _reference(qkv, lens, 0.125, bias=bias)
    assert (no_bias - with_bias).abs().max() > 1e-2


@requires_amx
def test_amx_threads_and_neighbours_do_not_matter():
    """The tile configuration is loaded per worker thread: 1 or 2 threads give the same bits, and
    a sequence's output does not depend on the others."""
    qkv = _qkv(SEQ_LENS, 4, 64, torch.float32, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = {m: _run(qkv, SEQ_LENS, 0.125, m) for m in ("bf16", "bf16x3")}
        torch.set_num_threads(2)
        two = {m: _run(qkv, SEQ_LENS, 0.125, m) for m in ("bf16", "bf16x3")}
    finally:
        torch.set_num_threads(threads)
    for m in one:
        assert torch.equal(one[m], two[m]), m
    alone = _run(qkv[: SEQ_LENS[0]], SEQ_LENS[:1], 0.125, "bf16x3")
    assert torch.equal(alone, one["bf16x3"][: SEQ_LENS[0]])


def test_reduced_precision_selection(monkeypatch):
    """float32 specs keep the exact kernel; a reduced-precision spec gets its mode where the
    CPU runs it (AMX-bf16, or avx512_bf16 for "bf16"; the float32 kernel elsewhere); TIDEPOOL_CPU_ATTENTION_MATMUL overrides the
    reduced-precision choice only."""
    from tidepool.attention import backend as b

    if not b.CpuKernelBackend.supports(
        b.AttentionSpec(torch.device("cpu"), torch.float32, 32, 512)
    ):
        pytest.skip("the CPU kernel is not available here")
    monkeypatch.delenv("TIDEPOOL_CPU_ATTENTION_MATMUL", raising=False)
    # A reduced mode where some path runs it (AMX, or "bf16" on vdpbf16ps), float32 elsewhere.
    amx = cpu_kernels.products("bf16") != "float32"
    for dtype in (torch.float32, torch.bfloat16):
        spec = b.AttentionSpec(torch.device("cpu"), dtype, 32, 512)
        assert b.select_encoder_backend(spec) is b.CPU_KERNEL
        reduced = b.select_encoder_backend(b.with_reduced_precision(spec))
        expected = b.REDUCED_MATMUL[dtype] if amx else "float32"
        assert isinstance(reduced, b.CpuKernelBackend) and reduced.matmul == expected
    monkeypatch.setenv("TIDEPOOL_CPU_ATTENTION_MATMUL", "float32")
    spec = b.with_reduced_precision(b.AttentionSpec(torch.device("cpu"), torch.bfloat16, 32, 512))
    assert b.select_encoder_backend(spec) is b.CPU_KERNEL
    monkeypatch.setenv("TIDEPOOL_CPU_ATTENTION_MATMUL", "bf16")
    assert b.with_reduced_precision(spec).matmul == "bf16"
    monkeypatch.setenv("TIDEPOOL_CPU_ATTENTION_MATMUL", "fp8")
    with pytest.raises(ValueError, match="auto, float32, bf16 or bf16x3"):
        b.with_reduced_precision(spec)


@requires_amx
def test_bad_matmul_code_is_refused():
    qkv = _qkv([4], 1, 32, torch.float32)
    q, k, v = qkv.unbind(1)
    out = torch.empty(4, 32)
    with pytest.raises(RuntimeError, match="matmul: 0"):
        torch.ops.tidepool_cpu.encoder_attention(
            q, k, v, torch.tensor([0]), torch.tensor([4]), torch.tensor([0]), False, 0.2,
            None, 0, None, 7, out,
        )  # fmt: skip


def test_attach_gives_bfloat16_and_int8_models_their_matmul(monkeypatch):
    """attach_attention_backend (models/interfaces.py), as the loader calls it: a float32 model
    keeps the exact kernel, a bfloat16 one and a float32 one with reduced_precision=True (the
    int8 mode) get REDUCED_MATMUL (where AMX-bf16 is available)."""
    from transformers import BertConfig

    from tidepool.attention import backend as b
    from tidepool.models.bert import BertModel
    from tidepool.models.interfaces import attach_attention_backend

    if not b.CpuKernelBackend.supports(
        b.AttentionSpec(torch.device("cpu"), torch.float32, 32, 512)
    ):
        pytest.skip("the CPU kernel is not available here")
    monkeypatch.delenv("TIDEPOOL_CPU_ATTENTION_MATMUL", raising=False)
    config = BertConfig(
        vocab_size=50, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    model = BertModel(config).eval()
    amx = cpu_kernels.products("bf16") != "float32"
    cpu = torch.device("cpu")
    cases = [
        (torch.float32, None, False),
        (torch.bfloat16, None, True),
        (torch.float32, True, True),
    ]
    for dtype, reduced, expect_amx in cases:
        attach_attention_backend(model, cpu, dtype, reduced)
        got = model.attention_backend
        assert isinstance(got, b.CpuKernelBackend)
        expected = b.REDUCED_MATMUL[dtype] if expect_amx and amx else "float32"
        assert got.matmul == expected, (dtype, reduced, got)
        assert model.encoder.layer[0].attention.self.attn.backend is got
