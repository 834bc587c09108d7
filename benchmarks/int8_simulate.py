"""Simulated int8 linears for benchmarks/int8_accuracy.py: the activation quantizers the fused
kernel may run (symmetric int8 or asymmetric uint8, one scale per token), as float32 fake
quantization around a float32 GEMM of the dequantized weight.

The simulation equals the int8 arithmetic up to float32 rounding: an int8 GEMM accumulates the
same integer products exactly, and the dequantized values are exact in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from tidepool.models.layers.activation import get_activation
from tidepool.models.layers.linear import Linear, combine
from tidepool.quantization.int8 import Int8Builder, Int8LinearPlan
from tidepool.quantization.int8_linear import quantize_per_token
from tidepool.quantization.weights import WEIGHT_LO_FACTOR

_MIN_SCALE = 1e-12


def quantize_per_token_asymmetric(
    x: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference asymmetric quantizer: x [T, K] float32 → (q [T, K] uint8, scale [T, 1],
    zero point [T, 1] int32), x ≈ scale · (q - zero).

    Per row: lo = min(min_k x, 0), hi = max(max_k x, 0) (the range holds 0, so 0 is exact and
    the zero point fits in [0, 255]); scale = (hi - lo) / 255; zero = round(-lo / scale);
    q = clamp(round(x / scale) + zero, 0, 255). Rounding is to nearest, ties to even
    (torch.round). The GEMM runs q (u8) x W (s8) in int32, and the epilogue subtracts
    scale · zero · Σ_k W_nk (a per-channel column sum, computed once at load)."""
    lo = x.amin(dim=1, keepdim=True).clamp(max=0.0)
    hi = x.amax(dim=1, keepdim=True).clamp(min=0.0)
    scale = ((hi - lo) / 255.0).clamp_(min=_MIN_SCALE)
    zero = torch.round(-lo / scale)
    q = (torch.round(x / scale) + zero).clamp_(0, 255)
    return q.to(torch.uint8), scale, zero.to(torch.int32)


def fake_quantize(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """x [T, K] rounded as the kernel's activation quantizer would, back in float32.
    "asymmetric2" (two-part inputs, an idea not in the kernel): the asymmetric uint8 part, and
    its rounding error (within ±scale/2) as int8 at scale/254, for a second GEMM."""
    if scheme == "asymmetric2":
        q, scale, zero = quantize_per_token_asymmetric(x)
        high = (q.float() - zero.float()) * scale
        step = scale / WEIGHT_LO_FACTOR
        return high + torch.round((x - high) / step).clamp_(-127, 127) * step
    if scheme == "symmetric":
        q, scale = quantize_per_token(x)  # tidepool's own quantizer (quantization/int8_linear.py)
        return q.float() * scale
    if scheme == "asymmetric":
        q, scale, zero = quantize_per_token_asymmetric(x)
        return (q.float() - zero.float()) * scale
    return x


class SimulatedInt8Linear(nn.Module):
    """`Int8Linear`'s forward with the activation quantizer `input_scheme` ("symmetric",
    "asymmetric" or "float") and the given weight (dequantized int8, or float32)."""

    def __init__(
        self,
        weight: torch.Tensor,
        linear: Linear,
        input_smoothing: torch.Tensor | None,
        input_scheme: str,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.input_smoothing = input_smoothing
        self.input_scheme = input_scheme
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._act = get_activation(linear.activation) if linear.activation else None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        multiply: torch.Tensor | None = None,
    ) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if self.input_smoothing is not None:
            x = x * self.input_smoothing
        y = nn.functional.linear(fake_quantize(x, self.input_scheme), self.weight, self.bias)
        if self._act is not None:
            y = self._act(y)
        return combine(y.view(*lead, self.out_features), multiply, residual)

    def forward_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
    ) -> torch.Tensor:
        return norm(self(x, residual=residual))


def simulated_builder(weights: str, inputs: str) -> Int8Builder:
    """A `quantize_model` builder: `weights` "int8" (the plan's: s·hi, or s·(hi + lo/254) for a
    two-part plan) or "float" (float32, smoothed as planned); `inputs` "plan" (asymmetric where
    the plan says, else symmetric), "symmetric", "asymmetric", "asymmetric2" or "float"."""

    def build(linear: Linear, plan: Int8LinearPlan) -> nn.Module:
        if weights == "int8":
            weight = plan.weight_q.float()
            if plan.weight_lo is not None:
                weight = weight + plan.weight_lo.float() / WEIGHT_LO_FACTOR
            weight = weight * plan.weight_scale[:, None]
        else:
            weight = linear.weight.detach().float()
            if plan.input_smoothing is not None:
                weight = weight / plan.input_smoothing
        scheme = inputs
        if inputs == "plan":
            scheme = "asymmetric" if plan.asymmetric_input else "symmetric"
        return SimulatedInt8Linear(weight, linear, plan.input_smoothing, scheme)

    return build
