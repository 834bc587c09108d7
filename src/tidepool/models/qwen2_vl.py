"""Qwen2-VL on the decoder path: the vision tower's image embeddings at the placeholder tokens,
then Qwen2 with M-RoPE over the paged KV cache.

    prompt ids ─ embed_tokens ─┐
    images ─ visual (qwen2_vl_vision.py) ─ rows at the placeholder tokens ─▶ inputs_embeds
    positions [3, T] (mrope.py: per request, from its images' grids) ─▶ Qwen2 layers ─▶ hidden

`Qwen2VLModel` / `Qwen2VLForConditionalGeneration` folders embed (LAST pooling over mixed image
and text tokens: GME / Qwen2-VL embedding models; the LM head is not loaded). ColQwen2
(colqwen2.py) is the same body with a per-token projection.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from tidepool.attention.backend import AttentionSpec, DecoderAttentionBackend
from tidepool.attention.layer import AttentionModel
from tidepool.attention.paged_metadata import PagedAttentionMetadata
from tidepool.kv_cache.spec import KVCacheSpec
from tidepool.models.llama import DecoderAttention, Qwen2Model
from tidepool.models.mrope import ImagePlacement, MRopePositions, MRotaryEmbedding, mrope_positions
from tidepool.models.qwen2_vl_vision import Grid, Qwen2VisionTransformer, vision_weights
from tidepool.models.weights import load_fused_weights
from tidepool.multimodal.features import MultiModalFeature

_QKV = {".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2)}
_TEXT_PARTS = ("layers.", "embed_tokens.", "norm.")
"""Names of a text body saved at the top of the checkpoint (transformers 4's Qwen2-VL layout:
model.layers.*, visual.*; transformers 5 saves model.language_model.*, model.visual.*)."""


def _qkv_rows(module: nn.Module, fused_name: str) -> list[int]:
    owner = module.get_submodule(fused_name.rsplit(".", 2)[0])
    assert isinstance(owner, DecoderAttention)
    return [owner.q_size, owner.kv_size, owner.kv_size]


class Qwen2VLTextModel(Qwen2Model):
    """Qwen2 whose rotary takes three position rows (M-RoPE, mrope.py)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        head_size = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.rotary_emb = MRotaryEmbedding(int(head_size), config)  # type: ignore[assignment]


class Qwen2VLModel(AttentionModel, nn.Module):
    """A DecoderModel with images (the multimodal members below): LAST pooling by default."""

    is_causal: ClassVar[bool] = True
    default_pooling_type: ClassVar[str] = "LAST"
    supported_modalities: ClassVar[tuple[str, ...]] = ("image",)
    uses_mrope: ClassVar[bool] = True
    """Positions are mrope_positions' three rows (the runner asks once per request)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.visual = Qwen2VisionTransformer(config.vision_config)
        self.language_model = Qwen2VLTextModel(config.text_config)
        self.image_token_id = int(config.image_token_id)
        self.merge = int(config.vision_config.spatial_merge_size)

    # ------------------------------------------------------------ the DecoderModel contract

    @property
    def attention_backend(self) -> DecoderAttentionBackend:
        return self.language_model.attention_backend

    def set_attention_backend(self, backend: DecoderAttentionBackend) -> None:
        """The decoder backend for the text layers; the vision tower takes its own encoder
        backend from the registry (same device and dtype)."""
        self.language_model.set_attention_backend(backend)
        weight = self.visual.patch_embed.proj.weight
        self.visual.select_encoder_backend(weight.device, weight.dtype)

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        return self.language_model.attention_spec(device, dtype)

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> dict[str, KVCacheSpec | None]:
        return self.language_model.kv_cache_specs(block_size, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: PagedAttentionMetadata,
        kv_caches: list[torch.Tensor],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """positions [3, num_tokens] (or [num_tokens] for text-only rows: plain RoPE)."""
        return self.language_model(input_ids, positions, attn_metadata, kv_caches, inputs_embeds)

    # ------------------------------------------------------------ images

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] → [num_tokens, hidden] token embeddings (placeholders included)."""
        return self.language_model.embed_tokens(input_ids)

    def embed_multimodal(self, features: Sequence[MultiModalFeature]) -> list[torch.Tensor]:
        """The step's images (of any requests) → each one's placeholder rows, the vision tower
        run once over all their patches (one sequence per image)."""
        grids: list[Grid] = []
        for feature in features:
            t, h, w = (int(v) for v in feature.data["image_grid_thw"].reshape(-1).tolist())
            grids.append((t, h, w))
        device = self.visual.patch_embed.proj.weight.device
        pixels = torch.cat([f.data["pixel_values"] for f in features]).to(device)
        return self.embed_images(pixels, grids)

    def embed_images(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> list[torch.Tensor]:
        """The patch rows of several images (in order) → each image's placeholder rows
        [num_image_tokens(grid), hidden], in one packed pass of the vision tower."""
        rows = self.visual(pixel_values, grids)
        return list(rows.split([self.visual.num_tokens(g) for g in grids]))

    def num_image_tokens(self, grid: Grid) -> int:
        return self.visual.num_tokens(grid)

    def mrope_positions(
        self, num_tokens: int, images: Sequence[ImagePlacement]
    ) -> MRopePositions | None:
        """A prompt's three position rows (None: this model rotates plain positions)."""
        if not self.uses_mrope:
            return None
        return mrope_positions(num_tokens, images, self.merge)

    # ------------------------------------------------------------ weights

    def map_weight_name(self, name: str) -> str | None:
        name = name.removeprefix("model.")
        if name.startswith(("visual.", "language_model.")):
            return name
        if name.startswith(_TEXT_PARTS):
            return "language_model." + name
        return None  # lm_head (an embedder reads hidden states), rotary buffers

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_fused_weights(
            self, vision_weights(self.visual, weights), self.map_weight_name, _QKV, _qkv_rows
        )


class Qwen2VLForConditionalGeneration(Qwen2VLModel):
    """The generation checkpoint's layout, run as an embedder (GME): the body's hidden states;
    its lm_head is not loaded."""
