"""The CPU attention kernel's "bf16" mode on AVX512-BF16 dot products (vdpbf16ps; CPUs with
avx512_bf16 and no AMX, csrc/cpu_encoder_attention_dot.h) against a float64 reference, with the
AMX "bf16" mode's bound (test_cpu_attention_amx.py derives it): Q, K, V and P are rounded to bf16
once, the reference takes Q, K, V rounded the same way, so what is left is P's rounding, at most
u A|V| per output (u = 2^-8, A|V| the attention of |V|), plus float32 accumulation (1e-4).
bfloat16 inputs are already rounded: the bound adds the output's own bf16 rounding
(2^-8 |ref| + 1e-3, the float32 path's). The path is forced with TIDEPOOL_CPU_ISA=avx512_bf16
(on an AMX CPU that caps the AMX path away); every ISA the CPU runs is checked too.
"""

from __future__ import annotations

import pytest
import torch

from tests.cpu_isa import isa_params
from tests.unit.test_cpu_attention_amx import SEQ_LENS, U, _qkv, _reference, _run, _starts
from tidepool.attention import cpu_kernels
from tidepool.kernels import cpu_features

pytestmark = pytest.mark.skipif(
    not cpu_features.cpu_has("avx512_bf16") or cpu_kernels.load_isa("avx512") is None,
    reason="the vdpbf16ps path needs a CPU with avx512_bf16 (and the AVX-512 kernel built)",
)

LENS = [700, 33, 31, 1, *SEQ_LENS]


@pytest.fixture
def dot_path(monkeypatch):
    """The kernels capped at avx512_bf16: "bf16" runs on vdpbf16ps."""
    monkeypatch.setenv("TIDEPOOL_CPU_ISA", "avx512_bf16")
    cpu_features.reset()
    assert cpu_kernels.products("bf16") == "avx512_bf16"
    yield
    monkeypatch.undo()
    cpu_features.reset()


def _check_bf16_bound(qkv, lens, scale, key_lens=None, bias=None) -> torch.Tensor:
    out = _run(qkv, lens, scale, "bf16", key_lens=key_lens, bias=bias)
    ref, abs_v, _ = _reference(qkv.to(torch.bfloat16).float(), lens, scale, key_lens, bias)
    err = (out.double() - ref).abs()
    bound = U * abs_v + 1e-4
    assert (err <= bound).all(), (err - bound).max().item()
    return out


@pytest.mark.parametrize("head_dim,heads", [(32, 3), (64, 2), (128, 1)])
def test_dot_within_the_bf16_bound(dot_path, head_dim, heads):
    qkv = _qkv(LENS, heads, head_dim, torch.float32)
    out = _check_bf16_bound(qkv, LENS, head_dim**-0.5)
    # Guard: the products really were rounded (the float32 mode is far closer to the exact one).
    exact, _, _ = _reference(qkv, LENS, head_dim**-0.5)
    f32 = _run(qkv, LENS, head_dim**-0.5, "float32").double()
    assert (out.double() - exact).abs().max() > 10 * (f32 - exact).abs().max()


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_dot_on_bfloat16_inputs(dot_path, head_dim):
    qkv = _qkv(LENS, 2, head_dim, torch.bfloat16, seed=1)
    scale = head_dim**-0.5
    ref, abs_v, _ = _reference(qkv, LENS, scale)
    out = _run(qkv, LENS, scale, "bf16")
    assert out.dtype == torch.bfloat16
    err = (out.double() - ref).abs()
    bound = ref.abs() * 2**-8 + 1e-3 + U * abs_v
    assert (err <= bound).all(), (err - bound).max().item()


def test_dot_key_counts_first_tokens_and_bias(dot_path):
    from tidepool.attention.relative_bias import RelativePositionBias, bidirectional_bucket

    lens = [300, 100, 40, 33, 17, 16, 9, 1]
    keys = [31, 65, 33, 32, 1, 16, 8, 1]
    qkv = _qkv(lens, 2, 32, torch.float32, seed=2)
    full = _check_bf16_bound(qkv, lens, 0.2, key_lens=keys)
    first = _run(qkv, lens, 0.2, "bf16", first=True, key_lens=keys)
    torch.testing.assert_close(first, full[_starts(lens)], rtol=0, atol=0)
    g = torch.Generator().manual_seed(3)
    bias = RelativePositionBias.build(
        torch.randn(32, 2, generator=g) * 2.0, bidirectional_bucket, max(lens)
    )
    _check_bf16_bound(_qkv(lens, 2, 64, torch.float32, seed=3), lens, 0.125, bias=bias)


def test_dot_batch_and_thread_invariant(dot_path):
    """A sequence's output does not depend on its neighbours or on the thread count (bits)."""
    qkv = _qkv(LENS, 4, 64, torch.float32, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(qkv, LENS, 0.125, "bf16")
        torch.set_num_threads(2)
        two = _run(qkv, LENS, 0.125, "bf16")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for i in (0, 2, 3):  # 700, 31 and 1 tokens alone
        s, n = _starts(LENS)[i], LENS[i]
        alone = _run(qkv[s : s + n], [n], 0.125, "bf16")
        assert torch.equal(alone, one[s : s + n]), n


@pytest.mark.parametrize("isa", isa_params(("avx2", "avx512", "avx512_bf16", "amx")))
def test_bf16_mode_on_every_isa(monkeypatch, isa):
    """Capped at each level the CPU has, "bf16" runs where products() says and keeps that
    path's bound: the float32 path the float32 tests' (2e-5 relative to A|V|, exact products),
    the reduced ones the bf16 bound."""
    monkeypatch.setenv("TIDEPOOL_CPU_ISA", isa)
    cpu_features.reset()
    try:
        path = cpu_kernels.products("bf16")
        expected = {"avx2": "float32", "avx512": "float32", "avx512_bf16": "avx512_bf16"}
        assert path == expected.get(isa, "amx")
        build = cpu_kernels.chosen_isa()
        assert build == ("avx2" if isa == "avx2" else "avx512")
        qkv = _qkv(LENS, 2, 64, torch.float32, seed=5)
        if path == "float32":
            out = _run(qkv, LENS, 0.125, "bf16").double()
            ref, abs_v, _ = _reference(qkv, LENS, 0.125)
            assert ((out - ref).abs() <= 2e-5 * abs_v + 1e-5).all()
            assert torch.equal(out, _run(qkv, LENS, 0.125, "float32").double())
        else:
            _check_bf16_bound(qkv, LENS, 0.125)
    finally:
        monkeypatch.undo()
        cpu_features.reset()


def test_bad_matmul_code_is_refused():
    qkv = _qkv([4], 1, 32, torch.float32)
    q, k, v = qkv.unbind(1)
    with pytest.raises(RuntimeError, match="3 \\(bf16 on vdpbf16ps\\)"):
        torch.ops.tidepool_cpu.encoder_attention(
            q, k, v, torch.tensor([0]), torch.tensor([4]), torch.tensor([0]), False, 0.2,
            None, 0, None, 4, torch.empty(4, 32),
        )  # fmt: skip
