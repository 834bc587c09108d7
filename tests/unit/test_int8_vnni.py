"""tidepool's VNNI int8 GEMM (csrc/cpu_int8_vnni.cpp) against references, once per build the
CPU can run (AVX-512 VNNI, the 256-bit AVX-VNNI; chosen through the TIDEPOOL_CPU_ISA cap).

The op's sums are exact int32 (symmetric inputs go in as q + 128, and 128 · Σ_k W comes off
exactly), so against a float64 reference built from the same integers the only error is the
epilogue's float32 rounding (a handful of operations per element, 1e-6 relative, plus GELU's
rational erf, < 5e-7 absolute): 1e-5 of the largest value. The layer on VNNI is compared with
the same layer on oneDNN's GEMM + the epilogue kernels (TIDEPOOL_INT8_GEMM=onednn), the same
formula in a different order: 1e-4 after two LayerNorms. Row counts cover one row, partial
6-row register blocks, the column-split path (few rows) and the row-group path (many rows);
two-part weights, every epilogue, the LayerNorm, the handoff and the exclusive handoff."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cpu_isa import build_fixture

from tidepool.kernels import cpu_features
from tidepool.models.layers.linear import Linear
from tidepool.quantization import int8_ops
from tidepool.quantization.int8_linear import WEIGHT_LO_FACTOR, Int8Linear, int8_gemm_available

pytestmark = pytest.mark.skipif(
    not int8_gemm_available() or int8_ops.load() is None or int8_ops.load_amx() is not None,
    reason="the VNNI GEMM runs where the int8 epilogue kernels build and the CPU has no AMX-INT8 "
    "(there the AMX GEMM runs: test_int8_amx.py)",
)
isa = build_fixture(int8_ops.VNNI_ISAS, int8_ops.load_vnni, "the VNNI int8 GEMM")
NO_HANDOFF = [None] * 4  # next_smoothing, q_next, q_scale, q_scaled_zero


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    return w, torch.rand(n, generator=g)


def _reference(q, w, w_lo, ws, s, sz, bias, act, multiply, residual) -> torch.Tensor:
    """float64 from the same integers: act(s·ws·(q·Wᵀ [+ q·W_loᵀ/254]) + b - sz·ws·ΣW)·m + r."""
    acc = q.double() @ w.double().T
    wsum = w.double().sum(1)
    if w_lo is not None:
        acc += q.double() @ w_lo.double().T / WEIGHT_LO_FACTOR
        wsum += w_lo.double().sum(1) / WEIGHT_LO_FACTOR
    y = acc * ws.double() * s.double()[:, None] + bias.double()
    if sz is not None:
        y -= sz.double()[:, None] * (ws.double() * wsum)
    y = {0: lambda t: t, 1: F.gelu, 2: torch.relu}[act](y)
    return y * multiply.double() + residual.double()


def _x(rows: int, width: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    x[:, 3] *= 12.0  # an outlier channel
    return x


def _call(ops, q, w, w_lo, ws, s, sz, wsum, bias, act, multiply, residual, out) -> None:
    packed, comp = int8_ops.pack_weight_vnni(w)
    packed_lo, comp_lo = (None, None) if w_lo is None else int8_ops.pack_weight_vnni(w_lo)
    ops.linear(
        q, packed, packed_lo, comp, comp_lo, ws, s, sz, wsum, bias, act, multiply, residual,
        None, None, 0.0, *NO_HANDOFF, out, True,
    )  # fmt: skip


@pytest.mark.parametrize("rows", [1, 31, 33, 700])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("two_part", [False, True])
@pytest.mark.parametrize("act", [0, 1, 2])
def test_op_matches_the_integer_reference(isa, rows, asym, two_part, act) -> None:
    k, n = 196, 112  # K % 64 != 0 and N % 64 != 0: the VNNI GEMM's narrower column blocks
    w, ws = _weights(n, k, 0)
    w_lo = _weights(n, k, 1)[0] if two_part else None
    g = torch.Generator().manual_seed(2)
    dtype = torch.uint8 if asym else torch.int8
    low, high = (0, 256) if asym else (-128, 128)  # the full ranges, 255 and -128 included
    q = torch.randint(low, high, (rows, k), dtype=dtype, generator=g)
    q[0, :] = 255 if asym else -128
    s, sz = torch.rand(rows, generator=g) * 1e-3, torch.rand(rows, generator=g) if asym else None
    bias, residual = torch.randn(n, generator=g), torch.randn(rows, n, generator=g)
    multiply = torch.randn(rows, n, generator=g)
    ref = _reference(q, w, w_lo, ws, s, sz, bias, act, multiply, residual)
    wsum = None
    if asym:
        wsum = w.double().sum(1) + (0 if w_lo is None else w_lo.double().sum(1) / WEIGHT_LO_FACTOR)
        wsum = (ws.double() * wsum).float()
    out = torch.empty(rows, n)
    _call(int8_ops.load_vnni(isa), q, w, w_lo, ws, s, sz, wsum, bias, act, multiply, residual, out)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def _pair(k, n, activation, asym, monkeypatch, two_part=False) -> tuple[Int8Linear, Int8Linear]:
    """The same int8 layer twice: on the VNNI GEMM, and on oneDNN's GEMM + epilogue kernels."""
    torch.manual_seed(0)
    linear = Linear(k, n, activation=activation)
    with torch.no_grad():
        linear.weight.normal_(0, k**-0.5)
        linear.bias.normal_(0, 0.1)
    layers = []
    for gemm in ("auto", "onednn"):
        monkeypatch.setenv("TIDEPOOL_INT8_GEMM", gemm)
        layer = Int8Linear.from_linear(linear, asym=asym)
        if two_part:  # the low part of round(W / s): the same weights in ~15 bits
            w = linear.weight.detach().float() / layer.weight_scale[:, None]
            hi = torch.round(w).clamp(-127, 127)
            lo = torch.round((w - hi) * WEIGHT_LO_FACTOR).clamp(-127, 127).to(torch.int8)
            layer = Int8Linear(hi.to(torch.int8), layer.weight_scale, linear.bias, activation,
                               asym=asym, weight_lo=lo)  # fmt: skip
        layers.append(layer)
    monkeypatch.delenv("TIDEPOOL_INT8_GEMM")
    assert f"kernels=vnni-{cpu_features.cap()}" in repr(layers[0])
    assert "kernels=native" in repr(layers[1])
    return layers[0], layers[1]


@pytest.mark.parametrize("rows", [5, 300, 1100])  # column split; row groups (1 or 2 threads)
@pytest.mark.parametrize("asym", [False, True])
def test_layer_matches_the_onednn_layer_with_norm_and_handoff(isa, rows, asym, monkeypatch) -> None:
    """o → up (GELU) → down chain with LayerNorms: the VNNI chain gives the onednn chain's rows,
    including where FFN up's float32 output is not written at all (exclusive handoff)."""
    shapes = [(128, 128, None), (128, 256, "gelu"), (256, 128, None)]
    pairs = [_pair(k, n, act, asym, monkeypatch) for k, n, act in shapes]
    chains = []
    for o, up, down in zip(*pairs, strict=True):
        o.feed(up)
        up.feed(down, exclusive=True)
        chains.append((o, up, down))
    norm = torch.nn.LayerNorm(128, eps=1e-12)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1)
        norm.bias.normal_(0, 0.1)
    x, residual = _x(rows, 128, 3), _x(rows, 128, 4)
    outs = []
    for o, up, down in chains:
        h = o.forward_norm(x, residual, norm)
        inner = up(h)
        assert down.__dict__["_handoff"][0] is inner
        outs.append(down.forward_norm(inner, h, norm))
    assert torch.allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("two_part", [False, True])
def test_epilogues_match_onednn(isa, activation, two_part, monkeypatch) -> None:
    """One layer (no quantized handoff, whose rounding a last-bit difference can flip): each
    epilogue, T5's gated FFN (act(x W_0) · (x W_1)), a residual, LayerNorm, on both paths (few
    rows: column split; many: row groups), one- and two-part weights; both schemes."""
    for asym in (False, True):
        vnni, onednn = _pair(64, 96, activation, asym, monkeypatch, two_part)
        for rows in (3, 900):
            x, side = _x(rows, 64, 6), _x(rows, 96, 7)
            for kwargs in ({}, {"multiply": side}, {"residual": side}):
                assert torch.allclose(vnni(x, **kwargs), onednn(x, **kwargs), rtol=1e-5, atol=1e-5)
            if activation is None:
                norm = torch.nn.LayerNorm(96)
                got, want = (m.forward_norm(x, side, norm) for m in (vnni, onednn))
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_row_does_not_depend_on_its_neighbours(isa, monkeypatch) -> None:
    layer, _ = _pair(128, 256, "gelu", True, monkeypatch)
    x = _x(400, 128, 5)
    assert torch.equal(layer(x)[130:131], layer(x[130:131]))
    assert torch.equal(layer(x)[:64], layer(x[:64]))


def test_shapes_it_does_not_take_keep_onednn(isa, monkeypatch) -> None:
    """N % 16 != 0 (a 3-label classifier head) or K % 4 != 0: oneDNN's GEMM."""
    for k, n in ((64, 3), (66, 32)):
        layer = Int8Linear.from_linear(Linear(k, n))
        assert "kernels=native" in repr(layer)


def test_bad_arguments_are_refused(isa) -> None:
    ops = int8_ops.load_vnni(isa)
    w, ws = _weights(64, 128, 0)
    packed, comp = int8_ops.pack_weight_vnni(w)
    q = torch.zeros(4, 128, dtype=torch.uint8)
    rest = [None, None, None, None, 0.0, *NO_HANDOFF]
    with pytest.raises(RuntimeError, match="K % 4 == 0 and N % 16 == 0"):
        ops.linear(torch.zeros(4, 126, dtype=torch.uint8), packed, None, comp, None, ws,
                   torch.ones(4), torch.ones(4), torch.ones(64), None, 0, *rest,
                   torch.empty(4, 64), True)  # fmt: skip
    with pytest.raises(RuntimeError, match="uint8 inputs come with scaled_zero"):
        ops.linear(q, packed, None, comp, None, ws, torch.ones(4), None, None, None, 0, *rest,
                   torch.empty(4, 64), True)  # fmt: skip
    with pytest.raises(RuntimeError, match="packed int8"):
        ops.linear(q, w, None, comp, None, ws, torch.ones(4), torch.ones(4), torch.ones(64),
                   None, 0, *rest, torch.empty(4, 64), True)  # fmt: skip


def test_the_cap_chooses_the_build(monkeypatch) -> None:
    """TIDEPOOL_CPU_ISA picks the build once at load; a cap below VNNI keeps oneDNN; a bad value
    is refused naming the switch."""
    for cap, expect in (("avx512_vnni", "avx512_vnni"), ("avx2_vnni", "avx2_vnni"),
                        ("avx2", None)):  # fmt: skip
        monkeypatch.setenv("TIDEPOOL_CPU_ISA", cap)
        cpu_features.reset()
        if expect is not None and not cpu_features.cpu_has(expect):
            continue
        assert int8_ops.vnni_isa() == expect
        layer = Int8Linear.from_linear(Linear(64, 32))
        assert ("kernels=native" if expect is None else f"kernels=vnni-{expect}") in repr(layer)
    monkeypatch.setenv("TIDEPOOL_CPU_ISA", "avx512_vnni2")
    cpu_features.reset()
    with pytest.raises(ValueError, match="TIDEPOOL_CPU_ISA must be one of"):
        int8_ops.vnni_isa()
    monkeypatch.undo()
    cpu_features.reset()


@pytest.mark.parametrize("asym", [False, True])
def test_full_range_sums_are_exact(isa, asym) -> None:
    """Every input 255 (asymmetric) or -128 / 127 (symmetric) against weights ±127 in pairs of
    equal sign, where vpmaddubsw's int16 pairs would saturate (2 · 255 · 127 > 2¹⁵): the sums
    equal the integer product (K · 255 · 127 < 2²⁴: exact in float32 too)."""
    k, n = 128, 48
    w = torch.where(torch.rand(n, k, generator=torch.Generator().manual_seed(3)) < 0.5, 127, -127)
    w = w.to(torch.int8)
    w[:, :4] = 127
    if asym:
        q = torch.full((7, k), 255, dtype=torch.uint8)
    else:
        q = torch.full((7, k), -128, dtype=torch.int8)
        q[1::2] = 127
    s, sz = torch.ones(7), torch.zeros(7) if asym else None
    wsum = torch.zeros(n) if asym else None
    out = torch.empty(7, n)
    _call(int8_ops.load_vnni(isa), q, w, None, torch.ones(n), s, sz, wsum, None, 0, None, None, out)
    assert torch.equal(out, (q.int() @ w.int().T).float())
