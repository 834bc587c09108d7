"""RMSNorm: x / sqrt(mean(x^2) + eps) * weight, over the last axis."""

from __future__ import annotations

import torch
from torch import nn

from tidepool.attention import cpu_decoder_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.normalized_shape = (hidden_size,)
        self._one_pass = False

    def process_weights_after_loading(self) -> None:
        """float32 on CPU: one pass in tidepool's kernel (attention/cpu_decoder_ops.py)."""
        self._one_pass = cpu_decoder_ops.usable(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._one_pass and x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1:
            return cpu_decoder_ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            # Four passes, the temporaries reused: on CPU F.rms_norm decomposes into more ops and
            # is slower (docs/performance.md, 'Choices elsewhere in the code').
            inv_rms = torch.mean(x * x, dim=-1, keepdim=True).add_(self.eps).rsqrt_()
            return torch.mul(x, inv_rms).mul_(self.weight)
        # Lower precision: the statistics in float32, as transformers computes them.
        x32 = x.float()
        inv_rms = torch.mean(x32 * x32, dim=-1, keepdim=True).add_(self.eps).rsqrt_()
        return self.weight * torch.mul(x32, inv_rms).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape[0]}, eps={self.eps}"
