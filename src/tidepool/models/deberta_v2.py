"""DeBERTa-v2 / v3 (NLI cross-encoders, mxbai-rerank v1, ...) on padded buckets: disentangled
attention with log-bucketed relative positions.

    scores[i, j] = (q_i·k_j + q_i·pk[r(i, j)] + k_j·pq[r(i, j)]) / sqrt(D * scale_factor)
                    content→content  content→position  position→content

r(i, j) = clamp(bucket(i - j) + span, 0, 2 span - 1) indexes the relative embeddings (one
[2 span, hidden] table shared by all layers, LayerNorm'd when norm_rel_ebd says so); pk / pq are
those embeddings through the layer's key / query projections (share_att_key) or its own pos_key_proj
/ pos_query_proj; scale_factor is 1 + one per term in pos_att_type (counted as transformers counts
it: from the config, even when relative_attention is off and the terms are absent). bucket() is the
identity without position_buckets, else exact within ±position_buckets / 2 and logarithmic out to
max_relative_positions (-1: max_position_embeddings); span is position_buckets, else
max_relative_positions. With conv_kernel_size (DeBERTa-v2 xlarge / xxlarge) a convolution over the
embeddings joins the first layer's output (DebertaV2ConvLayer).

The layers run on the padded layout (attention/metadata.pad_buckets), which the model's attention
spec asks its backend for (PADDED_BUCKETS: the registry gives it bucketed SDPA, and refuses a
backend without it at load): each bucket of similar lengths is a [num_seqs, L] block, and its attention is one SDPA call whose additive mask carries the two
position terms (gathered from [L, R] products, R <= 2 L - 1 the distinct relative rows a length-L
bucket can use) plus -inf at padding keys. Per step the relative rows are projected once per layer,
only those the step's longest bucket reaches.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tidepool.attention.backend import (
    BUCKETED_SDPA,
    PADDED_BUCKETS,
    AttentionSpec,
    EncoderAttentionBackend,
)
from tidepool.attention.metadata import AttentionBucket, EncoderAttentionMetadata
from tidepool.models.bert import (
    BertDenseLayerNorm,
    BertIntermediate,
    BertLayer,
    EncoderWithHead,
    post_ln_stack_layout,
)
from tidepool.models.heads import BertForTokenClassification
from tidepool.models.layers.activation import get_activation
from tidepool.models.layers.linear import Linear
from tidepool.models.quantizable import POSITION, PROJECTION, Int8Layout
from tidepool.models.weights import equal_thirds, load_fused_weights, qkv_markers


def make_log_bucket_position(
    relative_pos: torch.Tensor, bucket_size: int, max_position: int
) -> torch.Tensor:
    """i - j → its bucket: exact within ±bucket_size / 2, logarithmic out to max_position (the
    same ops as transformers' make_log_bucket_position)."""
    sign = torch.sign(relative_pos)
    mid = bucket_size // 2
    abs_pos = torch.where(
        (relative_pos < mid) & (relative_pos > -mid),
        torch.tensor(mid - 1).type_as(relative_pos),
        torch.abs(relative_pos),
    )
    log_pos = (
        torch.ceil(
            torch.log(abs_pos / mid) / torch.log(torch.tensor((max_position - 1) / mid)) * (mid - 1)
        )
        + mid
    )
    return torch.where(abs_pos <= mid, relative_pos.type_as(log_pos), log_pos * sign).long()


def relative_span(config) -> tuple[int, int, int]:
    """(position_buckets, max_relative_positions, span) as transformers reads them; the relative
    embeddings have 2 * span rows."""
    buckets = int(getattr(config, "position_buckets", -1))
    max_relative = int(getattr(config, "max_relative_positions", -1))
    if max_relative < 1:
        max_relative = config.max_position_embeddings
    return buckets, max_relative, buckets if buckets > 0 else max_relative


class RelativeRows:
    """One step's relative-position indices: r(i, j) for bucket lengths up to `max_len`."""

    def __init__(self, config, max_len: int, device: torch.device) -> None:
        buckets, max_relative, self.span = relative_span(config)
        idx = torch.arange(max_len, device=device)
        relative = idx[:, None] - idx[None, :]  # i - j
        if buckets > 0:
            relative = make_log_bucket_position(relative, buckets, max_relative)
        index = torch.clamp(relative + self.span, 0, 2 * self.span - 1)  # [L, L]
        # r is monotonic in i - j: the rows used lie between r(0, L-1) and r(L-1, 0).
        self.first_row = int(index[0, -1])
        self.num_rows = int(index[-1, 0]) - self.first_row + 1
        self.index = index - self.first_row
        self._by_len: dict[int, tuple[torch.Tensor, slice]] = {}

    def for_length(self, length: int) -> tuple[torch.Tensor, slice]:
        """A bucket of `length`: (its [length, length] int64 indices into the rows it uses, those
        rows as a slice of the step's), so a short bucket multiplies by its own rows only."""
        found = self._by_len.get(length)
        if found is None:
            index = self.index[:length, :length]
            first, last = int(index[0, -1]), int(index[-1, 0])
            found = ((index - first).contiguous(), slice(first, last + 1))
            self._by_len[length] = found
        return found


class DisentangledSelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = getattr(config, "attention_head_size", None) or (
            config.hidden_size // config.num_attention_heads
        )
        inner = self.num_heads * self.head_dim
        self.qkv = Linear(config.hidden_size, 3 * inner)
        self.relative = bool(getattr(config, "relative_attention", False))
        self.pos_att_type = list(config.pos_att_type or []) if self.relative else []
        self.share_att_key = bool(getattr(config, "share_att_key", False))
        if self.relative and not self.share_att_key:
            if "c2p" in self.pos_att_type:
                self.pos_key_proj = Linear(config.hidden_size, inner)
            if "p2c" in self.pos_att_type:
                self.pos_query_proj = Linear(config.hidden_size, inner)
        # transformers scales by the config's pos_att_type even without relative attention (its
        # terms are then absent): sqrt(D * 3) for ["c2p", "p2c"] all the same.
        scale_factor = 1 + len({"c2p", "p2c"} & set(config.pos_att_type or []))
        self.scale = 1.0 / math.sqrt(self.head_dim * scale_factor)

    def _position_heads(self, rel: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """rel: [R, hidden] → (pk, pq), each [H, R, D] or None when its term is off."""
        pk = pq = None
        if self.share_att_key:
            q_rows, k_rows, _ = self.qkv(rel).chunk(3, dim=-1)
            pk = k_rows if "c2p" in self.pos_att_type else None
            pq = q_rows if "p2c" in self.pos_att_type else None
        else:
            if "c2p" in self.pos_att_type:
                pk = self.pos_key_proj(rel)
            if "p2c" in self.pos_att_type:
                pq = self.pos_query_proj(rel)

        def heads(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.view(-1, self.num_heads, self.head_dim).transpose(0, 1)

        return heads(pk), heads(pq)

    def forward(
        self,
        x: torch.Tensor,
        meta: EncoderAttentionMetadata,
        rows: RelativeRows | None,
        rel: torch.Tensor | None,
        first_only: bool = False,
    ) -> torch.Tensor:
        """x: [num_slots, hidden] on the padded layout → [num_slots, heads * head_dim]; with
        `first_only`, [num_seqs, heads * head_dim]: the queries at each sequence's first slot."""
        qkv = self.qkv(x)
        pk, pq = (None, None) if rel is None else self._position_heads(rel)
        if first_only:
            buckets = meta.buckets
            return torch.cat([self._attend_bucket(qkv, b, rows, pk, pq, True) for b in buckets])
        out = x.new_empty(x.shape[0], self.num_heads * self.head_dim)
        for bucket in meta.buckets:
            out[bucket.start : bucket.end] = self._attend_bucket(qkv, bucket, rows, pk, pq)
        return out

    def _attend_bucket(
        self,
        qkv: torch.Tensor,
        bucket: AttentionBucket,
        rows: RelativeRows | None,
        pk: torch.Tensor | None,
        pq: torch.Tensor | None,
        first_only: bool = False,
    ) -> torch.Tensor:
        """One bucket's attention → [n * L, H * D]; with `first_only`, [n, H * D] (the queries
        at each sequence's first slot: its rows of the position terms only)."""
        n, length, heads, dim = bucket.num_seqs, bucket.max_len, self.num_heads, self.head_dim
        num_queries = 1 if first_only else length
        # [n * L, 3 * H * D] → q, k, v: [n, H, L, D]; q: [n, H, num_queries, D]
        block = qkv[bucket.start : bucket.end].view(n, length, 3, heads, dim)
        q, k, v = block.permute(2, 0, 3, 1, 4).unbind(0)
        q = q[:, :, :num_queries]
        mask: torch.Tensor | None = None
        if rows is not None:
            index, used = rows.for_length(length)
            index = index[:num_queries].expand(n, heads, num_queries, length)
            mask = torch.zeros(n, heads, num_queries, length, dtype=q.dtype, device=q.device)
            if pk is not None:  # content→position: q_i · pk[r(i, j)]
                mask += torch.matmul(q, pk[:, used].transpose(-1, -2)).gather(-1, index)
            if pq is not None:  # position→content: k_j · pq[r(i, j)], r(i, j) = index.T[j, i]
                p2c = torch.matmul(k, pq[:, used].transpose(-1, -2))
                mask += p2c.gather(-1, index.transpose(-1, -2)).transpose(-1, -2)
            mask *= self.scale
            if bucket.key_mask is not None:
                mask.masked_fill_(~bucket.key_mask, float("-inf"))
        elif bucket.key_mask is not None:
            mask = bucket.key_mask
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return o.transpose(1, 2).reshape(n * num_queries, heads * dim)


class DebertaV2Attention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self = DisentangledSelfAttention(config)
        self.output = BertDenseLayerNorm(config.hidden_size, config)


class DebertaV2Layer(nn.Module):
    LINEAR_ROLES: ClassVar[dict[str, str]] = {
        **BertLayer.LINEAR_ROLES,
        "attention.self.pos_key_proj": POSITION,
        "attention.self.pos_query_proj": POSITION,
    }
    """int8 (models/quantizable.py): BERT's four, and the relative positions' projections."""
    HANDOFFS = BertLayer.HANDOFFS
    """BERT's (forward below: FFN up's rows are read by FFN down only)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.attention = DebertaV2Attention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertDenseLayerNorm(config.intermediate_size, config)

    def forward(self, x, meta, rows, rel) -> torch.Tensor:
        x = self.attention.output(self.attention.self(x, meta, rows, rel), x)
        return self.output(self.intermediate(x), x)

    def forward_first_tokens(self, x, meta, rows, rel, first_slots) -> torch.Tensor:
        """The layer's output at `first_slots` only: [num_slots, hidden] → [num_seqs, hidden].
        Keys, values and their position terms need every slot; the rest runs on one row per
        sequence."""
        context = self.attention.self(x, meta, rows, rel, first_only=True)
        x = self.attention.output(context, x.index_select(0, first_slots))
        return self.output(self.intermediate(x), x)


class DebertaV2Embeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        size = getattr(config, "embedding_size", None) or config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, size)
        self.position_embeddings = None
        if getattr(config, "position_biased_input", True):
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, size)
        num_types = int(getattr(config, "type_vocab_size", 0) or 0)
        self.token_type_embeddings = nn.Embedding(num_types, size) if num_types > 0 else None
        self.embed_proj = (
            Linear(size, config.hidden_size, bias=False) if size != config.hidden_size else None
        )
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, positions, token_type_ids) -> torch.Tensor:
        x = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(positions)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                x = x + self.token_type_embeddings.weight[0]
            else:
                x = x + self.token_type_embeddings(token_type_ids)
        if self.embed_proj is not None:
            x = self.embed_proj(x)
        return self.LayerNorm(x)


class DebertaV2ConvLayer(nn.Module):
    """DeBERTa-v2 xlarge / xxlarge's convolution after the first layer (conv_kernel_size > 0):
    LayerNorm(layer_0_out + act(conv1d(embeddings))), the convolution running along each
    sequence with zeros past its ends (transformers zeroes the padding's embeddings)."""

    def __init__(self, config) -> None:
        super().__init__()
        kernel = int(config.conv_kernel_size)
        if kernel % 2 == 0:
            raise ValueError(
                f"DeBERTa-v2 conv_kernel_size={kernel}: an even kernel changes the sequence "
                "length (transformers cannot run it either); only odd kernels are supported"
            )
        hidden = config.hidden_size
        groups = int(getattr(config, "conv_groups", 1) or 1)
        self.conv = nn.Conv1d(hidden, hidden, kernel, padding=(kernel - 1) // 2, groups=groups)
        self.act = get_activation(getattr(config, "conv_act", "tanh"))
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(
        self, embeddings: torch.Tensor, x: torch.Tensor, meta: EncoderAttentionMetadata
    ) -> torch.Tensor:
        """embeddings, x (layer 0's output): [num_slots, hidden] on the padded layout."""
        valid = _real_slots(meta, x.device).unsqueeze(-1)
        source = embeddings * valid
        out = torch.empty_like(x)
        hidden = x.shape[-1]
        for b in meta.buckets:
            block = source[b.start : b.end].view(b.num_seqs, b.max_len, hidden).transpose(1, 2)
            out[b.start : b.end] = self.conv(block).transpose(1, 2).reshape(-1, hidden)
        return self.LayerNorm(x + self.act(out * valid))


def _real_slots(meta: EncoderAttentionMetadata, device: torch.device) -> torch.Tensor:
    """[num_slots] bool: the padded layout's slots that hold a token (bucket by bucket, each
    sequence's first seq_len slots of its max_len row)."""
    parts, first = [], 0
    for b in meta.buckets:
        lens = torch.tensor(meta.seq_lens[first : first + b.num_seqs], device=device)
        first += b.num_seqs
        parts.append((torch.arange(b.max_len, device=device) < lens[:, None]).reshape(-1))
    return torch.cat(parts)


class DebertaV2Encoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        buckets = int(getattr(config, "position_buckets", -1))
        if bool(getattr(config, "relative_attention", False)) and buckets == 1:
            raise ValueError(
                "DeBERTa-v2 position_buckets=1: half a bucket is 0 and the log-bucket positions "
                "divide by it (transformers gives NaN); use 0 / -1 (no buckets) or >= 2"
            )
        self.config = config
        self.layer = nn.ModuleList(DebertaV2Layer(config) for _ in range(config.num_hidden_layers))
        kernel = int(getattr(config, "conv_kernel_size", 0) or 0)
        self.conv = DebertaV2ConvLayer(config) if kernel > 0 else None
        self.relative = bool(getattr(config, "relative_attention", False))
        if self.relative:
            span = relative_span(config)[2]
            self.rel_embeddings = nn.Embedding(2 * span, config.hidden_size)
        norms = str(getattr(config, "norm_rel_ebd", "none")).lower().split("|")
        self.LayerNorm = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            if "layer_norm" in [n.strip() for n in norms]
            else None
        )

    def forward(
        self,
        x: torch.Tensor,
        meta: EncoderAttentionMetadata,
        first_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [num_slots, hidden] → [num_slots, hidden], or [num_seqs, hidden] (the rows at
        `first_slots`, the last layer computing only those) when given."""
        rows = rel = None
        if self.relative:
            # Once per step: the relative rows the longest bucket reaches, LayerNorm'd.
            rows = RelativeRows(self.config, max(b.max_len for b in meta.buckets), x.device)
            rel = self.rel_embeddings.weight[rows.first_row : rows.first_row + rows.num_rows]
            if self.LayerNorm is not None:
                rel = self.LayerNorm(rel)
        embeddings = x
        last = len(self.layer) - 1 if first_slots is not None else len(self.layer)
        if self.conv is not None and last == 0:  # the conv needs layer 0's every row
            last = len(self.layer)
        for i, layer in enumerate(self.layer[:last]):
            x = layer(x, meta, rows, rel)
            if i == 0 and self.conv is not None:
                x = self.conv(embeddings, x, meta)
        if first_slots is None:
            return x
        if last == len(self.layer):
            return x.index_select(0, first_slots)
        return self.layer[-1].forward_first_tokens(x, meta, rows, rel, first_slots)


class DebertaV2Model(nn.Module):
    """The DeBERTa-v2 / v3 body: packed ids → hidden states [num_tokens, hidden] (an
    EncoderModel, models/interfaces.py)."""

    is_causal: ClassVar[bool] = False
    default_pooling_type = "CLS"
    supports_first_token_only = True
    """forward(..., first_token_only=True): each sequence's first row, the last layer computing
    only those rows (CLS pooling, the classification head)."""
    body_prefix = "deberta."

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = DebertaV2Embeddings(config)
        self.encoder = DebertaV2Encoder(config)
        self.attention_backend: EncoderAttentionBackend = BUCKETED_SDPA
        """Its builder lays the step out in padded buckets; the layers attend them themselves."""

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        """The disentangled attention runs per padded bucket: it needs PADDED_BUCKETS."""
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        return AttentionSpec(
            device,
            dtype,
            head_dim,
            self.config.max_position_embeddings,
            needs=frozenset({PADDED_BUCKETS}),
        )

    def set_attention_backend(self, backend: EncoderAttentionBackend) -> None:
        self.attention_backend = backend

    def int8_layout(self) -> Int8Layout:
        """int8 (models/quantizable.py): BERT's post-LN stack with the position projections;
        the QKV outputs stay fresh tensors (never measured with a reused buffer), and the
        embedding projection (embedding_size != hidden_size) is int8 too."""
        layout = post_ln_stack_layout("encoder.layer.", self.encoder.layer, reuse_qkv_output=False)
        if self.embeddings.embed_proj is None:
            return layout
        roles = {"embeddings.embed_proj": PROJECTION, **layout.roles}
        return Int8Layout(roles, layout.handoffs, layout.shared_outputs)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: EncoderAttentionMetadata,
        token_type_ids: torch.Tensor | None = None,
        first_token_only: bool = False,
    ) -> torch.Tensor:
        """`attn_metadata`: the padded buckets (PADDED_BUCKETS) its backend's builder made."""
        if any(b.gather_index is not None for b in attn_metadata.buckets):
            raise ValueError("DeBERTa-v2 runs on padded buckets (metadata.pad_buckets' layout)")
        rows = attn_metadata.rows
        types = rows.gather(token_type_ids)
        x = self.embeddings(rows.gather(input_ids), rows.gather(positions), types)
        if first_token_only:
            return self.encoder(x, attn_metadata, rows.first_rows)
        return rows.to_tokens(self.encoder(x, attn_metadata))

    def map_weight_name(self, name: str) -> str | None:
        name = name.removeprefix(self.body_prefix)
        if not name.startswith(("embeddings.", "encoder.")) or name.endswith("position_ids"):
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_fused_weights(self, weights, self.map_weight_name, _QKV, equal_thirds)


class DebertaV2ForSequenceClassification(EncoderWithHead):
    """A DeBERTa cross-encoder: first token → ContextPooler (dense → pooler_hidden_act) →
    classifier (an EncoderModel and a ClassifierHead)."""

    body_cls = DebertaV2Model

    def __init__(self, config) -> None:
        super().__init__(config)
        pooler_size = getattr(config, "pooler_hidden_size", None) or config.hidden_size
        self.pooler_dense = nn.Linear(pooler_size, pooler_size)
        self.pooler_act = get_activation(getattr(config, "pooler_hidden_act", "gelu"))
        self.classifier = nn.Linear(pooler_size, config.num_labels)

    def compute_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """pooled: [num_seqs, hidden] (the first tokens' states) → [num_seqs, num_labels]."""
        return self.classifier(self.pooler_act(self.pooler_dense(pooled)))

    def int8_layout(self) -> Int8Layout:
        return self.body_int8_layout()

    head_names = {
        "pooler.dense.weight": "pooler_dense.weight",
        "pooler.dense.bias": "pooler_dense.bias",
        "classifier.weight": "classifier.weight",
        "classifier.bias": "classifier.bias",
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_fused_weights(self, weights, self.map_weight_name, _QKV, equal_thirds)


class DebertaV2ForTokenClassification(BertForTokenClassification):
    """A DeBERTa per-token classifier (NER): token state → classifier (dropout is identity at
    inference); the pooler runs it per text (output_heads/token_classifier.py)."""

    body_cls = DebertaV2Model
    supports_first_token_only = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_fused_weights(self, weights, self.map_weight_name, _QKV, equal_thirds)


_QKV = qkv_markers(".attention.self.", "query_proj", "key_proj", "value_proj")
