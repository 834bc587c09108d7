"""EmbeddingGemma: Gemma 3's text body with bidirectional attention, as an encoder on packed tokens.

    token ids → embed * sqrt(hidden) → N x [x + post_attn_norm(attention(input_norm(x)))
                                            x + post_ffw_norm(GeGLU(pre_ffw_norm(x)))]
              → norm → hidden [num_tokens, hidden] → the pooler (mean → Dense → Dense → Normalize)

A `Gemma3TextModel` checkpoint whose config says `use_bidirectional_attention=True` (google/
embeddinggemma-300m) resolves here (model_loader/registry.py `native_architecture`); without the flag it
stays gemma.py's causal decoder. The layers are gemma.py's (GemmaRMSNorm's (1 + weight), GeGLU,
q/k norms, query_pre_attn_scalar ** -0.5, the local RoPE base for sliding layers, the embedding
scale in the model dtype); only the attention differs, checked against transformers'
modeling_gemma3 with the flag:

- Every layer is bidirectional inside its sequence; no KV cache, each prompt runs whole
  (EncoderScheduler), as BERT does.
- Full layers see every key. Sliding layers see key k from query q when |q - k| < W, with W the
  config's `sliding_window` *as transformers holds it in memory*: for bidirectional configs its
  __post_init__ turns config.json's value w into w // 2 + 1 (512 → 257: 256 keys each side), and
  AutoConfig has already done that by the time we read it. Worked example, W = 3:
      q = 5 sees k = 3, 4, 5, 6, 7 (|q - k| <= 2).
- Attention backends: full layers call the backend the loader chose (the CPU kernel takes head_dim
  32 / 64 / 128 only, so EmbeddingGemma's 256-wide heads run on bucketed SDPA; a smaller model
  may get the kernel); sliding layers call its `attend_banded` (a band mask per bucket), unless
  no sequence of the step is longer than W, where the band hides nothing and they take
  `attend_heads` too. The attention spec therefore needs BANDED (attention/abstract.py) when a
  sliding window is shorter than max_position_embeddings: a backend without it is refused at load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from tidepool.attention.backend import (
    BANDED,
    BUCKETED_SDPA,
    AttentionSpec,
    EncoderAttentionBackend,
    EncoderStepMetadata,
)
from tidepool.attention.layer import Attention, AttentionModel
from tidepool.models.gemma import GeGLU, Gemma3Attention, GemmaRMSNorm, _local_rope_config
from tidepool.models.layers.rotary import RotaryEmbedding, apply_rotary
from tidepool.models.llama import _STACKED, _head_size, _shard_sizes
from tidepool.models.weights import load_fused_weights


class GemmaEncoderAttention(Gemma3Attention):
    """Gemma 3's projections and q/k norms, attending bidirectionally over packed sequences."""

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
        qkv = self.qkv_proj(x)  # [num_rows, q_size + 2 * kv_size]
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        v = qkv[:, k_end:].view(-1, self.num_kv_heads, self.head_size)
        q = self.q_norm(qkv[:, :q_end].view(-1, self.num_heads, self.head_size))
        k = self.k_norm(qkv[:, q_end:k_end].view_as(v))
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        window = self.sliding_window
        if window is not None and max(meta.seq_lens) > window:
            out = self.attn.backend.attend_banded(q, k, v, meta, self.scale, window)
        else:
            out = self.attn.backend.attend_heads(q, k, v, meta, self.scale)
        return self.o_proj(out)


class GemmaEncoderLayer(nn.Module):
    def __init__(self, config: Any, layer_index: int) -> None:
        super().__init__()
        self.self_attn = GemmaEncoderAttention(config, layer_index)
        self.mlp = GeGLU(config)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        meta: EncoderStepMetadata,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos_sin, meta)
        x = self.post_attention_layernorm(h).add_(x)
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))).add_(x)


class Gemma3TextEncoderModel(AttentionModel, nn.Module):
    """EmbeddingGemma's body: packed token ids → final-norm hidden states [num_tokens, hidden]
    (an EncoderModel, models/interfaces.py). Checkpoint names are Gemma3TextModel's."""

    is_causal: ClassVar[bool] = False
    default_pooling_type = "MEAN"
    supports_first_token_only = False
    """MEAN pooling reads every token; CLS over a Gemma body is not a configuration in use."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GemmaEncoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        head_size = _head_size(config)
        self.rotary_emb = RotaryEmbedding(head_size, config)  # full layers
        self.rotary_emb_local = RotaryEmbedding(head_size, _local_rope_config(config))
        self.embed_scale = float(config.hidden_size) ** 0.5
        self.attention_backend: EncoderAttentionBackend = BUCKETED_SDPA
        """Chosen by the loader (attention/backend.py); bucketed SDPA when built by hand."""

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        """Sliding-window layers whose window a sequence may pass need BANDED attention."""
        max_positions = int(getattr(self.config, "max_position_embeddings", 0) or 0)
        windows = [layer.self_attn.sliding_window for layer in self.layers]
        banded = any(w is not None and not 0 < max_positions <= w for w in windows)
        needs = frozenset({BANDED}) if banded else frozenset()
        return AttentionSpec(device, dtype, _head_size(self.config), max_positions, needs=needs)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: EncoderStepMetadata,
        token_type_ids: torch.Tensor | None = None,
        first_token_only: bool = False,
    ) -> torch.Tensor:
        """→ [num_tokens, hidden] in packed order (token_type_ids: Gemma has none). The layers
        run on the rows the backend's builder chose (attention/common.py LayerRows)."""
        rows = attn_metadata.rows
        ids, pos = rows.gather(input_ids), rows.gather(positions)
        x = self.embed_tokens(ids)
        x = x.mul_(torch.tensor(self.embed_scale, dtype=x.dtype))  # scale in the model dtype
        cos_sin = self.rotary_emb.cos_sin(pos, x.dtype)
        cos_sin_local = self.rotary_emb_local.cos_sin(pos, x.dtype)
        for layer in self.layers:
            is_sliding = layer.self_attn.sliding_window is not None
            x = layer(x, cos_sin_local if is_sliding else cos_sin, attn_metadata)
        return rows.to_tokens(self.norm(x))

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint name → our parameter name (before q/k/v fusion); None = not ours."""
        name = name.removeprefix("model.")
        if name.startswith(("lm_head.", "score.")) or "rotary_emb." in name:
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_fused_weights(self, weights, self.map_weight_name, _STACKED, _shard_sizes)
