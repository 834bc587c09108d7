"""SigLIP (SiglipModel, SiglipVisionModel): a text and a vision tower into one space.

    text   token + position embeddings → pre-LN layers, bidirectional → final_layer_norm →
           the LAST position's row → head (a Linear with bias)           (EncoderModel)
    image  the vision tower (models/siglip_vision.py) → its attention pooling head
                                                        (DualTowerModel.pool_multimodal)

SigLIP's text is trained padded to a fixed length (padding="max_length", 64 for most
checkpoints) and pools the last *padded* position: the prompt processor pads every text to that
length before it runs (multimodal/dual_tower.py), so the last row of each sequence is the row
transformers pools. Whether the pads are keys follows the tokenizer (its attention_mask: the
request's num_attended_tokens); the pads are always queries. Both towers are bidirectional and
run packed through the model's encoder attention backend. The embeddings are not projected
further; logit_scale / logit_bias (the contrastive loss's) are not part of them and are skipped.
transformers' SiglipModel.get_text_features / get_image_features (pooler_output) are the
reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tidepool.attention.backend import BUCKETED_SDPA, AttentionSpec, EncoderAttentionBackend
from tidepool.models.siglip_vision import SiglipVisionTower
from tidepool.models.towers import (
    DualTowerBase,
    ImagesOnly,
    TextTower,
    check_one_space,
    head_dim,
    stack_pixels,
)
from tidepool.multimodal.features import MultiModalFeature


class SiglipTextTower(TextTower):
    """transformers' SiglipTextTransformer: names as its (embeddings., encoder., final_layer_norm.,
    head.), the layers' q / k / v fused into `qkv`; bidirectional."""

    def __init__(self, config: Any) -> None:
        super().__init__(config, causal=False)
        projection = getattr(config, "projection_size", None) or config.hidden_size
        self.head = nn.Linear(config.hidden_size, projection)

    def pool(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Each sequence's last row (a pad where the text is shorter than the fixed length:
        what transformers pools), through `head`: [num_seqs, projection_size]."""
        return self.head(hidden.index_select(0, cu_seqlens[1:] - 1))


class SiglipBase(DualTowerBase):
    """What SigLIP's models share beyond DualTowerBase: the text side's pooling (the last
    padded row through the text head) and the image side (`vision_model` takes the pixels)."""

    own_pooling_name = "LAST (padded)"

    def pool_embeddings(
        self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        return self.text_model.pool(hidden, cu_seqlens)

    def _pool_images(self, features: Sequence[MultiModalFeature]) -> torch.Tensor:
        vision: SiglipVisionTower = self.vision_model
        pixels = stack_pixels(features, vision.post_layernorm.weight.device)
        vision.check_pixels(pixels, type(self).__name__)
        return vision(pixels)


class SiglipModel(SiglipBase):
    """Both towers (an EncoderModel on texts, EmbeddingPoolingHead and DualTowerModel)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        text, vision = config.text_config, config.vision_config
        if not getattr(vision, "vision_use_head", True):
            raise ValueError(
                "SiglipModel: vision_config.vision_use_head is false: without the pooling "
                "head the vision tower has no image embedding"
            )
        self.text_model = SiglipTextTower(text)
        self.vision_model = SiglipVisionTower(vision)
        width = self.text_model.head.out_features
        check_one_space("SiglipModel", text, vision, width, vision.hidden_size)
        self.embedding_size = self.image_embedding_size = width
        self.attention_backend: EncoderAttentionBackend = BUCKETED_SDPA

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        """One backend for both bidirectional towers (equal head widths: __init__)."""
        text = self.config.text_config
        positions = max(self.vision_model.num_patches, text.max_position_embeddings)
        return AttentionSpec(device, dtype, head_dim(text), positions)

    def pool_multimodal(self, features: Sequence[MultiModalFeature]) -> torch.Tensor:
        return self._pool_images(features)


class SiglipVisionModel(ImagesOnly, SiglipBase):
    """The vision tower alone (its pooler_output): images only, texts refused at input."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        if not getattr(config, "vision_use_head", True):
            raise ValueError(
                "SiglipVisionModel: vision_use_head is false: without the pooling head the "
                "tower has no image embedding (its patches are a VLM's input, not an embedding)"
            )
        self.vision_model = SiglipVisionTower(config)
        self.embedding_size = self.image_embedding_size = config.hidden_size
        self.attention_backend: EncoderAttentionBackend = BUCKETED_SDPA

    def map_weight_name(self, name: str) -> str | None:
        """transformers 5 saves SiglipVisionModel's tensors without the vision_model. prefix,
        older checkpoints with it: both load."""
        mapped = super().map_weight_name(name)
        if mapped is None or mapped.startswith("vision_model."):
            return mapped
        return f"vision_model.{mapped}"

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        return AttentionSpec(device, dtype, head_dim(self.config), self.vision_model.num_patches)

    def pool_multimodal(self, features: Sequence[MultiModalFeature]) -> torch.Tensor:
        return self._pool_images(features)
