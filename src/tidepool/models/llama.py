"""Llama-family causal decoders on packed tokens: Llama, Mistral, Qwen2, Qwen3.

    token ids → embed → N x [RMSNorm → attention (+ residual) → RMSNorm → SwiGLU MLP (+ residual)]
              → RMSNorm → hidden [num_tokens, hidden]   (*Model: pooled; *ForCausalLM: → lm_head)

The variants differ only in flags read from the config: q/k/v biases (Qwen2), per-head RMSNorm of
q and k before RoPE (Qwen3), a sliding window (Mistral, Qwen2 `layer_types`), tied embeddings.
Module names follow Hugging Face's, except that q/k/v are fused into `qkv_proj` (one GEMM);
the SwiGLU's elementwise ops and the residual adds run inside the GEMMs (oneDNN post-ops).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from tidepool.attention import cpu_decoder_ops
from tidepool.attention.backend import PAGED_SDPA, AttentionSpec, DecoderAttentionBackend
from tidepool.attention.layer import Attention, AttentionModel
from tidepool.attention.paged_metadata import PagedAttentionMetadata
from tidepool.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from tidepool.models.layers.linear import Linear
from tidepool.models.layers.rmsnorm import RMSNorm
from tidepool.models.layers.rotary import RotaryEmbedding, apply_rotary
from tidepool.models.weights import load_fused_weights


def _head_size(config: Any) -> int:
    return int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )


def _layer_window(config: Any, layer_index: int) -> int | None:
    """The layer's sliding window, or None for full attention."""
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types is not None:
        return window if layer_types[layer_index] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


class DecoderAttention(nn.Module):
    qkv_bias: ClassVar[bool | None] = None
    """Biases on q/k/v (and none on o): Qwen2. None = `config.attention_bias` on all four."""
    qk_norm: ClassVar[bool] = False
    """Per-head RMSNorm of q and k before RoPE: Qwen3."""
    norm_cls: ClassVar[type[nn.Module]] = RMSNorm

    def __init__(self, config: Any, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_size = _head_size(config)
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.scale = self.head_size**-0.5
        # Attention-logit soft-capping (Gemma 2): scores → softcap * tanh(scores / softcap).
        self.softcap: float | None = None
        self.sliding_window = _layer_window(config, layer_index)
        self.attn = Attention(PAGED_SDPA)
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias if self.qkv_bias is None else self.qkv_bias
        o_bias = attention_bias if self.qkv_bias is None else False
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias)
        if self.qk_norm:
            self.q_norm = self.norm_cls(self.head_size, config.rms_norm_eps)
            self.k_norm = self.norm_cls(self.head_size, config.rms_norm_eps)
        self._fused_qk = False

    def process_weights_after_loading(self) -> None:
        """float32 on CPU: q / k norm and RoPE in one pass of tidepool's kernel
        (attention/cpu_decoder_ops.py); a norm other than plain RMSNorm (Gemma's 1 + weight)
        keeps the torch ops."""
        plain_norm = not self.qk_norm or self.norm_cls is RMSNorm
        self._fused_qk = plain_norm and cpu_decoder_ops.usable(self.qkv_proj.weight)

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        if self.sliding_window is not None:
            return SlidingWindowSpec(
                block_size, self.num_kv_heads, self.head_size, dtype, self.sliding_window
            )
        return FullAttentionSpec(block_size, self.num_kv_heads, self.head_size, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: PagedAttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        out = self.attend(x, cos_sin, attn_metadata, kv_cache)
        return self.o_proj(out, residual=residual)

    def attend(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: PagedAttentionMetadata,
        kv_cache: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] → attention output before o_proj [T, q_size]; with `output_rows`
        [R, q_size], the queries of those rows only (K/V of all T go into the cache)."""
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        num_qk_heads = self.num_heads + self.num_kv_heads
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_size)
        cos, sin = cos_sin
        if self._fused_qk and cos.dtype == torch.float32:
            q, k = self._norm_rope_fused(qkv, cos, sin)
        elif self.qk_norm:
            q = self.q_norm(qkv[:, : self.q_size].view(-1, self.num_heads, self.head_size))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view_as(v))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        else:
            # q and k side by side: one rotary pass for both.
            qk = apply_rotary(
                qkv[:, : self.q_size + self.kv_size].view(-1, num_qk_heads, self.head_size),
                cos,
                sin,
            )
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        meta = attn_metadata.for_layer(self.layer_index)
        if output_rows is not None:
            q = q.index_select(0, output_rows)
            meta = attn_metadata.for_output_rows(self.layer_index)
        return self.attn.backend.paged_attention(q, k, v, kv_cache, meta, self.scale, self.softcap)

    def _norm_rope_fused(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D]: views of qkv, normed and rotated in place, one pass."""
        num_tokens = qkv.shape[0]
        qk = qkv[:, : self.q_size + self.kv_size].view(
            -1, self.num_heads + self.num_kv_heads, self.head_size
        )
        q_weight = k_weight = None
        eps = 0.0
        if self.qk_norm:
            q_weight, k_weight, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        cpu_decoder_ops.qk_norm_rope_(
            qk,
            self.num_heads,
            q_weight,
            k_weight,
            eps,
            cos.view(num_tokens, -1),
            sin.view(num_tokens, -1),
        )
        return qk[:, : self.num_heads], qk[:, self.num_heads :]


class Qwen2Attention(DecoderAttention):
    qkv_bias = True


class Qwen3Attention(DecoderAttention):
    qk_norm = True


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) + residual, every elementwise op a GEMM post-op on CPU:
    gate runs with a fused SiLU, up multiplies by the gate inside its GEMM, down adds the
    residual. Two GEMMs instead of one fused gate_up cost the same FLOPs and save two passes
    over [tokens, intermediate] (docs/performance.md, 'Choices elsewhere in the code')."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"the MLP supports silu (SwiGLU) only, got hidden_act={act!r}")
        bias = bool(getattr(config, "mlp_bias", False))
        hidden, intermediate = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(hidden, intermediate, bias=bias, activation="silu")
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.up_proj(x, multiply=self.gate_proj(x)), residual=residual)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_index: int, attention_cls: type[DecoderAttention]
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_index)
        self.mlp = SwiGLU(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos_sin, attn_metadata, kv_cache) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(x), x, cos_sin, attn_metadata, kv_cache)
        return self.mlp(self.post_attention_layernorm(x), x)

    def forward_rows(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: PagedAttentionMetadata,
        kv_cache: torch.Tensor,
        output_rows: torch.Tensor,
    ) -> torch.Tensor:
        """The last layer when the step reads only `output_rows` [R]: K/V at every token, the
        rest at those rows → [R, hidden]."""
        attn = self.self_attn.attend(
            self.input_layernorm(x), cos_sin, attn_metadata, kv_cache, output_rows
        )
        if output_rows.numel() == 0:  # only prompt chunks short of their end: K/V was all
            return x.new_empty(0, x.shape[1])
        x = self.self_attn.o_proj(attn, residual=x.index_select(0, output_rows))
        return self.mlp(self.post_attention_layernorm(x), x)


# Checkpoint projection → (our fused parameter, shard index); shards are laid out in this order.
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
}


class LlamaModel(AttentionModel, nn.Module):
    """The decoder body: packed token ids → final-norm hidden states [num_tokens, hidden] (a
    DecoderModel, models/interfaces.py)."""

    is_causal: ClassVar[bool] = True
    default_pooling_type: ClassVar[str] = "LAST"
    attention_cls: ClassVar[type[DecoderAttention]] = DecoderAttention
    layer_cls: ClassVar[type[nn.Module]] = DecoderLayer
    """Called as layer_cls(config, layer_index, attention_cls)."""
    norm_cls: ClassVar[type[nn.Module]] = RMSNorm

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_cls(config, i, self.attention_cls) for i in range(config.num_hidden_layers)
        )
        self.norm = self.norm_cls(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(_head_size(config), config)
        self.attention_backend: DecoderAttentionBackend = PAGED_SDPA
        """Chosen by the loader (attention/backend.py); paged SDPA when built by hand."""

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        max_positions = int(getattr(self.config, "max_position_embeddings", 0) or 0)
        return AttentionSpec(device, dtype, _head_size(self.config), max_positions)

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> dict[str, KVCacheSpec | None]:
        """Layer name → what it stores per block (in layer order: index i = self.layers[i])."""
        return {
            f"layers.{i}": layer.self_attn.kv_cache_spec(block_size, dtype)
            for i, layer in enumerate(self.layers)
        }

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: PagedAttentionMetadata,
        kv_caches: list[torch.Tensor],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """→ [num_tokens, hidden], or [len(output_rows), hidden] when the metadata names
        output rows (the last layer then computes its queries and MLP at those rows only:
        1 / num_layers of the step's work, less the last layer's K/V). `inputs_embeds`
        [num_tokens, hidden] replaces the token embeddings (a multimodal model's, with its
        images' rows); `positions` may be [3, num_tokens] where rotary_emb takes them (M-RoPE)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos_sin = self.rotary_emb.cos_sin(positions, x.dtype)
        output_rows = attn_metadata.output_rows
        last = len(self.layers) - 1 if output_rows is not None else len(self.layers)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if index == last:
                assert output_rows is not None
                x = layer.forward_rows(x, cos_sin, attn_metadata, kv_cache, output_rows)
            else:
                x = layer(x, cos_sin, attn_metadata, kv_cache)
        return self.norm(x)

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint name → our parameter name (before q/k/v fusion); None = not ours."""
        name = name.removeprefix("model.")
        if name.startswith(("lm_head.", "score.")) or "rotary_emb." in name:
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_fused_weights(self, weights, self.map_weight_name, _STACKED, _shard_sizes)


class DecoderWithHead(AttentionModel, nn.Module):
    """A decoder body (`model`, named as in the checkpoints) plus a head on its last hidden
    states: the DecoderModel members delegate to the body; subclasses add the head."""

    is_causal: ClassVar[bool] = True
    default_pooling_type: ClassVar[str] = "LAST"
    body_cls: ClassVar[type[LlamaModel]] = LlamaModel

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = self.body_cls(config)

    @property
    def attention_backend(self) -> DecoderAttentionBackend:
        return self.model.attention_backend

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        return self.model.attention_spec(device, dtype)

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> dict[str, KVCacheSpec | None]:
        return self.model.kv_cache_specs(block_size, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: PagedAttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata, kv_caches)


class LlamaForCausalLM(DecoderWithHead):
    """The body plus the language-model head (tied to the embeddings when the config says so):
    a DecoderModel and a LanguageModelHead (models/interfaces.py)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self._tie()

    def _tie(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_seqs, hidden] → float32 logits [num_seqs, vocab]."""
        return self.lm_head(hidden).float()

    def map_weight_name(self, name: str) -> str | None:
        if name.startswith("lm_head."):
            return None if self.tie_word_embeddings else name
        mapped = self.model.map_weight_name(name)
        return None if mapped is None else "model." + mapped

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self._tie()  # to_empty() made separate tensors of the tied pair
        return load_fused_weights(self, weights, self.map_weight_name, _STACKED, _shard_sizes)


class MistralModel(LlamaModel):
    pass


class MistralForCausalLM(LlamaForCausalLM):
    body_cls = MistralModel


class Qwen2Model(LlamaModel):
    attention_cls = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    body_cls = Qwen2Model


class Qwen3Model(LlamaModel):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    body_cls = Qwen3Model


def _shard_sizes(module: nn.Module, fused_name: str) -> list[int]:
    """Output rows of each shard of the fused q / k / v parameter."""
    owner = module.get_submodule(fused_name.rsplit(".", 2)[0])
    assert isinstance(owner, DecoderAttention)
    return [owner.q_size, owner.kv_size, owner.kv_size]
