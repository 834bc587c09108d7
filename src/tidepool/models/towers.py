"""The pieces of CLIP / SigLIP-style two-tower models (models/clip.py, siglip.py, siglip2.py,
siglip_vision.py; ColPali reads SigLIP's vision tower).

    TowerLayer        a pre-LN transformer layer (CLIPEncoderLayer / SiglipEncoderLayer): q / k / v
                      fused into one `qkv`, the MLP's activation inside fc1's GEMM
    TowerEncoder      the layers; `keep` runs the last one's output side on the rows read after it
    TextTower         token + position embeddings → layers (causal for CLIP, bidirectional for
                      SigLIP) → final_layer_norm, packed or bucketed as the backend's rows say
    DualTowerBase     what the models share: the dual-tower members, weight loading (q / k / v
                      fused, the contrastive loss's logit_scale / logit_bias skipped), texts
                      through `text_model`; `ImagesOnly` for the vision-tower-alone classes

Module names follow transformers' (text_model., vision_model., encoder.layers., self_attn.).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from tidepool.attention.backend import (
    BUCKETED_SDPA,
    EncoderAttentionBackend,
    EncoderStepMetadata,
)
from tidepool.attention.common import encoder_step
from tidepool.attention.layer import Attention, AttentionModel
from tidepool.models.layers.linear import Linear
from tidepool.models.weights import equal_thirds, load_fused_weights, qkv_markers
from tidepool.multimodal.features import MultiModalFeature

TOWER_QKV = qkv_markers(".self_attn.", "q_proj", "k_proj", "v_proj")
"""The layers' q / k / v checkpoint names → their shard of the fused `qkv` (load_fused_weights
with equal_thirds)."""


class TowerAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, causal: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        self.scale = self.head_dim**-0.5
        self.causal = causal
        self.qkv = Linear(hidden, 3 * hidden)
        self.out_proj = Linear(hidden, hidden)
        self.attn = Attention(BUCKETED_SDPA)

    def forward(
        self,
        x: torch.Tensor,
        meta: EncoderStepMetadata,
        residual: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`keep`: the rows whose outputs are read (the class rows of the last layer); the
        others are keys and values only, their projection is skipped."""
        qkv = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim)
        backend = self.attn.backend
        if self.causal:  # the text tower: a causal band (BANDED, which CLIPModel's spec needs)
            q, k, v = qkv.unbind(1)
            context = backend.attend_banded(q, k, v, meta, self.scale, None, causal=True)
        else:
            context = backend.attend(qkv, meta, self.scale)
        if keep is not None:
            context, residual = context.index_select(0, keep), residual.index_select(0, keep)
        return self.out_proj(context, residual=residual)


QUICK_GELU_ALPHA = 1.702
"""transformers' QuickGELUActivation: x * sigmoid(1.702 x)."""


class TowerMLP(nn.Module):
    """fc2(act(fc1(x))) + residual, the activation inside fc1's GEMM (a oneDNN post-op)."""

    def __init__(self, hidden: int, intermediate: int, activation: str) -> None:
        super().__init__()
        self.fc1 = Linear(hidden, intermediate, activation=activation)
        self.fc2 = Linear(intermediate, hidden)
        self._folded = False

    def process_weights_after_loading(self) -> None:
        """quick_gelu, which is no oneDNN post-op, as its swish: quick_gelu(y) = swish(a y) / a
        with a = 1.702, so fc1's weight and bias take the a and fc2's weight the 1 / a (exact
        but for one rounding of each weight). Runs once, before the linears pack
        (`model.modules()` visits a module before its children); elsewhere (no oneDNN path)
        fc1 applies quick_gelu after its GEMM."""
        fc1, fc2 = self.fc1, self.fc2
        if self._folded or fc1.activation != "quick_gelu" or not fc1.fuses("swish"):
            return
        a = QUICK_GELU_ALPHA
        with torch.no_grad():
            fc1.weight.copy_(fc1.weight.float() * a)
            if fc1.bias is not None:
                fc1.bias.copy_(fc1.bias.float() * a)
            fc2.weight.copy_(fc2.weight.float() / a)
        fc1.set_activation("swish")
        self._folded = True

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x), residual=residual)


class TowerLayer(nn.Module):
    """A pre-LN transformer layer (CLIP's and SigLIP's CLIPEncoderLayer / SiglipEncoderLayer)."""

    def __init__(self, config: Any, causal: bool) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = TowerAttention(hidden, config.num_attention_heads, causal)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = TowerMLP(hidden, config.intermediate_size, config.hidden_act)

    def forward(
        self, x: torch.Tensor, meta: EncoderStepMetadata, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.self_attn.forward(self.layer_norm1(x), meta, x, keep)
        return self.mlp.forward(self.layer_norm2(x), x)


class TowerEncoder(nn.Module):
    def __init__(self, config: Any, causal: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            TowerLayer(config, causal) for _ in range(config.num_hidden_layers)
        )

    def forward(
        self, x: torch.Tensor, meta: EncoderStepMetadata, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`keep`: only these rows are read after the last layer (CLIP's class rows): its
        output projection and MLP run on them alone, and only they are returned."""
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, meta, keep if i == last else None)
        return x if keep is None or self.layers else x.index_select(0, keep)


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[n, C, H, W] → [n * (H / p) * (W / p), C * p * p]: the stride-p convolution's inputs,
    patches row-major (as Conv2d's output flattened), channels then rows then columns."""
    n, c, h, w = pixels.shape
    grid = pixels.reshape(n, c, h // patch, patch, w // patch, patch)
    return grid.permute(0, 2, 4, 1, 3, 5).reshape(-1, c * patch * patch)


def vision_metadata(
    backend: EncoderAttentionBackend, n: int, seq: int, x: torch.Tensor, num_heads: int
) -> EncoderStepMetadata:
    """The attention metadata of `n` images of `seq` positions each, packed."""
    return backend.metadata_builder().build(encoder_step([seq] * n, x.device, x.dtype, num_heads))


def stack_pixels(features: Sequence[MultiModalFeature], device: torch.device) -> torch.Tensor:
    return torch.stack([f.data["pixel_values"] for f in features]).to(device)


class TextTower(nn.Module):
    """Token + position embeddings → the layers → final_layer_norm (CLIPTextTransformer's and
    SiglipTextTransformer's body: embeddings., encoder., final_layer_norm.)."""

    def __init__(self, config: Any, causal: bool) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.embeddings = nn.Module()
        self.embeddings.token_embedding = nn.Embedding(config.vocab_size, hidden)
        self.embeddings.position_embedding = nn.Embedding(config.max_position_embeddings, hidden)
        self.encoder = TowerEncoder(config, causal=causal)
        self.final_layer_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

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


def head_dim(config: Any) -> int:
    return config.hidden_size // config.num_attention_heads


def check_one_space(name: str, text: Any, vision: Any, text_width: int, image_width: int) -> None:
    """Both towers run on one attention backend (one head width) and embed into one space."""
    if head_dim(text) != head_dim(vision):
        raise ValueError(
            f"{name}: the text tower's attention heads ({head_dim(text)} wide) differ from the "
            f"vision tower's ({head_dim(vision)}); tidepool runs both towers on one attention "
            "backend, chosen for one head width"
        )
    if text_width != image_width:
        raise ValueError(
            f"{name}: the text embedding's width {text_width} is not the image embedding's "
            f"{image_width}: they share no space"
        )


class DualTowerBase(AttentionModel, nn.Module):
    """An EncoderModel on texts (`text_model`), an EmbeddingPoolingHead and a DualTowerModel
    (`pool_multimodal`): the members, weight loading and the text side they share."""

    is_causal: ClassVar[bool] = False
    default_pooling_type = "LAST"
    supports_first_token_only = False
    supported_modalities: ClassVar[tuple[str, ...]] = ("image",)
    own_pooling_name: ClassVar[str]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_fused_weights(self, weights, self.map_weight_name, TOWER_QKV, equal_thirds)

    def map_weight_name(self, name: str) -> str | None:
        if name.endswith("position_ids") or name.startswith(("logit_scale", "logit_bias")):
            return None
        return name

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: EncoderStepMetadata,
        token_type_ids: torch.Tensor | None = None,
        first_token_only: bool = False,
    ) -> torch.Tensor:
        """Texts: [num_tokens] → [num_tokens, text hidden] after final_layer_norm."""
        return self.text_model(input_ids, positions, attn_metadata)


class ImagesOnly:
    """A vision tower alone (CLIPVisionModelWithProjection, SiglipVisionModel): texts are
    refused at input (the prompt processor); these say so if one reaches the model."""

    def forward(
        self, input_ids, positions, attn_metadata, token_type_ids=None, first_token_only=False
    ):
        raise ValueError(f"{type(self).__name__} embeds images only")

    def pool_embeddings(self, hidden, cu_seqlens, input_ids):
        raise ValueError(f"{type(self).__name__} embeds images only")
