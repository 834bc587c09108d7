"""SigLIP's vision tower (transformers' SiglipVisionTransformer), usable alone.

    pixels [n, C, H, W]
      → patches (the stride-p convolution as a GEMM over the flattened p x p blocks, its bias)
        + learned position embeddings (one per patch: no class token, no pre-layernorm)
      → pre-LN layers, bidirectional, the patches of every image packed (one attention
        sequence per image) through the model's encoder attention backend, as CLIP's tower
      → post_layernorm                                     `encode`: [n, patches, hidden]
      → the multi-head attention pooling head (vision_use_head): a learned probe attends
        over the patches, then LayerNorm + MLP with a residual      `pool`: [n, hidden]

`encode` is what PaliGemma / ColPali read (the patches after post_layernorm, no head); `pool`
is SiglipModel.get_image_features' pooler_output. Module names follow transformers'
(embeddings., encoder.layers., post_layernorm., head.), the layers' q / k / v fused into one
`qkv` (models/towers.py's TowerLayer: the same pre-LN layer as CLIP's).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tidepool.attention.backend import BUCKETED_SDPA, EncoderAttentionBackend
from tidepool.attention.layer import AttentionModel
from tidepool.models.towers import TowerEncoder, TowerMLP, patchify, vision_metadata


def check_siglip_vision_config(config: Any) -> None:
    """Refuse the vision options this tower does not implement, naming them."""
    if getattr(config, "image_size", 0) % config.patch_size:
        raise ValueError(
            f"SigLIP vision: image_size {config.image_size} is not a multiple of patch_size "
            f"{config.patch_size}"
        )
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"SigLIP vision: hidden_size {config.hidden_size} is not a multiple of "
            f"num_attention_heads {config.num_attention_heads}"
        )


class AttentionPoolingHead(nn.Module):
    """transformers' SiglipMultiheadAttentionPoolingHead: `probe` [1, 1, hidden] is the one
    query of an nn.MultiheadAttention (in_proj_weight / in_proj_bias: q, k, v rows; out_proj)
    over an image's patches; then hidden + MLP(LayerNorm(hidden)); the probe's row."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.probe = nn.Parameter(torch.empty(1, 1, hidden))
        self.attention = nn.Module()
        self.attention.in_proj_weight = nn.Parameter(torch.empty(3 * hidden, hidden))
        self.attention.in_proj_bias = nn.Parameter(torch.empty(3 * hidden))
        self.attention.out_proj = nn.Linear(hidden, hidden)
        self.layernorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.mlp = TowerMLP(hidden, config.intermediate_size, config.hidden_act)

    def forward(self, patches: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[n, patches, hidden] → [n, hidden]; `key_mask` [n, patches] bool: False rows are not
        attended (SigLIP 2's padded patches; None: all are)."""
        n, length, hidden = patches.shape
        w_q, w_kv = self.attention.in_proj_weight.split([hidden, 2 * hidden])
        b_q, b_kv = self.attention.in_proj_bias.split([hidden, 2 * hidden])
        q = F.linear(self.probe.reshape(1, hidden), w_q, b_q).view(self.num_heads, self.head_dim)
        k, v = F.linear(patches, w_kv, b_kv).view(n, length, 2, self.num_heads, -1).unbind(2)
        # One query per image: scores [n, heads, patches], softmax over the patches.
        scores = torch.einsum("hd,nphd->nhp", q, k) * self.head_dim**-0.5
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[:, None, :], float("-inf"))
        context = torch.einsum("nhp,nphd->nhd", scores.softmax(dim=-1), v).reshape(n, hidden)
        x = self.attention.out_proj(context)
        return self.mlp(self.layernorm(x), x)


class SiglipVisionTower(AttentionModel, nn.Module):
    """The tower; its parameters are named as transformers' SiglipVisionTransformer's. It holds
    its backend (`attention_backend`, the one its layers attend with): a model that contains
    it hands both over with its own set_attention_backend (attention/layer.py reaches the
    tower's attribute and layers); alone, call the tower's."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        check_siglip_vision_config(config)
        self.config = config
        hidden, patch = config.hidden_size, config.patch_size
        self.num_patches = (config.image_size // patch) ** 2
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Module()
        self.embeddings.patch_embedding.weight = nn.Parameter(
            torch.empty(hidden, config.num_channels, patch, patch)
        )
        self.embeddings.patch_embedding.bias = nn.Parameter(torch.empty(hidden))
        self.embeddings.position_embedding = nn.Embedding(self.num_patches, hidden)
        self.encoder = TowerEncoder(config, causal=False)
        self.post_layernorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.use_head = bool(getattr(config, "vision_use_head", True))
        self.head = AttentionPoolingHead(config) if self.use_head else None
        self.attention_backend: EncoderAttentionBackend = BUCKETED_SDPA

    @property
    def head_dim(self) -> int:
        """The attention heads' width (an AttentionSpec's head size, with num_patches)."""
        return self.config.hidden_size // self.config.num_attention_heads

    def check_pixels(self, pixels: torch.Tensor, name: str) -> None:
        size = self.config.image_size
        if pixels.shape[-2:] != (size, size):
            raise ValueError(
                f"{name}'s vision tower takes {size}x{size} images, the processor gave "
                f"{tuple(pixels.shape[-2:])} (its preprocessor_config.json disagrees with the "
                "model; position-embedding interpolation is not implemented)"
            )

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[n, C, H, W] → the patches' hidden states after post_layernorm, [n, patches, hidden]
        (transformers' last_hidden_state), all images in one packed pass."""
        self.check_pixels(pixels, "SigLIP")
        n = pixels.shape[0]
        emb = self.embeddings
        conv = emb.patch_embedding
        x = F.linear(
            patchify(pixels.to(conv.weight.dtype), self.config.patch_size),
            conv.weight.flatten(1),
            conv.bias,
        ).view(n, self.num_patches, -1)
        x = (x + emb.position_embedding.weight).flatten(0, 1)
        backend = self.attention_backend
        meta = vision_metadata(backend, n, self.num_patches, x, self.config.num_attention_heads)
        rows = meta.rows
        x = rows.to_tokens(self.post_layernorm(self.encoder(rows.gather(x), meta)))
        return x.view(n, self.num_patches, -1)

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """`encode`'s [n, patches, hidden] → the pooling head's [n, hidden] (pooler_output)."""
        if self.head is None:
            raise ValueError(
                "this SigLIP vision config has vision_use_head false: it has no pooling head, "
                "so no pooled image embedding"
            )
        return self.head(hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[n, C, H, W] → pooled [n, hidden]."""
        return self.pool(self.encode(pixels))
