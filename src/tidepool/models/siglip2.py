"""SigLIP 2 (Siglip2Model): SigLIP's text tower beside a NaFlex vision tower.

    text   as SiglipModel's (models/siglip.py SiglipTextTower: the last padded row → head)
    image  the processor's patches of one image at its own aspect ratio (spatial_shapes h x w,
           at most max_num_patches; transformers pads them to max_num_patches and masks the
           pads with pixel_attention_mask) → patch_embedding (a Linear over the flattened
           p x p x C patch) + the learned num_patches position grid resized to h x w
           (bilinear, antialiased) → pre-LN layers → post_layernorm → the attention pooling
           head over the image's patches

Each image is its own attention sequence of its h * w real patches, packed: the pads that
transformers masks as keys are never rows here (a masked pad changes no real row), and the
pooling head attends to the real patches alone, as its key_padding_mask does.
transformers' Siglip2Model.get_image_features / get_text_features are the reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tidepool.attention.backend import (
    BUCKETED_SDPA,
    AttentionSpec,
    EncoderAttentionBackend,
    EncoderStepMetadata,
)
from tidepool.attention.common import encoder_step
from tidepool.attention.layer import AttentionModel
from tidepool.models.siglip import SiglipBase, SiglipTextTower
from tidepool.models.siglip_vision import AttentionPoolingHead
from tidepool.models.towers import TowerEncoder, check_one_space, head_dim
from tidepool.multimodal.features import MultiModalFeature


class NaFlexVisionTower(AttentionModel, nn.Module):
    """transformers' Siglip2VisionTransformer (names as its: embeddings., encoder., ...)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        hidden, patch = config.hidden_size, config.patch_size
        self.grid = math.isqrt(config.num_patches)
        if self.grid * self.grid != config.num_patches:
            raise ValueError(
                f"Siglip2 vision: num_patches {config.num_patches} is not a square grid"
            )
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Linear(config.num_channels * patch * patch, hidden)
        self.embeddings.position_embedding = nn.Embedding(config.num_patches, hidden)
        self.encoder = TowerEncoder(config, causal=False)
        self.post_layernorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        if not getattr(config, "vision_use_head", True):
            raise ValueError(
                "Siglip2 vision: vision_use_head is false: without the pooling head there is "
                "no image embedding"
            )
        self.head = AttentionPoolingHead(config)
        self.attention_backend: EncoderAttentionBackend = BUCKETED_SDPA

    def positions(self, height: int, width: int) -> torch.Tensor:
        """The position grid resized to height x width patches: [height * width, hidden],
        row-major (computed in float32, as transformers does)."""
        table = self.embeddings.position_embedding.weight
        grid = table.float().view(self.grid, self.grid, -1).permute(2, 0, 1)[None]
        resized = F.interpolate(
            grid, size=(height, width), mode="bilinear", align_corners=False, antialias=True
        )
        return resized[0].permute(1, 2, 0).reshape(height * width, -1).to(table.dtype)

    def encode(self, patches: torch.Tensor, shapes: Sequence[tuple[int, int]]) -> torch.Tensor:
        """patches [sum h * w, C * p * p] of the images in order, each image's (h, w) →
        their hidden states after post_layernorm, [sum h * w, hidden], packed."""
        emb = self.embeddings
        x = emb.patch_embedding(patches.to(emb.patch_embedding.weight.dtype))
        x = x + torch.cat([self.positions(h, w) for h, w in shapes])
        lens = [h * w for h, w in shapes]
        meta: EncoderStepMetadata = self.attention_backend.metadata_builder().build(
            encoder_step(lens, x.device, x.dtype, self.config.num_attention_heads)
        )
        rows = meta.rows
        return rows.to_tokens(self.post_layernorm(self.encoder(rows.gather(x), meta)))

    def pool(self, hidden: torch.Tensor, lens: Sequence[int]) -> torch.Tensor:
        """`encode`'s packed rows → the pooling head's [num_images, hidden]: the images padded
        to the longest, the pads masked as keys."""
        longest = max(lens)
        padded = hidden.new_zeros(len(lens), longest, hidden.shape[-1])
        mask = torch.zeros(len(lens), longest, dtype=torch.bool, device=hidden.device)
        for i, rows in enumerate(hidden.split(list(lens))):
            padded[i, : len(rows)] = rows
            mask[i, : len(rows)] = True
        return self.head(padded, mask)


def _shape(feature: MultiModalFeature) -> tuple[int, int]:
    h, w = (int(v) for v in feature.data["spatial_shapes"])
    return h, w


class Siglip2Model(SiglipBase):
    """Both towers (an EncoderModel on texts, EmbeddingPoolingHead and DualTowerModel)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        text, vision = config.text_config, config.vision_config
        self.text_model = SiglipTextTower(text)
        self.vision_model = NaFlexVisionTower(vision)
        width = self.text_model.head.out_features
        check_one_space("Siglip2Model", text, vision, width, vision.hidden_size)
        self.embedding_size = self.image_embedding_size = width
        self.attention_backend: EncoderAttentionBackend = BUCKETED_SDPA

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        """The processor's max_num_patches is not in the config: the position grid's size
        stands for an image's length (the backends take any length)."""
        text = self.config.text_config
        positions = max(self.config.vision_config.num_patches, text.max_position_embeddings)
        return AttentionSpec(device, dtype, head_dim(text), positions)

    def pool_multimodal(self, features: Sequence[MultiModalFeature]) -> torch.Tensor:
        vision = self.vision_model
        device = vision.post_layernorm.weight.device
        shapes = [_shape(f) for f in features]
        patches = torch.cat([f.data["pixel_values"] for f in features]).to(device)
        hidden = vision.encode(patches, shapes)
        return vision.pool(hidden, [h * w for h, w in shapes])
