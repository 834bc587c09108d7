"""tidepool's attention as a function in transformers' attention registry (the transformers backend).

A Hugging Face model built with `attn_implementation="tidepool"` calls `tidepool_attention` in every
attention layer, with the q / k / v it computed (projections, RoPE, q/k norms all stay HF code):

    query [1, num_heads, num_tokens, head_dim], key / value [1, num_kv_heads, num_tokens, head_dim]
      → attn_output [1, num_tokens, num_heads, head_dim], None

The batch is the step's flat token stream as one sequence of `num_tokens`. Which tokens belong to
which sequence, and where the KV cache is, comes from a step object that the backend passes in the
model call's keyword arguments (`tidepool_step=...`); transformers 5 hands every keyword argument
of the model's forward down to its attention functions. No global state is read:

    EncoderStep   attention inside each sequence on the model's attention backend
                  (attention/backend.py); a layer that asks for a sliding window (ModernBERT's
                  local layers: key k is visible to query q when |q - k| < sliding_window) or
                  for causal attention (`is_causal` in the call or on the module: CLIP's text
                  tower) calls its attend_banded (a backend without BANDED refuses it, in the
                  load-time check's forward)
    DecoderStep   causal attention over the paged KV cache (attention/paged*.py): this step's K/V are
                  written through the slot mapping, every key is read through the block table, so
                  chunked prefill and prefix caching work as with native models; the layer's cache
                  and metadata group are picked by `module.layer_idx`
    ProbeStep     a load-time dry run of a decoder that records each layer's KV heads, head size
                  and sliding window as the layer passes them (the KV specs are made from these)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tidepool.attention.backend import (
    BANDED,
    DecoderAttentionBackend,
    EncoderAttentionBackend,
    EncoderStepMetadata,
)
from tidepool.attention.paged_metadata import PagedAttentionMetadata

ATTENTION_NAME = "tidepool"
"""The key of our function in transformers' AttentionInterface (config._attn_implementation)."""
STEP_KWARG = "tidepool_step"
"""The keyword argument of the model call that carries the step object to the attention calls."""


class UnsupportedAttentionError(NotImplementedError):
    """The model asks for an attention feature that tidepool's attention does not implement."""


@dataclass
class EncoderStep:
    """One encoder step: attention inside each packed sequence (no KV cache), bidirectional
    unless the layer asks for causal attention."""

    metadata: EncoderStepMetadata
    """What the model's backend built for the step (the layers run on its rows)."""
    backend: EncoderAttentionBackend
    """The model's attention backend (chosen at load); layers with a sliding window or a
    causal mask call its attend_banded (BANDED)."""
    modules_called: set[int] = field(default_factory=set)
    """id() of each attention module that ran (ALBERT runs one module in every layer)."""

    def attend(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        causal: bool,
    ) -> torch.Tensor:
        # [1, H, T, D] → [T, H, D] views (no copy).
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        num_tokens, num_heads, head_dim = q.shape
        if sliding_window is None and not causal:
            out = self.backend.attend_heads(q, k, v, self.metadata, scale)
        elif BANDED in self.backend.provides:
            # A causal encoder layer (CLIP's text tower) or a window: a band per sequence.
            out = self.backend.attend_banded(q, k, v, self.metadata, scale, sliding_window, causal)
        else:
            raise UnsupportedAttentionError(
                f"{type(module).__name__} attends with sliding_window={sliding_window}, "
                f"causal={causal}: attention backend {self.backend.name!r} does not provide "
                f"{BANDED!r}"
            )
        return out.view(1, num_tokens, num_heads, head_dim)


@dataclass
class DecoderStep:
    """One causal step over the paged KV cache."""

    metadata: PagedAttentionMetadata
    kv_caches: list[torch.Tensor]
    """One [2, num_kv_heads, num_blocks, block_size, head_size] view per attention layer."""
    cache_index: dict[int, int]
    """module.layer_idx → index into kv_caches and metadata.layer_groups."""
    declared_windows: tuple[int | None, ...]
    """The sliding window each layer passed in the build-time probe (its KV spec was made from
    it); a layer passing another one later is refused."""
    backend: DecoderAttentionBackend
    """The model's attention backend (chosen at load)."""
    modules_called: set[int] = field(default_factory=set)
    """id() of each attention module that ran."""

    def attend(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        causal: bool,
    ) -> torch.Tensor:
        layer_idx = getattr(module, "layer_idx", None)
        if layer_idx not in self.cache_index:
            raise UnsupportedAttentionError(
                f"{type(module).__name__} has layer_idx={layer_idx!r}, which names no KV-cache layer"
            )
        index = self.cache_index[layer_idx]
        if sliding_window != self.declared_windows[index]:
            raise UnsupportedAttentionError(
                f"layer {layer_idx} attends with sliding_window={sliding_window}, but passed "
                f"{self.declared_windows[index]} at load time; its KV cache was sized for that"
            )
        _require_causal(module, causal)
        # [1, H, T, D] → [T, H, D] views (no copy); paged_attention handles the strides.
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        meta = self.metadata.for_layer(index)
        out = self.backend.paged_attention(q, k, v, self.kv_caches[index], meta, scale)
        return out.view(1, q.shape[0], q.shape[1], q.shape[2])


def _require_causal(module: nn.Module, causal: bool) -> None:
    """Decoder steps refuse a layer that attends bidirectionally (as it says in its module or in
    the call's `is_causal`)."""
    if not causal:
        raise UnsupportedAttentionError(
            f"{type(module).__name__} attends bidirectionally, but the model runs as a causal "
            "decoder"
        )


@dataclass(frozen=True)
class ObservedLayer:
    """What one attention layer of a decoder passes to the attention function."""

    num_kv_heads: int
    head_size: int
    sliding_window: int | None
    """HF's convention: key k is visible to query q when q - k < sliding_window."""


@dataclass
class ProbeStep:
    """A dry run of a decoder on a few tokens, before its KV cache exists: records each layer's
    KV heads, head size and window from what the layer actually passes (GPT-NeoX-style configs
    carry fields their attention ignores, so the config alone can mislead). Returns zeros."""

    layers: dict[int, ObservedLayer] = field(default_factory=dict)
    modules_called: set[int] = field(default_factory=set)

    def attend(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        causal: bool,
    ) -> torch.Tensor:
        layer_idx = getattr(module, "layer_idx", None)
        if not isinstance(layer_idx, int) or layer_idx in self.layers:
            raise UnsupportedAttentionError(
                f"{type(module).__name__} has layer_idx={layer_idx!r}: each attention layer "
                "needs its own integer layer_idx to find its KV cache"
            )
        _require_causal(module, causal)
        if value.shape[-1] != key.shape[-1]:
            raise UnsupportedAttentionError("keys and values of different head sizes")
        window = None if sliding_window is None else int(sliding_window)
        self.layers[layer_idx] = ObservedLayer(int(key.shape[1]), int(key.shape[-1]), window)
        return query.new_zeros(1, query.shape[2], query.shape[1], query.shape[3])


Step = EncoderStep | DecoderStep | ProbeStep


def tidepool_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract; the step comes in kwargs[STEP_KWARG].

    What the call asks for is honoured or refused, never dropped: `is_causal` (the call's value
    wins over the module's attribute, as in transformers' sdpa_attention_forward: CLIP's text
    model passes is_causal=True to layers whose module says False), `sliding_window`, `scaling`;
    a mask or a position bias of the model's own, soft-capping and sinks are refused."""
    step: Step | None = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(
            f"{type(module).__name__} called tidepool's attention without the step metadata: the "
            "model's forward does not pass its keyword arguments down to its attention layers"
        )
    if attention_mask is not None or kwargs.get("position_bias") is not None:
        raise UnsupportedAttentionError(
            f"{type(module).__name__} adds its own attention mask or bias (e.g. relative position "
            "biases or a custom mask); tidepool's attention builds its masks from the packed batch"
        )
    if softcap is not None:
        raise UnsupportedAttentionError("attention logit soft-capping is not supported")
    if kwargs.get("s_aux") is not None:
        raise UnsupportedAttentionError("attention sinks (s_aux) are not supported")
    if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise UnsupportedAttentionError(
            f"{type(module).__name__}: expected self-attention over one packed sequence, got "
            f"query {tuple(query.shape)} and key {tuple(key.shape)} (cross-attention?)"
        )
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", None)
    if causal is None:  # no word either way: the step's kind decides (decoders are causal)
        causal = not isinstance(step, EncoderStep)
    step.modules_called.add(id(module))
    return step.attend(module, query, key, value, scale, sliding_window, bool(causal)), None


def register_attention() -> None:
    """Make `attn_implementation="tidepool"` known to transformers (idempotent).

    transformers keeps attention functions in a class-level registry, shared by every model; the
    function itself is stateless (its state arrives with each call), so registering it twice or
    from several engines is harmless. No mask function is registered on purpose: for an attention
    implementation without one, transformers' mask builders return None instead of materializing
    [num_tokens, num_tokens] masks, and ours builds its masks from the step's metadata.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, tidepool_attention)
