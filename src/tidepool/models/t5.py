"""T5 encoders (sentence-t5, GTR: `T5EncoderModel`; mT5's `MT5EncoderModel`) on packed tokens.

    x = embed_tokens(ids)                         no absolute positions, no embedding scale
    per block:  x = x + o(attend(qkv(rms(x)), bias))      pre-norm, no biases anywhere
                x = x + wo(act(wi(rms(x))))                feed_forward_proj "relu"
                x = x + wo(act(wi_0(rms(x))) * wi_1(rms(x)))   "gated-gelu" (T5 v1.1, mT5)
    out = rms(x)                                  the final layer norm

The relative position bias is one [num_buckets, heads] table (in the first block of the
checkpoint, shared by all blocks); each step expands it once into biases by key - query distance
(attention/relative_bias.py, with T5's bidirectional buckets and the config's num_buckets /
max_distance), which the CPU kernel reads per head inside its score loop and the SDPA path takes
as an additive mask per bucket, as for MPNet. T5 does not scale the scores by 1/sqrt(head_dim):
the backends get scale 1.0, which is exact and costs nothing. T5's layer norm is an RMS norm
(layers/rmsnorm.py: no mean, no bias). q / k / v fuse into one `qkv` projection; the residual
adds and the FFN activation (or the gate's product) run inside the GEMMs (layers/linear.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import ClassVar

import torch
from torch import nn

from tidepool.attention.backend import BUCKETED_SDPA, AttentionSpec, EncoderStepMetadata
from tidepool.attention.layer import Attention
from tidepool.attention.relative_bias import RelativePositionBias, bidirectional_bucket
from tidepool.models.bert import BertModel
from tidepool.models.layers.linear import Linear
from tidepool.models.layers.rmsnorm import RMSNorm
from tidepool.models.quantizable import ATTENTION_OUT, FFN_DOWN, FFN_UP, QKV, Handoff, Int8Layout
from tidepool.models.weights import equal_thirds, load_fused_weights, qkv_markers

# T5's relative positions have no limit; model_loader/resolve.py caps prompts at the config's
# max_position_embeddings or this (sentence-t5 / GTR cap at 256 through sentence-transformers).
DEFAULT_MAX_POSITIONS = 512


class T5SelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.d_kv
        inner = self.num_heads * self.head_dim  # may differ from d_model
        self.qkv = Linear(config.d_model, 3 * inner, bias=False)
        self.o = Linear(inner, config.d_model, bias=False)
        self.attn = Attention(BUCKETED_SDPA)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        meta: EncoderStepMetadata,
        bias: RelativePositionBias,
    ) -> torch.Tensor:
        """x: the normed states [num_slots, d_model] → residual + attention output."""
        qkv = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim)
        context = self.attn.backend.attend(qkv, meta, 1.0, bias)  # T5: unscaled scores
        return self.o(context, residual=residual)


class T5LayerSelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.SelfAttention = T5SelfAttention(config)
        self.layer_norm = RMSNorm(config.d_model, eps=config.layer_norm_epsilon)

    def forward(
        self, x: torch.Tensor, meta: EncoderStepMetadata, bias: RelativePositionBias
    ) -> torch.Tensor:
        return self.SelfAttention(self.layer_norm(x), x, meta, bias)


class T5DenseActDense(nn.Module):
    """wo(act(wi(x))) + residual (feed_forward_proj "relu", "gelu", ...)."""

    LINEAR_ROLES: ClassVar[dict[str, str]] = {"wi": FFN_UP, "wo": FFN_DOWN}
    """int8 (models/quantizable.py): each linear's role; wi's rows are wo's input."""
    HANDOFFS: ClassVar[tuple[Handoff, ...]] = (Handoff("wi", "wo"),)

    def __init__(self, config) -> None:
        super().__init__()
        self.wi = Linear(config.d_model, config.d_ff, bias=False, activation=config.dense_act_fn)
        self.wo = Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.wo(self.wi(x), residual=residual)


class T5DenseGatedActDense(nn.Module):
    """wo(act(wi_0(x)) * wi_1(x)) + residual (feed_forward_proj "gated-gelu", ...): the
    activation runs in wi_0's GEMM, the product in wi_1's, the residual add in wo's."""

    LINEAR_ROLES: ClassVar[dict[str, str]] = {"wi_0": FFN_UP, "wi_1": FFN_UP, "wo": FFN_DOWN}
    """int8: the gate and the up projection are both FFN up; wi_1's epilogue multiplies in the
    gate, so its rows are wo's input."""
    HANDOFFS: ClassVar[tuple[Handoff, ...]] = (Handoff("wi_1", "wo"),)

    def __init__(self, config) -> None:
        super().__init__()
        self.wi_0 = Linear(config.d_model, config.d_ff, bias=False, activation=config.dense_act_fn)
        self.wi_1 = Linear(config.d_model, config.d_ff, bias=False)
        self.wo = Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.wo(self.wi_1(x, multiply=self.wi_0(x)), residual=residual)


class T5LayerFF(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        gated = bool(getattr(config, "is_gated_act", False))
        self.DenseReluDense = T5DenseGatedActDense(config) if gated else T5DenseActDense(config)
        self.layer_norm = RMSNorm(config.d_model, eps=config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.DenseReluDense(self.layer_norm(x), x)


class T5Block(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        # layer[0] / layer[1]: the checkpoint's names (self-attention, feed-forward).
        self.layer = nn.ModuleList([T5LayerSelfAttention(config), T5LayerFF(config)])

    def forward(
        self, x: torch.Tensor, meta: EncoderStepMetadata, bias: RelativePositionBias
    ) -> torch.Tensor:
        return self.layer[1](self.layer[0](x, meta, bias))

    def int8_layout(self, prefix: str) -> Int8Layout:
        """int8 (models/quantizable.py): this block's linears under `prefix`, and its FFN's
        hand-off (the attention's output goes on through the RMSNorm: no hand-off there)."""
        ff = self.layer[1].DenseReluDense
        at = prefix + "layer.1.DenseReluDense."
        roles = {
            prefix + "layer.0.SelfAttention.qkv": QKV,
            prefix + "layer.0.SelfAttention.o": ATTENTION_OUT,
        }
        roles |= {at + name: role for name, role in ff.LINEAR_ROLES.items()}
        handoffs = tuple(
            Handoff(at + h.producer, at + h.consumer, h.exclusive) for h in ff.HANDOFFS
        )
        return Int8Layout(roles, handoffs)


class T5Embeddings(nn.Module):
    """Token embeddings only: T5 has no absolute positions and no token types."""

    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class T5Stack(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.block = nn.ModuleList(T5Block(config) for _ in range(config.num_layers))
        self.relative_attention_bias = nn.Embedding(
            config.relative_attention_num_buckets, config.num_heads
        )
        self.final_layer_norm = RMSNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.bucket_of = partial(
            bidirectional_bucket,
            num_buckets=config.relative_attention_num_buckets,
            max_distance=config.relative_attention_max_distance,
        )

    def forward(
        self,
        x: torch.Tensor,
        meta: EncoderStepMetadata,
        first_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [num_slots, d_model] → [num_slots, d_model]."""
        if first_slots is not None:
            raise ValueError("supports_first_token_only is False: every row is computed")
        # Once per step, for every block: the biases by distance up to the longest sequence.
        bias = RelativePositionBias.build(
            self.relative_attention_bias.weight, self.bucket_of, max(meta.seq_lens)
        )
        for block in self.block:
            x = block(x, meta, bias)
        return self.final_layer_norm(x)


class T5EncoderModel(BertModel):
    """The T5 encoder: packed token ids → hidden states [num_tokens, d_model] (an EncoderModel,
    models/interfaces.py); BertModel's forward runs it on the packed or the padded layout."""

    default_pooling_type = "MEAN"
    supports_first_token_only = False
    """Mean-pooled models: no CLS-only last layer."""

    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.embeddings = T5Embeddings(config)
        self.encoder = T5Stack(config)
        self.attention_backend = BUCKETED_SDPA

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        max_positions = getattr(self.config, "max_position_embeddings", None)
        return AttentionSpec(
            device, dtype, self.config.d_kv, int(max_positions or DEFAULT_MAX_POSITIONS)
        )

    INT8_RECIPE: ClassVar[dict[str, object]] = {"smoothed_roles": (QKV,)}
    """T5's change to the default int8 recipe: only QKV's input is smoothed (FFN up keeps its
    RMSNorm'd input as it is: the recipe T5 was measured with, tests/models/test_t5.py)."""

    def int8_layout(self) -> Int8Layout:
        """int8 (models/quantizable.py): every block's table; no reused outputs."""
        roles: dict[str, str] = {}
        handoffs: tuple[Handoff, ...] = ()
        for i, block in enumerate(self.encoder.block):
            layout = block.int8_layout(f"encoder.block.{i}.")
            roles |= layout.roles
            handoffs += layout.handoffs
        return Int8Layout(roles, handoffs, recipe=self.INT8_RECIPE)

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint name → ours: the (tied) shared embeddings, the encoder's blocks, the first
        block's bias table; a full T5's decoder and LM head are skipped."""
        if name in ("shared.weight", "encoder.embed_tokens.weight"):
            return "embeddings.embed_tokens.weight"
        if name.endswith(".relative_attention_bias.weight"):
            return "encoder.relative_attention_bias.weight" if name.startswith("encoder.") else None
        if name.startswith(("encoder.block.", "encoder.final_layer_norm.")):
            return name
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_fused_weights(self, weights, self.map_weight_name, _QKV, equal_thirds)


class MT5EncoderModel(T5EncoderModel):
    """mT5: T5 v1.1's layers (gated-gelu, untied head) with a multilingual vocabulary."""


_QKV = qkv_markers(".SelfAttention.", "q", "k", "v")
