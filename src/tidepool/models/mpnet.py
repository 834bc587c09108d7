"""MPNet (all-mpnet-base-v2 and its cross-encoders) on packed tokens: BERT's layers plus a
relative position bias, bucketed as transformers' MPNet does, shared by every layer.

The bias is one [num_buckets, heads] table (`encoder.relative_attention_bias`); each step expands
it once into biases by key - query distance (attention/relative_bias.py), which the CPU kernel
reads per head inside its score loop and the SDPA path takes as an additive mask per bucket.
Positions start after padding_idx (1), as RoBERTa's do. Checkpoint names map onto bert.py's
modules: attention.attn.{q,k,v} → attention.self.qkv (fused), attention.attn.o →
attention.output.dense, attention.LayerNorm → attention.output.LayerNorm.
"""

from __future__ import annotations

import torch
from torch import nn

from tidepool.attention.backend import BUCKETED_SDPA, EncoderStepMetadata
from tidepool.attention.relative_bias import RelativePositionBias, bidirectional_bucket
from tidepool.models.bert import (
    BertAttention,
    BertEmbeddings,
    BertForSequenceClassification,
    BertLayer,
    BertModel,
    BertSelfAttention,
)

# transformers' MPNetEncoder.compute_position_bias buckets with its defaults (32 buckets, max
# distance 128) whatever relative_attention_num_buckets says; the table has that many rows.
NUM_BUCKETS = 32
MAX_DISTANCE = 128
PADDING_IDX = 1  # MPNetEmbeddings hard-codes it: positions are padding_idx + 1, + 2, ...


def relative_position_bucket(relative_position: torch.Tensor) -> torch.Tensor:
    """key - query distance → bucket: T5's bidirectional buckets with MPNet's fixed sizes."""
    return bidirectional_bucket(relative_position, NUM_BUCKETS, MAX_DISTANCE)


class MPNetSelfAttention(BertSelfAttention):
    def forward(
        self,
        x: torch.Tensor,
        meta: EncoderStepMetadata,
        bias: RelativePositionBias | None = None,
    ) -> torch.Tensor:
        assert bias is not None, "MPNet's attention needs its relative position bias"
        qkv = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim)
        return self.attn.backend.attend(qkv, meta, self.scale, bias)

    def forward_first_tokens(
        self,
        x: torch.Tensor,
        meta: EncoderStepMetadata,
        bias: RelativePositionBias | None = None,
    ) -> torch.Tensor:
        assert bias is not None, "MPNet's attention needs its relative position bias"
        qkv = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim)
        return self.attn.backend.attend_first_tokens(qkv, meta, self.scale, bias)


class MPNetAttention(BertAttention):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.self = MPNetSelfAttention(config)

    def forward(
        self,
        x: torch.Tensor,
        meta: EncoderStepMetadata,
        bias: RelativePositionBias | None = None,
    ) -> torch.Tensor:
        return self.output(self.self(x, meta, bias), x)


class MPNetLayer(BertLayer):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.attention = MPNetAttention(config)

    def forward(
        self,
        x: torch.Tensor,
        meta: EncoderStepMetadata,
        bias: RelativePositionBias | None = None,
    ) -> torch.Tensor:
        x = self.attention(x, meta, bias)
        return self.output(self.intermediate(x), x)

    def forward_first_tokens(
        self,
        x: torch.Tensor,
        meta: EncoderStepMetadata,
        first_slots: torch.Tensor,
        bias: RelativePositionBias | None = None,
    ) -> torch.Tensor:
        attention = self.attention
        context = attention.self.forward_first_tokens(x, meta, bias)
        x = attention.output(context, x.index_select(0, first_slots))
        return self.output(self.intermediate(x), x)


class MPNetEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(MPNetLayer(config) for _ in range(config.num_hidden_layers))
        self.relative_attention_bias = nn.Embedding(
            config.relative_attention_num_buckets, config.num_attention_heads
        )

    def forward(
        self,
        x: torch.Tensor,
        meta: EncoderStepMetadata,
        first_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [num_slots, hidden] → [num_slots, hidden], or the rows at `first_slots` only."""
        # Once per step, for every layer: the biases by distance up to the longest sequence.
        bias = RelativePositionBias.build(
            self.relative_attention_bias.weight, relative_position_bucket, max(meta.seq_lens)
        )
        layers = self.layer if first_slots is None else self.layer[:-1]
        for layer in layers:
            x = layer(x, meta, bias)
        if first_slots is None:
            return x
        return self.layer[-1].forward_first_tokens(x, meta, first_slots, bias)


class MPNetModel(BertModel):
    """The MPNet body: packed token ids → hidden states [num_tokens, hidden] (an EncoderModel)."""

    body_prefixes = ("mpnet.", "model.")

    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.embeddings = BertEmbeddings(config, position_offset=PADDING_IDX + 1)
        self.encoder = MPNetEncoder(config)  # type: ignore[assignment]
        self.attention_backend = BUCKETED_SDPA

    def map_weight_name(self, name: str) -> str | None:
        mapped = super().map_weight_name(name)
        if mapped is None:
            return None
        for theirs, ours in _RENAMES:
            mapped = mapped.replace(theirs, ours)
        return mapped


class MPNetForSequenceClassification(BertForSequenceClassification):
    """An MPNet cross-encoder: <s> state → dense → tanh → out_proj (MPNetClassificationHead)."""

    body_cls = MPNetModel

    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.body = self.body_cls(config)
        self.classifier_dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def compute_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.classifier_dense(pooled)))

    head_names = {
        "classifier.dense.weight": "classifier_dense.weight",
        "classifier.dense.bias": "classifier_dense.bias",
        "classifier.out_proj.weight": "out_proj.weight",
        "classifier.out_proj.bias": "out_proj.bias",
    }


# Checkpoint name part → ours (bert.py's modules); q / k / v then fuse through bert's markers.
_RENAMES = (
    (".attention.attn.q.", ".attention.self.query."),
    (".attention.attn.k.", ".attention.self.key."),
    (".attention.attn.v.", ".attention.self.value."),
    (".attention.attn.o.", ".attention.output.dense."),
    (".attention.LayerNorm.", ".attention.output.LayerNorm."),
)
