"""Gemma 2 and Gemma 3 (text) causal decoders on packed tokens, built from the Llama pieces.

    token ids → embed * sqrt(hidden) → N x [x + post_attn_norm(attention(input_norm(x)))
                                            x + post_ffw_norm(GeGLU(pre_ffw_norm(x)))]
              → norm → hidden [num_tokens, hidden]   (*Model: pooled; *ForCausalLM: → lm_head)

What differs from Llama, all checked against transformers' modeling_gemma2 / modeling_gemma3:

- RMSNorm scales by (1 + weight), in float32 whatever the model dtype (the checkpoint stores
  weight - 1); four norms per layer, the attention and MLP outputs normalized before the residual
  add (so the residual cannot be fused into o_proj / down_proj as in Llama).
- The embedding is multiplied by sqrt(hidden_size) rounded to the model dtype (bfloat16 turns
  sqrt(3072) = 55.43 into 55.5, and the checkpoints were trained with that).
- GeGLU MLP (`hidden_activation`, gelu with the tanh approximation), the GELU a GEMM post-op.
- Attention scale query_pre_attn_scalar ** -0.5, not head_dim ** -0.5.
- Layers alternate sliding-window and full attention (`config.layer_types`; transformers fills it
  from the old `sliding_window_pattern`); each kind is its own KV-cache group. transformers' window
  (key k visible to query q when q - k < sliding_window) is ours (SlidingWindowSpec), unchanged.
- Gemma 2: attention logits soft-capped (cap * tanh(scores / cap)) and final logits too.
- Gemma 3: per-head q/k norms, a local RoPE base for sliding layers (`rope_local_base_freq`; the
  full layers keep rope_theta and its scaling); final logits soft-capped when the config says so.
  transformers' Gemma 3 never passes `attn_logit_softcapping` to its attention, so neither do we.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import torch
from torch import nn

from tidepool.attention import cpu_decoder_ops
from tidepool.attention.paged_metadata import PagedAttentionMetadata
from tidepool.models.layers.linear import Linear
from tidepool.models.layers.rmsnorm import RMSNorm
from tidepool.models.layers.rotary import RotaryEmbedding
from tidepool.models.llama import (
    DecoderAttention,
    LlamaForCausalLM,
    LlamaModel,
    _head_size,
)


class GemmaRMSNorm(RMSNorm):
    """x / sqrt(mean(x^2) + eps) * (1 + weight), computed in float32, cast back at the end.
    float32 on CPU: one pass in tidepool's RMSNorm kernel with (1 + weight) made once at load
    (four of these per layer were ~4 torch passes each, plus the (1 + weight) every call)."""

    def process_weights_after_loading(self) -> None:
        self.plus_one = 1.0 + self.weight.detach().float()
        self._one_pass = cpu_decoder_ops.usable(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._one_pass and x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1:
            return cpu_decoder_ops.rms_norm(x, self.plus_one, self.eps)
        plus_one = getattr(self, "plus_one", None)
        if plus_one is None:  # not loaded through the loader (tests building layers alone)
            plus_one = 1.0 + self.weight.float()
        x32 = x.float()
        inv_rms = torch.mean(x32 * x32, dim=-1, keepdim=True).add_(self.eps).rsqrt_()
        return torch.mul(x32, inv_rms).mul_(plus_one).to(x.dtype)


class GeGLU(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)): the GELU and the product run as GEMM post-ops."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        hidden, intermediate = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(hidden, intermediate, bias=False, activation=act)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.up_proj(x, multiply=self.gate_proj(x)))


class Gemma2Attention(DecoderAttention):
    norm_cls = GemmaRMSNorm

    def __init__(self, config: Any, layer_index: int) -> None:
        super().__init__(config, layer_index)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5
        self.softcap = getattr(config, "attn_logit_softcapping", None)


class Gemma3Attention(Gemma2Attention):
    qk_norm = True

    def __init__(self, config: Any, layer_index: int) -> None:
        super().__init__(config, layer_index)
        self.softcap = None  # as transformers: Gemma 3 does not cap attention logits


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_index: int, attention_cls: type[DecoderAttention]
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_index)
        self.mlp = GeGLU(config)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    @property
    def is_sliding(self) -> bool:
        return self.self_attn.sliding_window is not None

    def forward(self, x, cos_sin, attn_metadata, kv_cache) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), None, cos_sin, attn_metadata, kv_cache)
        x = self.post_attention_layernorm(h).add_(x)
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))).add_(x)

    def forward_rows(self, x, cos_sin, attn_metadata, kv_cache, output_rows) -> torch.Tensor:
        """The last layer when the step reads only `output_rows` [R] (llama.DecoderLayer's):
        K/V at every token, queries, o_proj and the MLP at those rows → [R, hidden]."""
        h = self.self_attn.attend(
            self.input_layernorm(x), cos_sin, attn_metadata, kv_cache, output_rows
        )
        if output_rows.numel() == 0:  # only prompt chunks short of their end: K/V was all
            return x.new_empty(0, x.shape[1])
        h = self.self_attn.o_proj(h)
        x = self.post_attention_layernorm(h).add_(x.index_select(0, output_rows))
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))).add_(x)


def _check_causal(config: Any) -> None:
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(
            f"{type(config).__name__} has use_bidirectional_attention=True (an encoder such as "
            "EmbeddingGemma); it runs as an encoder with the pooling runner (models/gemma_embed.py), "
            "not as a causal decoder"
        )


class Gemma2Model(LlamaModel):
    """The decoder body: packed token ids → final-norm hidden states [num_tokens, hidden]."""

    attention_cls = Gemma2Attention
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

    def __init__(self, config: Any) -> None:
        _check_causal(config)
        super().__init__(config)
        self.embed_scale = float(config.hidden_size) ** 0.5
        # Sliding-window layers' RoPE, where it differs from the full layers' (Gemma 3).
        self.rotary_emb_local: RotaryEmbedding | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: PagedAttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """→ [num_tokens, hidden], or [len(output_rows), hidden] when the metadata names output
        rows (the last layer then runs its queries and MLP at those rows only, as Llama's)."""
        x = self.embed_tokens(input_ids)
        x = x.mul_(torch.tensor(self.embed_scale, dtype=x.dtype))  # scale in the model dtype
        cos_sin = self.rotary_emb.cos_sin(positions, x.dtype)
        cos_sin_local = cos_sin
        if self.rotary_emb_local is not None:
            cos_sin_local = self.rotary_emb_local.cos_sin(positions, x.dtype)
        output_rows = attn_metadata.output_rows
        last = len(self.layers) - 1 if output_rows is not None else len(self.layers)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            rope = cos_sin_local if layer.is_sliding else cos_sin
            if index == last:
                assert output_rows is not None
                x = layer.forward_rows(x, rope, attn_metadata, kv_cache, output_rows)
            else:
                x = layer(x, rope, attn_metadata, kv_cache)
        return self.norm(x)


class Gemma2ForCausalLM(LlamaForCausalLM):
    body_cls: ClassVar[type[LlamaModel]] = Gemma2Model

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.final_logit_softcap: float | None = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_seqs, hidden] → float32 logits [num_seqs, vocab], soft-capped in float32
        (transformers caps in the model dtype; the same in float32, closer in bfloat16)."""
        logits = self.lm_head(hidden).float()
        cap = self.final_logit_softcap
        if cap is not None:
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits


def _local_rope_config(config: Any) -> Any:
    """What RotaryEmbedding reads for Gemma 3's sliding-window layers."""
    params = getattr(config, "rope_parameters", None)
    if params and isinstance(params.get("sliding_attention"), dict):  # transformers 5
        return SimpleNamespace(rope_parameters=params["sliding_attention"])
    # transformers 4.x: the local base in its own field, no scaling for local layers.
    base = getattr(config, "rope_local_base_freq", 10000.0)
    return SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": base})


class Gemma3TextModel(Gemma2Model):
    attention_cls = Gemma3Attention

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.rotary_emb_local = RotaryEmbedding(_head_size(config), _local_rope_config(config))


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    body_cls = Gemma3TextModel
