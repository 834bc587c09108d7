"""ColPali (`ColPaliForRetrieval`): PaliGemma's body, then one projected vector per token.

    images ─ vision_tower (SigLIP, last_hidden_state: no pooling head) ─ multi_modal_projector
           ─ rows at the <image> placeholders ─┐
    prompt ids ─ embed_tokens * sqrt(hidden) ──┴▶ Gemma, bidirectional over the whole prompt
           (models/paligemma.py) ─▶ hidden [T, hidden] ─▶ embedding_proj_layer ─▶ [T, dim]

The "colvision" output head (output_heads/colvision.py) normalizes each vector and serves
token_embed; score / rerank take MaxSim of query and page vectors.

It runs on the encoder path (is_causal False: no KV cache, each prompt whole in one step, as
EmbeddingGemma): transformers attends every token of a ColPali prompt to every other
(ColPaliProcessor's token_type_ids are all 0: one bidirectional block), which a causal paged
prefill does not reproduce; the encoder runner already splices image rows into a step's input
embeddings (worker/multimodal.py), so nothing new is needed there. Chunked prefill and prefix
caching do not apply to encoders.

Weights: transformers 5's names (vlm.vision_tower.*, vlm.multi_modal_projector.*,
vlm.language_model.*, embedding_proj_layer.*) and transformers 4's (vlm.language_model.model.*,
vlm.language_model.lm_head.*, vlm.vision_tower.vision_model.*). A checkpoint tensor this model
does not use is refused, named, except the LM head (tied to the embeddings; an embedder reads
hidden states) and a SigLIP pooling head (PaliGemma reads the patches).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from tidepool.attention.backend import (
    BUCKETED_SDPA,
    AttentionSpec,
    EncoderAttentionBackend,
    EncoderStepMetadata,
    select_encoder_backend,
    with_reduced_precision,
)
from tidepool.attention.layer import AttentionModel
from tidepool.models.layers.linear import Linear
from tidepool.models.llama import _STACKED, _shard_sizes
from tidepool.models.paligemma import PaliGemmaMultiModalProjector, PaliGemmaTextEncoder
from tidepool.models.siglip_vision import SiglipVisionTower
from tidepool.models.towers import TOWER_QKV
from tidepool.models.weights import FusedMarkers, equal_thirds, load_fused_weights
from tidepool.multimodal.features import MultiModalFeature

_IGNORED = (
    "language_model.lm_head.",
    "lm_head.",
    "vision_tower.head.",
    "vision_tower.vision_model.head.",
)
"""Checkpoint tensors read by nothing here: the LM head (tied to embed_tokens) and a SigLIP
pooling head (PaliGemma reads last_hidden_state; transformers builds the head where the vision
config leaves vision_use_head at SigLIP's default, and discards its output)."""


def num_image_tokens(vision_config: Any) -> int:
    """The <image> placeholders of one image: the vision tower's patches."""
    return (int(vision_config.image_size) // int(vision_config.patch_size)) ** 2


class ColPaliForRetrieval(AttentionModel, nn.Module):
    """An EncoderModel with images (MultiModalModel) and a per-token projection
    (TokenVectorHead)."""

    is_causal: ClassVar[bool] = False
    default_pooling_type = "LAST"
    """Unused: the colvision head serves token_embed only (as ColQwen2)."""
    supports_first_token_only = False
    supported_modalities: ClassVar[tuple[str, ...]] = ("image",)

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.retrieval_config = config
        vlm = config.vlm_config
        self.config = vlm
        vision = copy.deepcopy(vlm.vision_config)
        vision.vision_use_head = False  # never read (see _IGNORED)
        self.vision_tower = SiglipVisionTower(vision)
        self.multi_modal_projector = PaliGemmaMultiModalProjector(vlm)
        self.language_model = PaliGemmaTextEncoder(vlm.text_config)
        self.embedding_dim = int(config.embedding_dim)
        hidden = vlm.text_config.hidden_size
        self.embedding_proj_layer = Linear(hidden, self.embedding_dim)
        self.image_token_id = int(vlm.image_token_id)
        self.num_image_tokens = num_image_tokens(vlm.vision_config)
        self.attention_backend: EncoderAttentionBackend = BUCKETED_SDPA

    @property
    def vision_backend(self) -> EncoderAttentionBackend:
        """The vision tower's backend (chosen for its own head width)."""
        return self.vision_tower.attention_backend

    # ------------------------------------------------------------ the EncoderModel contract

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        """The text layers' (the vision tower takes its own backend, set_attention_backend)."""
        text = self.config.text_config
        max_positions = int(getattr(text, "max_position_embeddings", 0) or 0)
        return AttentionSpec(device, dtype, self.language_model.head_size, max_positions)

    def set_attention_backend(self, backend: EncoderAttentionBackend) -> None:
        """`backend` for the text layers; the vision tower's from the registry for its own head
        width (same device and dtype: SigLIP's 72-wide heads take bucketed SDPA on CPU)."""
        self.attention_backend = backend
        self.language_model.set_attention_backend(backend)
        weight = self.embedding_proj_layer.weight
        tower = self.vision_tower
        spec = AttentionSpec(weight.device, weight.dtype, tower.head_dim, tower.num_patches)
        if weight.dtype == torch.bfloat16:
            spec = with_reduced_precision(spec)
        tower.set_attention_backend(select_encoder_backend(spec, type(self).__name__))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: EncoderStepMetadata,
        token_type_ids: torch.Tensor | None = None,
        first_token_only: bool = False,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """→ [num_tokens, hidden] in packed order; `inputs_embeds`: the step's embeddings with
        its images' rows (worker/multimodal.py), else the ids are looked up."""
        if first_token_only:
            raise ValueError("ColPaliForRetrieval computes every token (token_embed)")
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        return self.language_model(inputs_embeds, positions, attn_metadata)

    def compute_token_vectors(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_tokens, hidden] → [num_tokens, embedding_dim] (not normalized)."""
        return self.embedding_proj_layer(hidden)

    # ------------------------------------------------------------ images

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed(input_ids)

    def embed_multimodal(self, features: Sequence[MultiModalFeature]) -> list[torch.Tensor]:
        """The step's images → each one's [num_image_tokens, hidden] placeholder rows: the
        vision tower over all of them packed, then the projector (not scaled)."""
        weight = self.embedding_proj_layer.weight
        pixels = torch.stack([f.data["pixel_values"] for f in features]).to(weight.device)
        hidden = self.vision_tower.encode(pixels)  # [n, patches, vision hidden]
        rows = self.multi_modal_projector(hidden.flatten(0, 1))
        return list(rows.split(self.num_image_tokens))

    # ------------------------------------------------------------ weights

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint name → ours (before q/k/v fusion); None: read by nothing (the LM head)."""
        name = name.removeprefix("vlm.").removeprefix("model.")
        if name.startswith(_IGNORED):
            return None
        if name.startswith("language_model.model."):  # transformers 4's layout
            return "language_model." + name.removeprefix("language_model.model.")
        if name.startswith("vision_tower.vision_model."):
            return "vision_tower." + name.removeprefix("vision_tower.vision_model.")
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        vision: list[tuple[str, torch.Tensor]] = []
        text: list[tuple[str, torch.Tensor]] = []
        rest: list[tuple[str, torch.Tensor]] = []
        unknown: list[str] = []
        params = dict(self.named_parameters())
        for ckpt_name, tensor in weights:
            name = self.map_weight_name(ckpt_name)
            if name is None:
                continue
            if name.startswith("vision_tower."):
                vision.append((name.removeprefix("vision_tower."), tensor))
                if _fused(name, TOWER_QKV) not in params:
                    unknown.append(ckpt_name)
            elif name.startswith("language_model."):
                text.append((name.removeprefix("language_model."), tensor))
                if _fused(name, _STACKED) not in params:
                    unknown.append(ckpt_name)
            elif name in params:
                rest.append((name, tensor))
            else:
                unknown.append(ckpt_name)
        if unknown:
            raise ValueError(
                f"ColPaliForRetrieval does not use {len(unknown)} checkpoint tensors: "
                f"{sorted(unknown)[:8]} (a layout or option tidepool does not implement)"
            )
        tower = load_fused_weights(self.vision_tower, vision, lambda n: n, TOWER_QKV, equal_thirds)
        loaded = {"vision_tower." + n for n in tower}
        lm = load_fused_weights(self.language_model, text, lambda n: n, _STACKED, _shard_sizes)
        loaded |= {"language_model." + n for n in lm}
        with torch.no_grad():
            for name, tensor in rest:
                if params[name].shape != tensor.shape:
                    raise ValueError(
                        f"{name}: shape {tuple(tensor.shape)} != {tuple(params[name].shape)}"
                    )
                params[name].copy_(tensor)
                loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint has no weights for {missing[:8]}")
        return loaded


def _fused(name: str, markers: FusedMarkers) -> str:
    """Our parameter name for a checkpoint q / k / v name (they share one fused linear)."""
    for marker, (fused, _) in markers.items():
        name = name.replace(marker, fused)
    return name
