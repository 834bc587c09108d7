"""BERT, RoBERTa and XLM-RoBERTa encoders and their sequence-classification heads, on packed tokens.

Every module takes the flat batch: `input_ids [num_tokens]`, `positions [num_tokens]` (0-based within
each sequence) and `EncoderStepMetadata`. Module names follow Hugging Face's so weights map
one to one, except query / key / value, which are fused into one `qkv` projection (one GEMM
instead of three).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from tidepool.attention.backend import (
    BUCKETED_SDPA,
    AttentionSpec,
    EncoderAttentionBackend,
    EncoderStepMetadata,
)
from tidepool.attention.layer import Attention, AttentionModel
from tidepool.models.layers.linear import Linear
from tidepool.models.quantizable import (
    ATTENTION_OUT,
    FFN_DOWN,
    FFN_UP,
    QKV,
    Handoff,
    Int8Layout,
)
from tidepool.models.weights import equal_thirds, load_fused_weights, qkv_markers


def roberta_position_offset(config) -> int:
    """RoBERTa numbers positions from padding_idx + 1 (a pad id of 0 is a real value)."""
    pad = getattr(config, "pad_token_id", None)
    return (1 if pad is None else int(pad)) + 1


def check_bidirectional(config) -> None:
    """Refuse a config that makes transformers run this encoder as a causal decoder."""
    if getattr(config, "is_decoder", False):
        raise ValueError(
            f"{type(config).__name__} has is_decoder=True: transformers runs it with causal "
            "attention, which tidepool's native encoder does not implement; "
            'model_impl="transformers" runs it as transformers does'
        )


class BertEmbeddings(nn.Module):
    def __init__(self, config, position_offset: int = 0) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        num_types = int(getattr(config, "type_vocab_size", 0) or 0)
        self.token_type_embeddings = (
            nn.Embedding(num_types, config.hidden_size) if num_types > 0 else None
        )
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        # RoBERTa numbers positions from padding_idx + 1, per sequence.
        self.position_offset = position_offset

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.position_offset:
            positions = positions + self.position_offset
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                # Type 0 for every token: add row 0 once instead of a gather.
                x = x + self.token_type_embeddings.weight[0]
            else:
                x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scale = self.head_dim**-0.5
        self.qkv = Linear(config.hidden_size, 3 * config.hidden_size)
        self.attn = Attention(BUCKETED_SDPA)

    def forward(self, x: torch.Tensor, meta: EncoderStepMetadata) -> torch.Tensor:
        qkv = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim)
        return self.attn.backend.attend(qkv, meta, self.scale)

    def forward_first_tokens(self, x: torch.Tensor, meta: EncoderStepMetadata) -> torch.Tensor:
        """x: [num_slots, hidden] → [num_seqs, hidden]: queries at each sequence's first slot."""
        qkv = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim)
        return self.attn.backend.attend_first_tokens(qkv, meta, self.scale)


class BertDenseLayerNorm(nn.Module):
    """dense → residual add → LayerNorm (BertSelfOutput and BertOutput)."""

    def __init__(self, in_features: int, config) -> None:
        super().__init__()
        self.dense = Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # The residual add runs inside the GEMM, and in int8 the LayerNorm too (layers/).
        return self.dense.forward_norm(x, residual, self.LayerNorm)


class BertAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertDenseLayerNorm(config.hidden_size, config)

    def forward(self, x: torch.Tensor, meta: EncoderStepMetadata) -> torch.Tensor:
        return self.output.forward(self.self.forward(x, meta), x)


class BertIntermediate(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        # The activation runs inside the GEMM (see layers/linear.py).
        self.dense = Linear(
            config.hidden_size, config.intermediate_size, activation=config.hidden_act
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x)


class BertLayer(nn.Module):
    LINEAR_ROLES: ClassVar[dict[str, str]] = {
        "attention.self.qkv": QKV,
        "attention.output.dense": ATTENTION_OUT,
        "intermediate.dense": FFN_UP,
        "output.dense": FFN_DOWN,
    }
    """int8 (models/quantizable.py): each linear's role."""
    HANDOFFS: ClassVar[tuple[Handoff, ...]] = (
        # The attention output's LayerNorm'd rows are FFN up's input; FFN up's rows are read by
        # FFN down only (forward below).
        Handoff("attention.output.dense", "intermediate.dense"),
        Handoff("intermediate.dense", "output.dense", exclusive=True),
    )
    """int8: the layer's own hand-offs (the next layer's QKV reads FFN down's LayerNorm'd rows:
    `post_ln_stack_layout`)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertDenseLayerNorm(config.intermediate_size, config)

    def forward(self, x: torch.Tensor, meta: EncoderStepMetadata) -> torch.Tensor:
        x = self.attention.forward(x, meta)
        return self.output.forward(self.intermediate.dense(x), x)

    def forward_first_tokens(
        self, x: torch.Tensor, meta: EncoderStepMetadata, first_slots: torch.Tensor
    ) -> torch.Tensor:
        """The layer's output at `first_slots` only: x [num_slots, hidden] → [num_seqs, hidden].

        Keys and values need every slot; the queries, the output projection, both LayerNorms and
        the FFN run on one row per sequence.
        """
        attention = self.attention
        context = attention.self.forward_first_tokens(x, meta)
        x = attention.output(context, x.index_select(0, first_slots))
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(
        self,
        x: torch.Tensor,
        meta: EncoderStepMetadata,
        first_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [num_slots, hidden] → [num_slots, hidden], or [num_seqs, hidden] (the rows at
        `first_slots`) when given: then the last layer computes only those rows."""
        # The containers' `forward` is called directly: nn.Module.__call__'s overhead, 8
        # container calls a layer, is a few percent of a short bfloat16 text.
        # The linears keep __call__: the int8 calibration hooks them (quantization/int8.py).
        if first_slots is None:
            for layer in self.layer:
                x = layer.forward(x, meta)
            return x
        for layer in self.layer[:-1]:
            x = layer.forward(x, meta)
        return self.layer[-1].forward_first_tokens(x, meta, first_slots)


def post_ln_stack_layout(
    prefix: str, layers: nn.ModuleList, reuse_qkv_output: bool = True
) -> Int8Layout:
    """The int8 layout of a post-LN layer stack (BERT's `BertLayer` tables, its subclasses' and
    DeBERTa's) at `prefix` ("encoder.layer."): each layer's roles and hand-offs, FFN down's rows
    handed to the next layer's QKV, and the reused outputs: one buffer for every layer's FFN up
    (read by FFN down only), with `reuse_qkv_output` one for every QKV (read by the attention
    only), and the residual stream's two in turn (layer i's attention output and FFN down are
    dead when layer i + 1 writes them; the last FFN down's rows are the model's output)."""
    roles: dict[str, str] = {}
    handoffs: list[Handoff] = []
    for i, layer in enumerate(layers):
        at = f"{prefix}{i}."
        present = dict(layer.named_modules())  # optional linears (None) are left out
        roles.update({at + n: role for n, role in layer.LINEAR_ROLES.items() if n in present})
        handoffs += [Handoff(at + h.producer, at + h.consumer, h.exclusive) for h in layer.HANDOFFS]
        if i + 1 < len(layers):
            handoffs.append(Handoff(at + "output.dense", f"{prefix}{i + 1}.attention.self.qkv"))
    names = [f"{prefix}{i}." for i in range(len(layers))]
    shared = [
        tuple(n + "intermediate.dense" for n in names),
        tuple(n + "attention.output.dense" for n in names),
        tuple(n + "output.dense" for n in names[:-1]),
    ]
    if reuse_qkv_output:
        shared.insert(0, tuple(n + "attention.self.qkv" for n in names))
    return Int8Layout(roles, tuple(handoffs), tuple(shared))


class BertModel(AttentionModel, nn.Module):
    """The encoder body: packed token ids → hidden states [num_tokens, hidden] (an EncoderModel,
    models/interfaces.py)."""

    is_causal: ClassVar[bool] = False
    default_pooling_type = "CLS"
    supports_first_token_only = True
    """forward(..., first_token_only=True) returns each sequence's first row only (CLS pooling)."""
    # Prefixes a checkpoint may put before the body's weight names.
    body_prefixes: tuple[str, ...] = ("bert.", "model.")
    position_offset_from_padding = False

    def __init__(self, config) -> None:
        super().__init__()
        check_bidirectional(config)
        self.config = config
        offset = 0
        if self.position_offset_from_padding:
            offset = roberta_position_offset(config)
        self.embeddings = BertEmbeddings(config, position_offset=offset)
        self.encoder = BertEncoder(config)
        self.attention_backend: EncoderAttentionBackend = BUCKETED_SDPA
        """Chosen by the loader (attention/backend.py); bucketed SDPA when built by hand."""

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        return AttentionSpec(device, dtype, head_dim, self.config.max_position_embeddings)

    def int8_layout(self) -> Int8Layout:
        """int8 (models/quantizable.py): the post-LN stack's roles and chains."""
        return post_ln_stack_layout("encoder.layer.", self.encoder.layer)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: EncoderStepMetadata,
        token_type_ids: torch.Tensor | None = None,
        first_token_only: bool = False,
    ) -> torch.Tensor:
        """→ [num_tokens, hidden] in packed order; with `first_token_only`, [num_seqs, hidden]:
        each sequence's first token (what CLS pooling reads), the last layer computing only those
        rows. The layers run on the rows the backend's builder chose (attention/common.py
        LayerRows: the packed tokens, or padded buckets' slots)."""
        rows = attn_metadata.rows
        x = self.embeddings(
            rows.gather(input_ids), rows.gather(positions), rows.gather(token_type_ids)
        )
        if first_token_only:
            return self.encoder(x, attn_metadata, rows.first_rows)
        return rows.to_tokens(self.encoder(x, attn_metadata))

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint name → our parameter name; None = not ours (skipped)."""
        for prefix in self.body_prefixes:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        if not name.startswith(("embeddings.", "encoder.")) or name.endswith("position_ids"):
            return None
        return name.replace(".gamma", ".weight").replace(".beta", ".bias")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_fused_weights(self, weights, self.map_weight_name, _QKV, equal_thirds)


class RobertaModel(BertModel):
    body_prefixes = ("roberta.", "model.")
    position_offset_from_padding = True


class XLMRobertaModel(RobertaModel):
    pass


class EncoderWithHead(AttentionModel, nn.Module):
    """An encoder body plus a head (sequence or token classifier, MLM, projections): the
    EncoderModel members delegate to the body; subclasses add the head's layers, name them in
    `head_names` and give `compute_logits` (or the head's own outputs)."""

    body_cls: ClassVar[type[nn.Module]] = BertModel
    is_causal: ClassVar[bool] = False
    default_pooling_type = "CLS"
    supports_first_token_only = True
    head_names: ClassVar[dict[str, str]] = {}
    """Checkpoint name → our head parameter name."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.body = self.body_cls(config)

    @property
    def attention_backend(self) -> EncoderAttentionBackend:
        return self.body.attention_backend

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        return self.body.attention_spec(device, dtype)

    def body_int8_layout(self) -> Int8Layout:
        """The body's int8 layout under "body." (the heads' `nn.Linear`s stay float32): a
        subclass with the int8 path returns it from `int8_layout`."""
        return self.body.int8_layout().prefixed("body.")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: EncoderStepMetadata,
        token_type_ids: torch.Tensor | None = None,
        first_token_only: bool = False,
    ) -> torch.Tensor:
        return self.body(input_ids, positions, attn_metadata, token_type_ids, first_token_only)

    def map_weight_name(self, name: str) -> str | None:
        if name in self.head_names:
            return self.head_names[name]
        mapped = self.body.map_weight_name(name)
        return None if mapped is None else "body." + mapped

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_fused_weights(self, weights, self.map_weight_name, _QKV, equal_thirds)


class BertForSequenceClassification(EncoderWithHead):
    """A BERT cross-encoder: CLS → pooler dense + tanh → classifier (an EncoderModel and a
    ClassifierHead, models/interfaces.py)."""

    body_cls = BertModel

    def __init__(self, config) -> None:
        super().__init__(config)
        self.pooler_dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def compute_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """pooled: [num_seqs, hidden] (the CLS states) → [num_seqs, num_labels]."""
        return self.classifier(torch.tanh(self.pooler_dense(pooled)))

    def int8_layout(self) -> Int8Layout:
        return self.body_int8_layout()

    head_names = {
        "bert.pooler.dense.weight": "pooler_dense.weight",
        "bert.pooler.dense.bias": "pooler_dense.bias",
        "classifier.weight": "classifier.weight",
        "classifier.bias": "classifier.bias",
    }


class RobertaForSequenceClassification(BertForSequenceClassification):
    """RoBERTa's head: <s> state → dense → tanh → out_proj (two layers, no BERT pooler)."""

    body_cls = RobertaModel

    def __init__(self, config) -> None:
        EncoderWithHead.__init__(self, config)
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


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    body_cls = XLMRobertaModel


_QKV = qkv_markers(".attention.self.", "query", "key", "value")
