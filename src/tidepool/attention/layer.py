"""The one attention layer type of tidepool's models, and the one way a model gets its backend.

A model's attention module holds an `Attention` and calls it with this step's q / k / v and the
metadata its backend built (common.py); it never names a backend or a kernel. The loader picks
the backend once (backend.py) and hands it over with `set_attention_backend`, which every model
inherits from `AttentionModel`: it reaches each `Attention` of the model, and the model's own
`attention_backend` (which the runner asks for the metadata builder and the cache layout).

    BertSelfAttention ─ attn: Attention ─ backend.attend(qkv, meta, scale)      (encoders)
    LlamaAttention    ─ attn: Attention ─ backend.paged_attention(q, k, v, ...)  (decoders)

The calls are the backend's own (abstract.py): one attribute hop, no extra frame per layer.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class Attention(nn.Module):
    """Holds the backend a model's layer attends with: `attn.backend.attend(...)` (encoders) or
    `attn.backend.paged_attention(...)` (decoders). No parameters, nothing in the state dict."""

    def __init__(self, backend: Any) -> None:
        super().__init__()
        self.backend = backend
        """The loader's choice (set_attention_backend); the SDPA one when built by hand."""

    def extra_repr(self) -> str:
        return repr(self.backend)


class AttentionModel:
    """Mixin of every model (native or the transformers backend's wrappers): the loader's hand-over.
    A model keeps `attention_backend` as an attribute (or a property delegating to a body)."""

    def set_attention_backend(self, backend: Any) -> None:
        """Use `backend` from now on in every Attention layer (called once, at load)."""
        assert isinstance(self, nn.Module)
        for module in self.modules():
            if isinstance(module, Attention):
                module.backend = backend
            elif isinstance(module, AttentionModel) and "attention_backend" in vars(module):
                vars(module)["attention_backend"] = backend  # a plain attribute (above)
