"""CLIP (CLIPModel, CLIPVisionModelWithProjection): a text and a vision tower into one space.

    text   token + position embeddings → pre-LN layers, causal (each token sees its past) →
           final_layer_norm → the EOS token's row → text_projection          (EncoderModel)
    image  patches (a GEMM over the flattened 8x8.. blocks: the stride-p convolution) + the
           class token + position embeddings → pre_layrnorm → pre-LN layers, bidirectional →
           the class row → post_layernorm → visual_projection      (DualTowerModel.pool_multimodal)

The vision tower runs packed: the patches of every image of a step in one flat batch, one
sequence per image, through the model's attention backend (the CPU kernel where the head size
fits: attention/backend.py); the text tower's causal layers run bucketed SDPA with a causal mask
(attention/torch_backend.py). Module names follow transformers' (text_model., vision_model.),
q / k / v fused into one `qkv`. transformers' CLIPModel.get_text_features / get_image_features
are the reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tidepool.attention.backend import BANDED, BUCKETED_SDPA, AttentionSpec, EncoderAttentionBackend
from tidepool.models.towers import (
    DualTowerBase,
    ImagesOnly,
    TextTower,
    TowerEncoder,
    head_dim,
    patchify,
    stack_pixels,
    vision_metadata,
)
from tidepool.multimodal.features import MultiModalFeature


def check_image_size(pixels: torch.Tensor, image_size: int, name: str) -> None:
    if pixels.shape[-2:] != (image_size, image_size):
        raise ValueError(
            f"{name}'s vision tower takes {image_size}x{image_size} images, the processor gave "
            f"{tuple(pixels.shape[-2:])} (its preprocessor_config.json disagrees with the model)"
        )


class ClipTextTower(TextTower):
    def __init__(self, config: Any) -> None:
        super().__init__(config, causal=True)

    def eos_rows(self, cu_seqlens: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Each sequence's pooled row (transformers' CLIPTextTransformer): the first position of
        eos_token_id, or with the legacy eos_token_id 2 the first position of the largest id;
        a sequence without its EOS pools its first token (argmax of all False)."""
        eos = self.config.eos_token_id
        rows = []
        bounds = cu_seqlens.tolist()
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            ids = input_ids[start:end]
            hit = ids.argmax() if eos == 2 else (ids == eos).to(torch.int32).argmax()
            rows.append(start + int(hit))
        return torch.tensor(rows, dtype=torch.int64, device=input_ids.device)


class ClipVisionTower(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        hidden, patch = config.hidden_size, config.patch_size
        self.num_patches = (config.image_size // patch) ** 2
        self.embeddings = nn.Module()
        self.embeddings.class_embedding = nn.Parameter(torch.empty(hidden))
        self.embeddings.patch_embedding = nn.Module()
        self.embeddings.patch_embedding.weight = nn.Parameter(
            torch.empty(hidden, config.num_channels, patch, patch)
        )
        self.embeddings.position_embedding = nn.Embedding(self.num_patches + 1, hidden)
        self.pre_layrnorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.encoder = TowerEncoder(config, causal=False)
        self.post_layernorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor, backend: EncoderAttentionBackend) -> torch.Tensor:
        """[n, C, H, W] → the class tokens' rows after post_layernorm, [n, hidden]."""
        n = pixels.shape[0]
        emb = self.embeddings
        weight = emb.patch_embedding.weight
        patches = torch.nn.functional.linear(
            patchify(pixels.to(weight.dtype), self.config.patch_size), weight.flatten(1)
        ).view(n, self.num_patches, -1)
        x = torch.cat([emb.class_embedding.expand(n, 1, -1), patches], dim=1)
        x = (x + emb.position_embedding.weight).flatten(0, 1)
        seq = self.num_patches + 1
        meta = vision_metadata(backend, n, seq, x, self.config.num_attention_heads)
        rows = meta.rows
        x = self.encoder(self.pre_layrnorm(rows.gather(x)), meta, keep=rows.first_rows)
        return self.post_layernorm(x)


class CLIPModel(DualTowerBase):
    """Both towers (an EncoderModel on texts, EmbeddingPoolingHead and DualTowerModel)."""

    own_pooling_name = "EOS"

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        text, vision = config.text_config, config.vision_config
        self.text_model = ClipTextTower(text)
        self.vision_model = ClipVisionTower(vision)
        self.text_projection = nn.Linear(text.hidden_size, config.projection_dim, bias=False)
        self.visual_projection = nn.Linear(vision.hidden_size, config.projection_dim, bias=False)
        self.embedding_size = self.image_embedding_size = config.projection_dim
        self.attention_backend: EncoderAttentionBackend = BUCKETED_SDPA

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        """The vision tower's (the packed, heavy side); the text tower's causal layers need
        BANDED (attend_banded: bucketed SDPA with a causal mask, whatever the backend)."""
        return AttentionSpec(
            device,
            dtype,
            head_dim(self.config.vision_config),
            self.vision_model.num_patches + 1,
            needs=frozenset({BANDED}),
        )

    def pool_embeddings(
        self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        rows = self.text_model.eos_rows(cu_seqlens, input_ids)
        return self.text_projection(hidden.index_select(0, rows))

    def pool_multimodal(self, features: Sequence[MultiModalFeature]) -> torch.Tensor:
        pixels = stack_pixels(features, self.visual_projection.weight.device)
        check_image_size(pixels, self.config.vision_config.image_size, type(self).__name__)
        return self.visual_projection(self.vision_model(pixels, self.attention_backend))


class CLIPVisionModelWithProjection(ImagesOnly, DualTowerBase):
    """The vision tower alone (image_embeds): images only, texts refused at input."""

    own_pooling_name = "EOS"

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.vision_model = ClipVisionTower(config)
        self.visual_projection = nn.Linear(config.hidden_size, config.projection_dim, bias=False)
        self.embedding_size = self.image_embedding_size = config.projection_dim
        self.attention_backend: EncoderAttentionBackend = BUCKETED_SDPA

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        return AttentionSpec(
            device, dtype, head_dim(self.config), self.vision_model.num_patches + 1
        )

    def pool_multimodal(self, features: Sequence[MultiModalFeature]) -> torch.Tensor:
        pixels = stack_pixels(features, self.visual_projection.weight.device)
        check_image_size(pixels, self.config.image_size, type(self).__name__)
        return self.visual_projection(self.vision_model(pixels, self.attention_backend))
