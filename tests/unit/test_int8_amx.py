"""tidepool's AMX int8 GEMM (csrc/cpu_int8_gemm.cpp) against references.

The op's sums are exact int32, so against a float64 reference built from the same integers the
only error is the epilogue's float32 rounding (a handful of operations per element: 1e-6
relative, plus GELU's rational erf, < 5e-7 absolute). The layer on AMX is compared with the same
layer on oneDNN's GEMM + the epilogue kernels (TIDEPOOL_INT8_GEMM=onednn), which computes the
same formula in a different order: 1e-5. Row counts cover one row, a partial 32-row strip, the
column-split path (few rows) and the row-group path (many rows); two-part weights, the LayerNorm,
the handoff to the next layer and the exclusive handoff (no float32 output) each get a case."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidepool.models.layers.linear import Linear
from tidepool.quantization import int8_ops
from tidepool.quantization.int8_linear import WEIGHT_LO_FACTOR, Int8Linear, int8_gemm_available

pytestmark = pytest.mark.skipif(
    not int8_gemm_available() or int8_ops.load_amx() is None,
    reason="the AMX int8 GEMM needs a CPU with AMX-INT8 (and AVX-512, a C++ compiler)",
)
AMX = torch.ops.tidepool_int8_amx
NO_HANDOFF = [None] * 5  # next_smoothing, q_next, q_scale, q_scaled_zero... then out


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), torch.rand(
        n, generator=g
    )


def _reference(q, w, w_lo, ws, s, sz, bias, act, multiply, residual) -> torch.Tensor:
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


@pytest.mark.parametrize("rows", [1, 31, 33, 700])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("two_part", [False, True])
@pytest.mark.parametrize("act", [0, 1, 2])
def test_op_matches_the_integer_reference(rows: int, asym: bool, two_part: bool, act: int) -> None:
    k, n = 192, 96
    w, ws = _weights(n, k, 0)
    w_lo = _weights(n, k, 1)[0] if two_part else None
    g = torch.Generator().manual_seed(2)
    dtype = torch.uint8 if asym else torch.int8
    low, high = (0, 256) if asym else (-127, 128)
    q = torch.randint(low, high, (rows, k), dtype=dtype, generator=g)
    s, sz = torch.rand(rows, generator=g) * 1e-3, torch.rand(rows, generator=g) if asym else None
    bias, residual = torch.randn(n, generator=g), torch.randn(rows, n, generator=g)
    multiply = torch.randn(rows, n, generator=g)  # T5's gated FFN: act(x W_0) · (x W_1)
    ref = _reference(q, w, w_lo, ws, s, sz, bias, act, multiply, residual)
    wsum = None
    if asym:
        wsum = w.double().sum(1) + (0 if w_lo is None else w_lo.double().sum(1) / WEIGHT_LO_FACTOR)
        wsum = (ws.double() * wsum).float()
    out = torch.empty(rows, n)
    AMX.linear(
        q, int8_ops.pack_weight(w), None if w_lo is None else int8_ops.pack_weight(w_lo), ws, s,
        sz, wsum, bias, act, multiply, residual, None, None, 0.0, *NO_HANDOFF[:4], out, True,
    )  # fmt: skip
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def _pair(
    k: int, n: int, activation: str | None, asym: bool, monkeypatch
) -> tuple[Int8Linear, Int8Linear]:
    """The same int8 layer twice: on the AMX GEMM, and on oneDNN's GEMM + epilogue kernels."""
    torch.manual_seed(0)
    linear = Linear(k, n, activation=activation)
    with torch.no_grad():
        linear.weight.normal_(0, k**-0.5)
        linear.bias.normal_(0, 0.1)
    amx = Int8Linear.from_linear(linear, asym=asym)
    monkeypatch.setenv("TIDEPOOL_INT8_GEMM", "onednn")
    onednn = Int8Linear.from_linear(linear, asym=asym)
    monkeypatch.delenv("TIDEPOOL_INT8_GEMM")
    assert "kernels=amx" in repr(amx) and "kernels=native" in repr(onednn)
    return amx, onednn


def _x(rows: int, width: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    x[:, 3] *= 12.0  # an outlier channel
    return x


@pytest.mark.parametrize("rows", [5, 300, 1100])  # column split; row groups (1 or 2 threads)
@pytest.mark.parametrize("asym", [False, True])
def test_layer_matches_the_onednn_layer_with_norm_and_handoff(rows, asym, monkeypatch) -> None:
    """o → up (GELU) → down chain with LayerNorms: the AMX chain gives the onednn chain's rows,
    including where FFN up's float32 output is not written at all (exclusive handoff)."""
    chains = []
    shapes = [(128, 128, None), (128, 256, "gelu"), (256, 128, None)]
    pairs = [_pair(k, n, act, asym, monkeypatch) for k, n, act in shapes]
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


def test_two_part_weights_are_fifteen_bit_accurate() -> None:
    """W ≈ s·(hi + lo/254): against float64 on the layer's own dequantized inputs (so only the
    weights' rounding is left), the two-part layer stays within s/(2·254)·‖x‖₁ per output (plus
    float32 rounding), 50x+ below one-part int8's error."""
    torch.manual_seed(0)
    k, n = 256, 64
    weight = torch.randn(n, k) * k**-0.5
    scale = weight.abs().amax(1) / 127
    hi = torch.round(weight / scale[:, None]).clamp(-127, 127)
    lo = torch.round((weight / scale[:, None] - hi) * WEIGHT_LO_FACTOR).clamp(-127, 127)
    two = Int8Linear(hi.to(torch.int8), scale, None, None, asym=True, weight_lo=lo.to(torch.int8))
    one = Int8Linear(hi.to(torch.int8), scale, None, None, asym=True)
    x = torch.randn(40, k)
    q, s, sz = int8_ops.quantize_rows(x, None, True)
    x_seen = (s * q.float() - sz).double()
    ref = x_seen @ weight.double().T
    err_two, err_one = ((m(x).double() - ref).abs() for m in (two, one))
    assert float(err_two.max()) * 50 < float(err_one.max())
    bound = x_seen.abs().sum(1, keepdim=True) * (scale.double() / (2 * WEIGHT_LO_FACTOR))
    assert (err_two <= bound + 1e-5 * ref.abs().max()).all()


def test_a_row_does_not_depend_on_its_neighbours(monkeypatch) -> None:
    layer, _ = _pair(128, 256, "gelu", True, monkeypatch)
    x = _x(400, 128, 5)
    assert torch.equal(layer(x)[130:131], layer(x[130:131]))
    assert torch.equal(layer(x)[:64], layer(x[:64]))


def test_bad_arguments_are_refused() -> None:
    w, ws = _weights(64, 128, 0)
    q = torch.zeros(4, 128, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="K % 64 == 0 and N % 32 == 0"):
        AMX.linear(torch.zeros(4, 96, dtype=torch.uint8), int8_ops.pack_weight(w), None, ws,
                   torch.ones(4), torch.ones(4), torch.ones(64), None, 0, None, None, None, None,
                   0.0, *NO_HANDOFF[:4], torch.empty(4, 64), True)  # fmt: skip
    with pytest.raises(RuntimeError, match="uint8 inputs come with scaled_zero"):
        AMX.linear(q, int8_ops.pack_weight(w), None, ws, torch.ones(4), None, None, None, 0,
                   None, None, None, None, 0.0, *NO_HANDOFF[:4], torch.empty(4, 64), True)  # fmt: skip
