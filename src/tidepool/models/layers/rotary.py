"""Rotary position embeddings (RoPE), "rotate half" form, with the scaling types by name.

    x = [x1 | x2]  (halves of the rotary dims)      out = [x1 cos - x2 sin | x2 cos + x1 sin]
    angle(position p, pair i) = p * inv_freq[i]

cos / sin are computed once per step for the step's positions and shared by every layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _default_inv_freq(base: float, dim: int, params: dict[str, Any]) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _linear_inv_freq(base: float, dim: int, params: dict[str, Any]) -> torch.Tensor:
    # Positions divided by `factor` = frequencies divided by it.
    return _default_inv_freq(base, dim, params) / float(params["factor"])


def _llama3_inv_freq(base: float, dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth ramp between."""
    inv_freq = _default_inv_freq(base, dim, params)
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


ROPE_TYPES: dict[str, Callable[[float, int, dict[str, Any]], torch.Tensor]] = {
    "default": _default_inv_freq,
    "linear": _linear_inv_freq,
    "llama3": _llama3_inv_freq,
}
"""rope_type → inverse frequencies [rotary_dim // 2]; a new scaling type registers here."""


def rope_parameters(config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
    """transformers 5 `rope_parameters`, or 4.x `rope_theta` + `rope_scaling`, as one dict.

    Models whose layer types rotate differently (Gemma 3: a local base for sliding-window layers)
    nest them per layer type in transformers 5: {"full_attention": {...}, "sliding_attention": ...}.
    """
    params = getattr(config, "rope_parameters", None)
    if params and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, config: Any) -> None:
        super().__init__()
        params = rope_parameters(config)
        rope_type = params["rope_type"]
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"RoPE scaling {rope_type!r} is not supported; supported: {sorted(ROPE_TYPES)}"
            )
        partial = float(params.get("partial_rotary_factor", 1.0) or 1.0)
        if partial != 1.0:
            # transformers' Llama / Mistral / Qwen / Gemma rotate every dim whatever the factor
            # says (default RoPE), or fail (scaled types); vLLM rotates the fraction: refused.
            raise ValueError(
                f"partial_rotary_factor={partial} is not supported for {type(config).__name__}: "
                "transformers rotates the whole head for this architecture and vLLM only that "
                "fraction, so tidepool does not pick one"
            )
        self.rotary_dim = head_size
        self.head_size = head_size
        self._params = params
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        params = self._params
        return ROPE_TYPES[params["rope_type"]](float(params["rope_theta"]), self.rotary_dim, params)

    def process_weights_after_loading(self) -> None:
        """Models are built on the meta device (no values) and cast to the model dtype after
        loading: recompute the frequencies, in float32, where the buffer now lives."""
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] → cos, sin [T, 1, rotary_dim // 2] (broadcast over heads)."""
        angles = positions.float()[:, None] * self.inv_freq.float()[None, :]
        return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, head_size] (any strides) → rotated copy, contiguous.

    Written half by half into one output with mul + addcmul: 4 passes instead of 6 plus a cat
    (docs/performance.md, 'Choices elsewhere in the code').
    """
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out1, out2 = out[..., :half], out[..., half : 2 * half]
    torch.mul(x1, cos, out=out1).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=out2).addcmul_(x1, sin)  # x2 cos + x1 sin
    if 2 * half != x.shape[-1]:
        out[..., 2 * half :] = x[..., 2 * half :]
    return out
