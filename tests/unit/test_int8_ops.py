"""tidepool's int8 kernels (csrc/cpu_int8_ops.cpp, quantization/int8_ops.py) against torch
references: the quantizers bit for bit (same formula, same rounding), the epilogues within float32
rounding (1e-6 relative: a handful of float32 operations per element), the GELU within 2e-6 of
float64 (its erf is a rational approximation, < 5e-7 off, times x/2), and the int8 layer with the
kernels against the same layer on torch ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cpu_isa import build_fixture

from tidepool.models.layers.linear import Linear
from tidepool.quantization import int8_ops
from tidepool.quantization.int8_linear import (
    Int8Linear,
    int8_gemm_available,
    onednn_int8_saturates,
    quantize_per_token_asym,
)

int8_isa = build_fixture(int8_ops.BUILD_ISAS, int8_ops.load, "the int8 kernels")
"""Every test runs once per build (AVX-512, AVX2 + FMA) the CPU can run."""
pytestmark = [
    pytest.mark.skipif(not int8_gemm_available(), reason="needs oneDNN's int8 linear (x86)"),
    pytest.mark.usefixtures("int8_isa"),
]


def _ops():
    """The build under test (int8_isa caps the choice to it)."""
    return int8_ops.load()


def _rows(num_tokens: int, width: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, width, generator=generator)
    x[:, 1] *= 15.0  # an outlier channel
    x[::3] += 0.7  # skewed rows, where the zero point moves
    return x


# 45: a tail for both ISAs' vectors (16 and 8 lanes); rows: 1, and around 32 and many.
@pytest.mark.parametrize("rows", [1, 31, 33, 700])
@pytest.mark.parametrize("width", [45, 384, 1536])
def test_symmetric_quantizer_is_round_half_even_of_x_over_scale(width: int, rows: int) -> None:
    x = _rows(rows, width)
    smoothing = torch.rand(width) + 0.5
    q, scale, scaled_zero = int8_ops.quantize_rows(x, smoothing, asym=False)
    v = x * smoothing
    ref_scale = v.abs().amax(1, keepdim=True) / 127.0
    assert q.dtype == torch.int8
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.float(), torch.round(v * (1.0 / ref_scale)))
    assert torch.count_nonzero(scaled_zero) == 0


@pytest.mark.parametrize("rows", [1, 31, 33, 700])
@pytest.mark.parametrize("width", [45, 384, 1536])
def test_asymmetric_quantizer_matches_its_torch_form(width: int, rows: int) -> None:
    x = _rows(rows, width, seed=1)
    smoothing = torch.rand(width) + 0.5
    q, scale, scaled_zero = int8_ops.quantize_rows(x, smoothing, asym=True)
    ref_q, ref_scale, ref_scaled_zero = quantize_per_token_asym(x, smoothing)
    assert q.dtype == torch.uint8
    assert torch.equal(q, ref_q)
    assert torch.equal(scale, ref_scale)
    assert torch.allclose(scaled_zero, ref_scaled_zero, rtol=1e-6, atol=0)
    # Each value is within half a step of its reconstruction; both ends of the range are used.
    error = (scale * q.float() - scaled_zero - x * smoothing).abs()
    assert (error <= scale * 0.5001).all()
    assert (q.amin(1) == 0).all() and (q.amax(1) == 255).all()


@pytest.mark.parametrize("tokens", [1, 31, 33, 700])
@pytest.mark.parametrize("activation", [None, "gelu", "relu"])
def test_epilogue_matches_float64(activation: str | None, tokens: int) -> None:
    """Within float32 rounding of float64 on the same inputs, and each row alone gives the
    same bits as in the batch."""
    width = 76  # a tail for both ISAs' vectors
    y, multiply, residual = (_rows(tokens, width, seed) for seed in (2, 3, 4))
    scale, scaled_zero = torch.rand(tokens, 1), torch.rand(tokens, 1)
    bias, wsum = torch.randn(width), torch.randn(width)
    pre = (scale * y + bias - scaled_zero * wsum).double()
    ref = {None: lambda t: t, "gelu": F.gelu, "relu": torch.relu}[activation](pre)
    ref = ref * multiply + residual
    out = y.clone()
    code = int8_ops.ACTIVATION_CODES[activation]
    _ops().dequant_(out, scale, scaled_zero, wsum, bias, code, multiply, residual, *[None] * 5)
    # GELU's x/2 · (1 + erf): erf within 5e-7 and 1 + erf rounded (2^-23 near 0, where x is
    # very negative): |x| · 3.1e-7, times the multiply.
    gelu_error = pre.abs() * 3.1e-7 * multiply.abs() if activation == "gelu" else 0.0
    assert ((out.double() - ref).abs() <= 1e-6 * ref.abs() + 1e-5 + gelu_error).all()
    r = tokens // 2
    one = y[r : r + 1].clone()
    sides = (multiply[r : r + 1], residual[r : r + 1])
    _ops().dequant_(one, scale[r : r + 1], scaled_zero[r : r + 1], wsum, bias, code, *sides,
                    *[None] * 5)  # fmt: skip
    assert torch.equal(one, out[r : r + 1])


def test_epilogue_with_layer_norm_matches_torch() -> None:
    tokens, width = 29, 76
    y, residual = _rows(tokens, width, 5), _rows(tokens, width, 6)
    scale = torch.rand(tokens, 1)
    bias, gamma, beta = torch.randn(width), torch.randn(width), torch.randn(width)
    out = y.clone()
    _ops().dequant_norm_(out, scale, None, None, bias, residual, gamma, beta, 1e-12, *[None] * 5)
    ref = F.layer_norm(
        (scale * y + bias + residual).double(), (width,), gamma.double(), beta.double(), 1e-12
    )
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_gelu_is_within_2e_6_of_float64() -> None:
    x = torch.linspace(-9.0, 9.0, 200_001).view(1, -1)
    out = x.clone()
    _ops().dequant_(out, torch.ones(1, 1), None, None, None, 1, *[None] * 7)
    assert (out.double() - F.gelu(x.double())).abs().max() < 2e-6


def test_bad_arguments_are_refused() -> None:
    x = torch.randn(4, 32)
    with pytest.raises(RuntimeError, match="q: contiguous uint8"):
        _ops().quantize_rows(
            x, None, True, torch.empty(4, 32, dtype=torch.int8), *torch.empty(2, 4)
        )
    with pytest.raises(RuntimeError, match="scaled_zero and wsum come together"):
        _ops().dequant_(x, torch.ones(4), torch.ones(4), None, None, 0, *[None] * 7)


layer_runs_kernels = pytest.mark.skipif(
    not int8_gemm_available() or onednn_int8_saturates(),
    reason="no VNNI: Int8Linear splits each input into two 7-bit GEMMs with the torch epilogue "
    "(int8_linear.py), so the layer does not run these kernels here",
)


def _layer(in_features: int, out_features: int, activation: str | None, asym: bool) -> Int8Linear:
    torch.manual_seed(0)
    layer = Linear(in_features, out_features, activation=activation)
    with torch.no_grad():
        layer.weight.normal_(0, in_features**-0.5)
        layer.bias.normal_(0, 0.1)
    with pytest.MonkeyPatch.context() as mp:  # these test the kernels around oneDNN's GEMM
        mp.setenv("TIDEPOOL_INT8_GEMM", "onednn")  # (the VNNI / AMX GEMMs: their own tests)
        return Int8Linear.from_linear(layer, asym=asym)


@layer_runs_kernels
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_layer_with_kernels_matches_the_layer_on_torch_ops(asym: bool, activation) -> None:
    layer = _layer(96, 80, activation, asym)
    x, residual = _rows(37, 96, 7), _rows(37, 80, 8)
    fast = layer(x, residual=residual)
    layer._ops = None  # the fallback: the same formulas as torch ops
    slow = layer(x, residual=residual)
    assert torch.allclose(fast, slow, rtol=1e-5, atol=1e-5)


@layer_runs_kernels
@pytest.mark.parametrize("asym", [False, True])
def test_fused_layer_norm_matches_the_layer_then_the_norm(asym: bool) -> None:
    layer = _layer(96, 80, None, asym)
    norm = torch.nn.LayerNorm(80, eps=1e-12)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1)
        norm.bias.normal_(0, 0.1)
    x, residual = _rows(37, 96, 9), _rows(37, 80, 10)
    assert torch.allclose(
        layer.forward_norm(x, residual, norm), norm(layer(x, residual=residual)), atol=2e-5
    )


@layer_runs_kernels
def test_asymmetric_layer_row_does_not_depend_on_its_neighbours() -> None:
    layer = _layer(96, 80, "gelu", asym=True)
    x = _rows(50, 96, 11)
    assert torch.equal(layer(x)[17:18], layer(x[17:18]))


@layer_runs_kernels
@pytest.mark.parametrize("asym", [False, True])
def test_blocks_of_rows_give_the_same_rows(asym: bool) -> None:
    """The GEMM and epilogue run on blocks of rows (cache-sized); a row's result does not depend
    on the blocking: the same bits, with a residual, a LayerNorm and a handoff to a consumer."""
    up, down = _layer(96, 80, "gelu", asym), _layer(80, 96, None, asym=not asym)
    up.feed(down)
    norm = torch.nn.LayerNorm(96, eps=1e-12)
    x, residual = _rows(100, 96, 12), _rows(100, 96, 13)

    def run(block_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        up._block_rows = down._block_rows = block_rows
        hidden = up(x)
        assert down.__dict__["_handoff"][0] is hidden
        return hidden, down.forward_norm(hidden, residual, norm)

    whole, blocked = run(10_000), run(7)
    assert torch.equal(whole[0], blocked[0]) and torch.equal(whole[1], blocked[1])
