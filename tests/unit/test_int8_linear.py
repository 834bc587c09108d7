"""The int8 linear layer (quantization/int8_linear.py) against float32, and batch invariance.

The error bound checked is the worst case derived in the module's docstring: per output element
(t, n), with per-token activation scales s_x[t] and per-channel weight scales s_w[n],

    |y - y_ref| <= (s_w/2)·‖x_t‖₁ + (s_x/2)·‖w_n‖₁ + K·s_x·s_w/4

(each rounding error is at most half a step; the product of two errors adds the last term), plus
float32 rounding of the reference. Typical errors are ~sqrt(K) smaller: the test also checks the
relative error stays at the level int8 gives (1-3% with an outlier channel), so a bound loose by accident still bites.
"""

from __future__ import annotations

import pytest
import torch

from tidepool.models.layers.linear import Linear
from tidepool.quantization.int8_linear import (
    Int8Linear,
    int8_gemm_available,
    quantize_per_token,
    quantize_weight,
)

pytestmark = pytest.mark.skipif(not int8_gemm_available(), reason="no oneDNN int8 linear")


def _linear(in_features: int, out_features: int, activation: str | None = None) -> Linear:
    torch.manual_seed(0)
    layer = Linear(in_features, out_features, activation=activation)
    with torch.no_grad():
        layer.weight.normal_(0, in_features**-0.5)
        layer.bias.normal_(0, 0.1)
    layer.process_weights_after_loading()
    return layer.eval().requires_grad_(False)


def _inputs(num_tokens: int, in_features: int) -> torch.Tensor:
    torch.manual_seed(1)
    x = torch.randn(num_tokens, in_features)
    x[:, 3] *= 20.0  # an outlier channel, as LayerNorm outputs have
    return x


def _error_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    _, x_scale = quantize_per_token(x)
    _, w_scale = quantize_weight(weight)
    w_scale = w_scale[None, :]
    in_features = x.shape[1]
    return (
        w_scale / 2 * x.abs().sum(1, keepdim=True)
        + x_scale / 2 * weight.abs().sum(1)[None, :]
        + in_features * x_scale * w_scale / 4
    )


@pytest.mark.parametrize("in_features,out_features", [(64, 96), (384, 1152), (1536, 384)])
def test_within_the_quantization_error_bound(in_features: int, out_features: int) -> None:
    layer = _linear(in_features, out_features)
    x = _inputs(37, in_features)
    reference = x @ layer.weight.T + layer.bias
    y = Int8Linear.from_linear(layer)(x)
    error = (y - reference).abs()
    bound = _error_bound(x, layer.weight) + 1e-5 * reference.abs() + 1e-6
    assert (error <= bound).all(), (error / bound).max()
    relative = error.norm() / reference.norm()
    # int8, not float32 by accident, and not broken (the outlier channel coarsens every token)
    assert 1e-4 < relative < 0.05, relative


def test_activation_residual_and_smoothing_match_the_float32_layer() -> None:
    layer = _linear(128, 256, activation="gelu")
    x = _inputs(20, 128)
    residual = torch.randn(20, 256)
    reference = layer(x, residual=residual)
    for int8 in (
        Int8Linear.from_linear(layer),
        Int8Linear.from_linear(layer, input_amax=x.abs().amax(0), alpha=0.5),
    ):
        y = int8(x, residual=residual)
        cos = torch.nn.functional.cosine_similarity(y, reference, dim=1)
        assert cos.min() > 0.999, cos.min()


def test_smoothing_helps_an_outlier_channel() -> None:
    layer = _linear(384, 384)
    x = _inputs(64, 384)
    reference = x @ layer.weight.T + layer.bias
    plain = (Int8Linear.from_linear(layer)(x) - reference).norm()
    smoothed = Int8Linear.from_linear(layer, x.abs().amax(0), alpha=0.5)(x)
    assert (smoothed - reference).norm() < plain


def test_a_row_does_not_depend_on_its_neighbours() -> None:
    """Per-token scales and exact int32 accumulation: each row alone gives the same bits."""
    int8 = Int8Linear.from_linear(_linear(384, 1536, activation="gelu"))
    x = _inputs(300, 384)
    batched = int8(x)
    assert not torch.equal(batched[0], batched[1])
    for row in (0, 7, 299):
        assert torch.equal(int8(x[row : row + 1])[0], batched[row])
    assert torch.equal(int8(x[100:164]), batched[100:164])


def test_quantize_per_token_rounds_like_torch_round() -> None:
    """The shifted-float rounding (no round pass) against the plain form: equal but for ties."""
    x = _inputs(256, 384)
    smoothing = torch.rand(384) + 0.5
    q, scale = quantize_per_token(x, smoothing)
    xs = x * smoothing
    amax = xs.abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(scale, amax / 127)
    plain = torch.round(xs * (127.0 / amax)).to(torch.int8)
    differ = (q.int() - plain.int()).abs()
    assert differ.max() <= 1 and (differ > 0).sum() <= 10
    assert q.abs().max() == 127 and q.dtype == torch.int8
    zeros, zero_scale = quantize_per_token(torch.zeros(3, 384))
    assert not zeros.any() and (zero_scale > 0).all()


@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("force_split", [False, True])
def test_worst_case_inputs_sum_exactly(asym: bool, force_split: bool) -> None:
    """Inputs and weights at full range (every uint8 input 255 or 0, every int8 input ±127,
    weights ±127): the layer's GEMM equals the exact integer product on every CPU. Without VNNI
    oneDNN's u8 · s8 pairs saturate in int16 (an AVX2-only AMD EPYC gave errors of 10⁵), and
    the layer must take the split (2·h + l) path there; forced, the split is exact anywhere."""
    torch.manual_seed(3)
    k, n = 128, 48
    weight_q = torch.where(torch.rand(n, k) < 0.5, 127, -127).to(torch.int8)
    weight_q[:, :2] = 127  # pairs of equal sign: the saturating case
    with pytest.MonkeyPatch.context() as mp:  # oneDNN's GEMM (the VNNI GEMM's: test_int8_vnni)
        mp.setenv("TIDEPOOL_INT8_GEMM", "onednn")
        layer = Int8Linear(weight_q, torch.ones(n), None, None, asym=asym)
    if force_split:
        layer.split_input, layer._zero_point, layer._ops = True, True, None
        layer.register_buffer("weight_sum", weight_q.sum(dim=1, dtype=torch.int64).float())
    if asym or layer.split_input:
        q = torch.where(torch.rand(5, k) < 0.7, 255, 0).to(torch.uint8)
        q[:, :2] = 255
        exact = q.int() @ weight_q.int().T
    else:
        q = torch.where(torch.rand(5, k) < 0.5, 127, -127).to(torch.int8)
        q[:, :2] = 127
        exact = q.int() @ weight_q.int().T
    got = layer._gemm(q)
    # Sums up to K · 255 · 127 = 4.1e6 < 2^24: exact in float32 (the split adds two exact parts).
    assert torch.equal(got, exact.float())


def test_layer_equals_the_integer_reference_on_full_range_inputs() -> None:
    """End to end through quantize → GEMM → dequantize: the float32 output equals float64 math
    on the layer's own integers (the quantizer's q and scales), on any CPU."""
    torch.manual_seed(4)
    k, n = 96, 64
    weight_q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    weight_scale = torch.rand(n) * 0.01 + 0.001
    bias = torch.randn(n)
    x = torch.randn(7, k) * 3.0
    for asym in (False, True):
        layer = Int8Linear(weight_q, weight_scale, bias, None, asym=asym)
        y = layer(x)
        q, scale, scaled_zero = layer._quantized_input(x)
        acc = q.double() @ weight_q.double().T
        expected = scale.double() * acc * weight_scale.double() + bias.double()
        if layer._zero_point:
            expected -= scaled_zero.double() * (weight_scale.double() * weight_q.double().sum(1))
        # float32 rounding of sums up to 96 · 255 · 127 and the epilogue's few operations.
        tol = 16 * 2**-24 * float(expected.abs().max()) * k**0.5
        assert float((y.double() - expected).abs().max()) <= tol
