"""The dtype and device a model runs in: the user's choice, else the rule per device."""

from __future__ import annotations

from typing import Any

import torch

from tidepool import envs

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def checkpoint_dtype(hf_config: Any) -> Any:
    # transformers 5 names it `dtype`, 4.x `torch_dtype` (reading the old name warns in 5).
    return hf_config.__dict__.get("dtype", hf_config.__dict__.get("torch_dtype"))


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, hf_dtype: Any) -> torch.dtype:
    """The user's dtype; "auto": float32 on every CPU kind, else the checkpoint's half type or
    what the GPU supports.

    The CPU rule per kind (docs/performance.md, "dtype="auto" per CPU kind"): float32 matches
    the reference more closely than bfloat16 can, so bfloat16 stays opt-in even where it is
    fast: with AMX-bf16 and with avx512_bf16 without AMX (AMD Zen 4 / 5: oneDNN's
    avx512_core_bf16 GEMM, the attention products on vdpbf16ps); without either, oneDNN
    converts bfloat16 to float32 and it is slower than float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected auto, {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        # float32 on CPU matches the reference to 1e-6; bfloat16 is opt-in (dtype="bfloat16").
        return torch.float32
    if hf_dtype in (torch.float16, torch.bfloat16):
        return hf_dtype
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def default_device() -> torch.device:
    """TIDEPOOL_DEVICE where set, else CUDA when present, else the CPU."""
    forced = envs.device()
    if forced:
        return torch.device(forced)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
