"""PaliGemma's language side as ColPali runs it: Gemma (1) attending bidirectionally over the
whole prompt, as an encoder on packed tokens, with image rows spliced in.

    prompt ids ─ embed_tokens * sqrt(hidden) (in the model dtype) ─┐
    image rows (vision tower → multi_modal_projector, NOT scaled) ──┴─▶ inputs_embeds
    positions 1..T (PaliGemma's positions are 1-indexed) ─▶ N x [x + attn(input_norm(x))
                                                              x + GeGLU(post_attn_norm(x))]
    ─▶ norm ─▶ hidden [num_tokens, hidden]

Facts from transformers 5's modeling_paligemma / modeling_gemma / modeling_colpali:

- The image features are the projector's output as they are: Gemma's scale lives in its
  embedding module (GemmaTextScaledWordEmbedding), which image rows never pass through.
- `position_ids = arange(T) + 1` (with RoPE a constant shift leaves the attention scores as they
  are, up to rounding; tidepool rotates the same positions all the same).
- The attention mask: PaliGemmaModel gets ColPaliProcessor's `token_type_ids` (all 0 for pages
  and queries) and makes every token of the same `token_type_ids == 0` block see every other:
  the whole unpadded prompt is bidirectional, whatever the text config's
  use_bidirectional_attention (it only decides SDPA's is_causal where no mask is built). Called
  without token_type_ids the mask is causal where the batch is padded, and bidirectional where
  SDPA skips the mask: not a rule to copy.
- Gemma 1 layers: RMSNorm scaling by (1 + weight) in float32, two norms per layer, GeGLU with
  `hidden_act`, attention scale head_dim ** -0.5, no soft-capping, no sliding window.
- An image token id past the vocabulary is looked up as id 0 (its row is replaced anyway).

Gemma 2 / 3 text configs (PaliGemma 2, 3) are refused: their layers and masks differ.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tidepool.attention.backend import BUCKETED_SDPA, EncoderAttentionBackend, EncoderStepMetadata
from tidepool.attention.layer import Attention
from tidepool.models.gemma import GeGLU, GemmaRMSNorm
from tidepool.models.layers.linear import Linear
from tidepool.models.layers.rotary import RotaryEmbedding, apply_rotary
from tidepool.models.llama import DecoderAttention, _head_size


def check_text_config(config: Any) -> None:
    """Refuse what this Gemma does not implement, naming the option."""
    model_type = getattr(config, "model_type", "gemma")
    if model_type != "gemma":
        raise ValueError(
            f"PaliGemma with a {model_type!r} text model is not supported: tidepool runs "
            "PaliGemma 1 (Gemma text config, model_type 'gemma') only"
        )
    activation = getattr(config, "hidden_activation", None)
    if activation is not None and activation != config.hidden_act:
        raise ValueError(
            f"the Gemma text config has hidden_activation={activation!r} and hidden_act="
            f"{config.hidden_act!r}; transformers' Gemma uses hidden_act, tidepool refuses to "
            "guess which one the checkpoint was trained with"
        )


class GemmaPrefixAttention(DecoderAttention):
    """Gemma 1's q/k/v/o (fused q/k/v), attending bidirectionally within each packed sequence."""

    def __init__(self, config: Any, layer_index: int) -> None:
        super().__init__(config, layer_index)
        self.attn = Attention(BUCKETED_SDPA)

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        meta: EncoderStepMetadata,
    ) -> torch.Tensor:
        """x [num_rows, hidden] → [num_rows, hidden] (after o_proj)."""
        qkv = self.qkv_proj(x)
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        q = qkv[:, :q_end].view(-1, self.num_heads, self.head_size)
        k = qkv[:, q_end:k_end].view(-1, self.num_kv_heads, self.head_size)
        v = qkv[:, k_end:].view(-1, self.num_kv_heads, self.head_size)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(self.attn.backend.attend_heads(q, k, v, meta, self.scale))


class GemmaPrefixLayer(nn.Module):
    def __init__(self, config: Any, layer_index: int) -> None:
        super().__init__()
        self.self_attn = GemmaPrefixAttention(config, layer_index)
        self.mlp = GeGLU(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: EncoderStepMetadata
    ) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(x), cos_sin, meta).add_(x)
        return self.mlp(self.post_attention_layernorm(x)).add_(x)


class PaliGemmaTextEncoder(nn.Module):
    """The language model: packed embeddings → final-norm hidden states [num_tokens, hidden].
    Parameter names are transformers' GemmaModel's (q/k/v fused into qkv_proj)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        check_text_config(config)
        self.config = config
        self.vocab_size = int(config.vocab_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GemmaPrefixLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head_size = _head_size(config)
        self.rotary_emb = RotaryEmbedding(self.head_size, config)
        self.embed_scale = float(config.hidden_size) ** 0.5

    def set_attention_backend(self, backend: EncoderAttentionBackend) -> None:
        for layer in self.layers:
            layer.self_attn.attn.backend = backend

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] → scaled token embeddings [num_tokens, hidden] (ids past the vocabulary,
        the image placeholder of some checkpoints, read row 0)."""
        ids = input_ids.masked_fill(input_ids >= self.vocab_size, 0)
        x = self.embed_tokens(ids)
        return x.mul_(torch.tensor(self.embed_scale, dtype=x.dtype))  # scale in the model dtype

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        meta: EncoderStepMetadata,
    ) -> torch.Tensor:
        """inputs_embeds [num_tokens, hidden], positions [num_tokens] 0-based per sequence
        → [num_tokens, hidden] in packed order (the layers run on the backend's rows)."""
        rows = meta.rows
        x, pos = rows.gather(inputs_embeds), rows.gather(positions)
        assert x is not None and pos is not None  # gather keeps a tensor a tensor
        cos_sin = self.rotary_emb.cos_sin(pos + 1, x.dtype)
        for layer in self.layers:
            x = layer(x, cos_sin, meta)
        return rows.to_tokens(self.norm(x))


class PaliGemmaMultiModalProjector(nn.Module):
    """vision hidden → text hidden (one Linear with bias): the rows at the <image> tokens."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = config.vision_config
        self.linear = Linear(vision.hidden_size, vision.projection_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)
