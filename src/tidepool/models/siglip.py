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

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from tidepool.attention.backend import (
    BUCKETED_SDPA,
    AttentionSpec,
    EncoderAttentionBackend,
    EncoderStepMetadata,
)
from tidepool.attention.layer import AttentionModel
from tidepool.models.clip import TowerEncoder, stack_pixels
from tidepool.models.siglip_vision import SIGLIP_QKV, SiglipVisionTower
from tidepool.models.weights import equal_thirds, load_fused_weights
from tidepool.multimodal.features import MultiModalFeature


class SiglipTextTower(nn.Module):
    """transformers' SiglipTextTransformer: names as its (embeddings., encoder., final_layer_norm.,
    head.), the layers' q / k / v fused into `qkv`."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.embeddings = nn.Module()
        self.embeddings.token_embedding = nn.Embedding(config.vocab_size, hidden)
        self.embeddings.position_embedding = nn.Embedding(config.max_position_embeddings, hidden)
        self.encoder = TowerEncoder(config, causal=False)
        self.final_layer_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        projection = getattr(config, "projection_size", None) or hidden
        self.head = nn.Linear(hidden, projection)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: EncoderStepMetadata
    ) -> torch.Tensor:
        """[num_tokens] → [num_tokens, hidden] after final_layer_norm."""
        rows = meta.rows  # the backend builder's rows: packed tokens or padded buckets
        emb = self.embeddings
        x = emb.token_embedding(rows.gather(input_ids)) + emb.position_embedding(
            rows.gather(positions)
        )
        return rows.to_tokens(self.final_layer_norm(self.encoder(x, meta)))

    def pool(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Each sequence's last row (a pad where the text is shorter than the fixed length:
        what transformers pools), through `head`: [num_seqs, projection_size]."""
        return self.head(hidden.index_select(0, cu_seqlens[1:] - 1))


def _head_dim(config: Any) -> int:
    return config.hidden_size // config.num_attention_heads


class _SiglipBase(AttentionModel, nn.Module):
    is_causal: ClassVar[bool] = False
    default_pooling_type = "LAST"
    supports_first_token_only = False
    supported_modalities: ClassVar[tuple[str, ...]] = ("image",)
    own_pooling_name = "LAST (padded)"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_fused_weights(self, weights, self.map_weight_name, SIGLIP_QKV, equal_thirds)

    def map_weight_name(self, name: str) -> str | None:
        if name.endswith("position_ids") or name.startswith(("logit_scale", "logit_bias")):
            return None
        return name

    def _pool_images(self, features: Sequence[MultiModalFeature]) -> torch.Tensor:
        vision: SiglipVisionTower = self.vision_model
        pixels = stack_pixels(features, vision.post_layernorm.weight.device)
        vision.check_pixels(pixels, type(self).__name__)
        return vision(pixels)


class SiglipModel(_SiglipBase):
    """Both towers (an EncoderModel on texts, EmbeddingPoolingHead and DualTowerModel)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        text, vision = config.text_config, config.vision_config
        if _head_dim(text) != _head_dim(vision):
            raise ValueError(
                f"SiglipModel: the text tower's attention heads ({_head_dim(text)} wide) differ "
                f"from the vision tower's ({_head_dim(vision)}); tidepool runs both towers on "
                "one attention backend, chosen for one head width"
            )
        if not getattr(vision, "vision_use_head", True):
            raise ValueError(
                "SiglipModel: vision_config.vision_use_head is false: without the pooling "
                "head the vision tower has no image embedding"
            )
        self.text_model = SiglipTextTower(text)
        self.vision_model = SiglipVisionTower(vision)
        width = self.text_model.head.out_features
        if width != vision.hidden_size:
            raise ValueError(
                f"SiglipModel: the text head's width {width} (text_config.projection_size) is "
                f"not the image embedding's {vision.hidden_size}: they share no space"
            )
        self.embedding_size = self.image_embedding_size = width
        self.attention_backend: EncoderAttentionBackend = BUCKETED_SDPA

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        """One backend for both bidirectional towers (equal head widths: __init__)."""
        text = self.config.text_config
        positions = max(self.vision_model.num_patches, text.max_position_embeddings)
        return AttentionSpec(device, dtype, _head_dim(text), positions)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: EncoderStepMetadata,
        token_type_ids: torch.Tensor | None = None,
        first_token_only: bool = False,
    ) -> torch.Tensor:
        """Texts (padded to the fixed length by the prompt processor): [num_tokens] →
        [num_tokens, text hidden] after final_layer_norm."""
        return self.text_model(input_ids, positions, attn_metadata)

    def pool_embeddings(
        self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        return self.text_model.pool(hidden, cu_seqlens)

    def pool_multimodal(self, features: Sequence[MultiModalFeature]) -> torch.Tensor:
        return self._pool_images(features)


class SiglipVisionModel(_SiglipBase):
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
        return AttentionSpec(device, dtype, _head_dim(self.config), self.vision_model.num_patches)

    def forward(
        self, input_ids, positions, attn_metadata, token_type_ids=None, first_token_only=False
    ):
        raise ValueError("SiglipVisionModel embeds images only")

    def pool_embeddings(self, hidden, cu_seqlens, input_ids):
        raise ValueError("SiglipVisionModel embeds images only")

    def pool_multimodal(self, features: Sequence[MultiModalFeature]) -> torch.Tensor:
        return self._pool_images(features)
