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

from collections.abc import Iterable, Sequence
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
from tidepool.attention.common import encoder_step
from tidepool.attention.layer import Attention, AttentionModel
from tidepool.models.layers.linear import Linear
from tidepool.models.weights import equal_thirds, load_fused_weights, qkv_markers
from tidepool.multimodal.features import MultiModalFeature


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


def check_image_size(pixels: torch.Tensor, image_size: int, name: str) -> None:
    if pixels.shape[-2:] != (image_size, image_size):
        raise ValueError(
            f"{name}'s vision tower takes {image_size}x{image_size} images, the processor gave "
            f"{tuple(pixels.shape[-2:])} (its preprocessor_config.json disagrees with the model)"
        )


class ClipTextTower(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.embeddings = nn.Module()
        self.embeddings.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embeddings.position_embedding = nn.Embedding(
            config.max_position_embeddings, config.hidden_size
        )
        self.encoder = TowerEncoder(config, causal=True)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: EncoderStepMetadata
    ) -> torch.Tensor:
        rows = meta.rows  # the backend builder's rows: packed tokens or padded buckets
        emb = self.embeddings
        x = emb.token_embedding(rows.gather(input_ids)) + emb.position_embedding(
            rows.gather(positions)
        )
        return rows.to_tokens(self.final_layer_norm(self.encoder(x, meta)))

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


def vision_metadata(
    backend: EncoderAttentionBackend, n: int, seq: int, x: torch.Tensor, num_heads: int
) -> EncoderStepMetadata:
    """The attention metadata of `n` images of `seq` positions each, packed."""
    return backend.metadata_builder().build(encoder_step([seq] * n, x.device, x.dtype, num_heads))


def stack_pixels(features: Sequence[MultiModalFeature], device: torch.device) -> torch.Tensor:
    return torch.stack([f.data["pixel_values"] for f in features]).to(device)


_QKV = qkv_markers(".self_attn.", "q_proj", "k_proj", "v_proj")


class _DualTowerBase(AttentionModel, nn.Module):
    is_causal: ClassVar[bool] = False
    default_pooling_type = "LAST"
    supports_first_token_only = False
    supported_modalities: ClassVar[tuple[str, ...]] = ("image",)
    own_pooling_name = "EOS"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_fused_weights(self, weights, self.map_weight_name, _QKV, equal_thirds)

    def map_weight_name(self, name: str) -> str | None:
        if name.endswith("position_ids") or name.startswith(("logit_scale", "logit_bias")):
            return None
        return name


class CLIPModel(_DualTowerBase):
    """Both towers (an EncoderModel on texts, EmbeddingPoolingHead and DualTowerModel)."""

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
        vision = self.config.vision_config
        head_dim = vision.hidden_size // vision.num_attention_heads
        return AttentionSpec(
            device, dtype, head_dim, self.vision_model.num_patches + 1, needs=frozenset({BANDED})
        )

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

    def pool_embeddings(
        self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        rows = self.text_model.eos_rows(cu_seqlens, input_ids)
        return self.text_projection(hidden.index_select(0, rows))

    def pool_multimodal(self, features: Sequence[MultiModalFeature]) -> torch.Tensor:
        pixels = stack_pixels(features, self.visual_projection.weight.device)
        check_image_size(pixels, self.config.vision_config.image_size, type(self).__name__)
        return self.visual_projection(self.vision_model(pixels, self.attention_backend))


class CLIPVisionModelWithProjection(_DualTowerBase):
    """The vision tower alone (image_embeds): images only, texts refused at input."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.vision_model = ClipVisionTower(config)
        self.visual_projection = nn.Linear(config.hidden_size, config.projection_dim, bias=False)
        self.embedding_size = self.image_embedding_size = config.projection_dim
        self.attention_backend: EncoderAttentionBackend = BUCKETED_SDPA

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        return AttentionSpec(device, dtype, head_dim, self.vision_model.num_patches + 1)

    def forward(
        self, input_ids, positions, attn_metadata, token_type_ids=None, first_token_only=False
    ):
        raise ValueError("CLIPVisionModelWithProjection embeds images only")

    def pool_embeddings(self, hidden, cu_seqlens, input_ids):
        raise ValueError("CLIPVisionModelWithProjection embeds images only")

    def pool_multimodal(self, features: Sequence[MultiModalFeature]) -> torch.Tensor:
        pixels = stack_pixels(features, self.visual_projection.weight.device)
        check_image_size(pixels, self.config.image_size, type(self).__name__)
        return self.visual_projection(self.vision_model(pixels, self.attention_backend))
