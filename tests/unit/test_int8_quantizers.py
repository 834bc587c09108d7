"""The int8 quantizers chosen at load: GPTQ weight rounding (models/quantization_weights.py)
against round to nearest, and the asymmetric per-token activation quantizer's reference
(benchmarks/int8_simulate.py, the formula the fused kernel implements)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from tidepool.models.quantization_weights import gptq, input_second_moments, round_to_nearest


def _correlated_inputs(num_tokens: int, in_features: int) -> torch.Tensor:
    """Inputs whose channels move together (as a layer's inputs do), one outlier channel."""
    generator = torch.Generator().manual_seed(1)
    mixing = torch.randn(in_features, in_features, generator=generator) * 0.2
    x = torch.randn(num_tokens, in_features, generator=generator) @ (
        mixing + torch.eye(in_features)
    )
    x[:, 3] *= 20.0
    return x


def _output_error(x: torch.Tensor, weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor):
    reference = x @ weight.T
    return float((x @ (q.float() * scale[:, None]).T - reference).norm() / reference.norm())


def test_gptq_lowers_the_output_error_on_held_out_inputs() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 128, generator=generator) * 128**-0.5
    x = _correlated_inputs(1200, 128)
    calibration, held_out = x[:400], x[400:]
    q_near, scale_near = round_to_nearest(weight)
    q_gptq, scale_gptq = gptq(weight, input_second_moments(calibration))
    # Same grid (one abs-max scale per output channel), other integers.
    torch.testing.assert_close(scale_gptq, scale_near)
    assert q_gptq.dtype == torch.int8 and int(q_gptq.abs().max()) <= 127
    assert (q_gptq != q_near).any()
    nearest = _output_error(held_out, weight, q_near, scale_near)
    ours = _output_error(held_out, weight, q_gptq, scale_gptq)
    assert ours < 0.8 * nearest, (ours, nearest)  # measured ~0.6x


def test_gptq_handles_a_dead_input_channel() -> None:
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(32, 16, generator=generator)
    x = torch.randn(64, 16, generator=generator)
    x[:, 5] = 0.0  # never active: H has a zero row and column
    q, scale = gptq(weight, input_second_moments(x))
    assert torch.isfinite(scale).all() and int(q[:, 5].abs().max()) == 0


def _simulate_module():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "int8_simulate.py"
    spec = importlib.util.spec_from_file_location("bench_int8_simulate", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_asymmetric_per_token_reference() -> None:
    quantize = _simulate_module().quantize_per_token_asymmetric
    generator = torch.Generator().manual_seed(3)
    x = torch.nn.functional.gelu(torch.randn(8, 384, generator=generator) * 2.0)  # >= -0.17
    x[1] = 0.0
    q, scale, zero = quantize(x)
    assert q.dtype == torch.uint8 and zero.dtype == torch.int32
    restored = (q.float() - zero.float()) * scale
    assert ((restored - x).abs() <= scale / 2 + 1e-6).all()  # half a step
    # The range is the row's (min, max) with 0 in it: 255 steps, and 0 restored exactly.
    torch.testing.assert_close(scale[0, 0], (x[0].max() - x[0].min()) / 255.0)
    assert float(restored[1].abs().max()) == 0.0
    # Finer than symmetric int8 on a one-sided row: (max - min) / 255 vs max |x| / 127.
    assert float(scale[0, 0]) < 0.6 * float(x[0].abs().max() / 127.0)


def test_upper_cholesky_of_inverse_matches_the_three_step_form() -> None:
    from tidepool.models.quantization_weights import upper_cholesky_of_inverse

    torch.manual_seed(0)
    x = torch.randn(500, 300, dtype=torch.float64)
    h = x.T @ x + 0.1 * torch.eye(300, dtype=torch.float64)
    u = upper_cholesky_of_inverse(h)
    ref = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    assert torch.equal(u, u.triu())
    torch.testing.assert_close(u, ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(u.T @ u, torch.linalg.inv(h), rtol=1e-9, atol=1e-12)
