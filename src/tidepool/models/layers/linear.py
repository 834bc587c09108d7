"""A linear layer that pre-packs its weight for oneDNN on CPU and fuses what follows the GEMM.

    y = activation(x @ W.T + b)          Linear(..., activation="gelu")
    y = x @ W.T + b + residual           layer(x, residual=r)

On CPU (float32 / bfloat16) the weight is reordered once after loading into oneDNN's blocked
layout and the activation or the residual add run as GEMM post-ops, so each costs no extra pass
over memory (figures: docs/performance.md, 'Choices in the encoder path'). Elsewhere (CUDA, other dtypes, torch without
oneDNN) it is plain F.linear followed by the same ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidepool.models.layers.activation import get_activation

# Hugging Face activation name → (oneDNN post-op, its algorithm argument).
_ONEDNN_POST_OPS: dict[str, tuple[str, str]] = {
    "gelu": ("gelu", "none"),
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "gelu_fast": ("gelu", "tanh"),
    "relu": ("relu", ""),
    "tanh": ("tanh", ""),
    "silu": ("swish", ""),
    "swish": ("swish", ""),
}

# oneDNN's packing takes a hint of the typical number of rows; a step holds thousands of tokens.
_PACK_BATCH_HINT = 4096


def _onednn_available(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear runs this dtype here. Its bfloat16 kernels need AVX-512 (BW, VL,
    DQ) or AVX-NE-CONVERT: on an AVX2-only CPU the weight reorder raises, so bfloat16 weights
    keep F.linear there (aten's own bfloat16 GEMM)."""
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.activation = activation
        self._act = get_activation(activation) if activation else None
        self._packed: torch.Tensor | None = None

    def fuses(self, activation: str | None) -> bool:
        """The packed oneDNN path runs here and `activation` (a Hugging Face name, or None) is
        one of its GEMM post-ops."""
        w = self.weight
        return (
            w.device.type == "cpu"
            and w.dtype in (torch.float32, torch.bfloat16)
            and _onednn_available(w.dtype)
            and (activation is None or activation in _ONEDNN_POST_OPS)
        )

    def set_activation(self, activation: str | None) -> None:
        """Change the fused activation before packing (a model's weight transform that made
        another activation into this one: models/towers.py's quick_gelu)."""
        self.activation = activation
        self._act = get_activation(activation) if activation else None

    def process_weights_after_loading(self) -> None:
        """Pack the weight for oneDNN where that path exists (CPU, float32 / bfloat16)."""
        self._packed = None
        if self.fuses(self.activation):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(
                self.weight.detach(), _PACK_BATCH_HINT
            )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        multiply: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """activation(x @ W.T + b), plus `residual` or times `multiply` (a SwiGLU's gate)."""
        if self._packed is not None and x.dim() == 2:
            if multiply is not None and residual is None and self.activation is None:
                return torch.ops.mkldnn._linear_pointwise.binary(
                    x, multiply, self._packed, self.bias, "mul"
                )
            if residual is not None and multiply is None and self.activation is None:
                return torch.ops.mkldnn._linear_pointwise.binary(
                    x, residual, self._packed, self.bias, "add"
                )
            if residual is None and multiply is None:
                post_op, algorithm = _ONEDNN_POST_OPS.get(self.activation or "", ("none", ""))
                return torch.ops.mkldnn._linear_pointwise(
                    x, self._packed, self.bias, post_op, [], algorithm
                )
        y = F.linear(x, self.weight, self.bias)
        if self._act is not None:
            y = self._act(y)
        return combine(y, multiply, residual)

    def forward_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: nn.LayerNorm
    ) -> torch.Tensor:
        """norm(x @ W.T + b + residual): a post-LN encoder's dense → residual → LayerNorm (the
        int8 layer runs the three in one pass after its GEMM)."""
        # `.forward`: no nn.Module call overhead (models/bert.py, BertEncoder.forward); the
        # linear keeps its call, which the int8 calibration hooks.
        return norm.forward(self(x, residual=residual))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, activation={self.activation}, "
            f"onednn_packed={self._packed is not None}"
        )


def combine(
    y: torch.Tensor, multiply: torch.Tensor | None, residual: torch.Tensor | None
) -> torch.Tensor:
    """The linears' unfused epilogue, in place on `y`: times `multiply` (a gated FFN's other
    half), then plus `residual`. Shared by `Linear` and the int8 linear."""
    if multiply is not None:
        y = y.mul_(multiply)
    if residual is not None:
        y = y.add_(residual)
    return y
