"""Poolers that read one text's token rows: sparse embeddings, multi-vector, per-token labels.

Registered by (output head, task) (config.OUTPUT_HEADS); the Pooler (worker/pooler.py) slices each
request's rows and calls the entry of its model's head. Every entry returns a CPU float32 tensor:

    (splade, embed_sparse)      MLM logits [len, vocab] → max over tokens → log(1 + relu(·))
                                → sparse [vocab] (top-k when asked)
    (bge_m3, embed_sparse)      relu(sparse_linear(h)) [len] → max per token id, special tokens
                                dropped → sparse [vocab]   (FlagEmbedding's lexical weights)
    (bge_m3, token_classify)    the same weights per token, first / last rows (<s>, </s>) dropped
                                → [len - 2, 1]             (vLLM's BGE-M3 token_classify)
    (bge_m3, token_embed)       colbert_linear(h[1:]) normalized → [len - 1, dim]
    (token_classifier, token_classify)  logits → softmax → [len, num_labels]
    (task, token_embed)         the hidden rows (Dense, normalize) → [len, dim]

Sparse outputs are coalesced `torch.sparse_coo_tensor`s of shape [vocab]: `.indices()[0]` the
token ids (ascending), `.values()` their weights (> 0).

Worked example (SPLADE max pooling): log(1 + relu(x)) never decreases in x, so the maximum over
the tokens of the transformed logits is the transform of the maximum logit: the pooler takes
`amax` over the [len, vocab] logits first and transforms [vocab] values, not [len, vocab].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tidepool.config import SparseHeadConfig
from tidepool.models.interfaces import TokenClassifierHead, TokenWeightHead, VocabLogitsHead
from tidepool.params import PoolingParams

if TYPE_CHECKING:
    from tidepool.worker.pooler import Pooler

TokenPooler = Callable[["Pooler", torch.Tensor, "torch.Tensor | None", PoolingParams], torch.Tensor]
"""(pooler, rows [len, hidden] of one text, its token ids [len] or None, params) → output."""


def to_sparse(weights: torch.Tensor, max_active_dims: int | None) -> torch.Tensor:
    """weights [vocab] (>= 0) → a coalesced sparse [vocab] of its non-zero entries, keeping the
    largest `max_active_dims` (sentence-transformers' select_max_active_dims) when given."""
    weights = weights.float().cpu()
    if max_active_dims is not None and max_active_dims < weights.numel():
        top = torch.topk(weights, max_active_dims).indices
        kept = torch.zeros_like(weights)
        kept[top] = weights[top]
        weights = kept
    ids = torch.nonzero(weights, as_tuple=True)[0]
    # The ids are unique and ascending by construction: no invariant checks needed.
    return torch.sparse_coo_tensor(
        ids[None], weights[ids], weights.shape, is_coalesced=True, check_invariants=False
    )


def _splade_activation(x: torch.Tensor, cfg: SparseHeadConfig) -> torch.Tensor:
    x = torch.log1p(torch.relu(x))
    return torch.log1p(x) if cfg.activation_function == "log1p_relu" else x


def splade_sparse(
    pooler: Pooler, rows: torch.Tensor, ids: torch.Tensor | None, params: PoolingParams
) -> torch.Tensor:
    cfg = pooler.model_config.sparse or SparseHeadConfig()
    logits = pooler.model.compute_vocab_logits(rows).float()  # type: ignore[union-attr]
    if cfg.pooling_strategy == "max":
        weights = _splade_activation(logits.amax(dim=0), cfg)  # monotone: see module docstring
    else:
        weights = _splade_activation(logits, cfg).sum(dim=0)
    return to_sparse(weights, params.max_active_dims)


def _m3_token_weights(pooler: Pooler, rows: torch.Tensor) -> torch.Tensor:
    return pooler.model.compute_token_weights(rows).float()  # type: ignore[union-attr]


def bge_m3_sparse(
    pooler: Pooler, rows: torch.Tensor, ids: torch.Tensor | None, params: PoolingParams
) -> torch.Tensor:
    if ids is None:
        raise ValueError("BGE-M3 sparse weights need the prompt's token ids")
    cfg = pooler.model_config.sparse or SparseHeadConfig()
    weights = _m3_token_weights(pooler, rows)
    if cfg.skip_token_ids:
        skip = torch.tensor(cfg.skip_token_ids, device=ids.device)
        weights = weights.masked_fill(torch.isin(ids, skip), 0.0)
    vocab = pooler.model_config.hf_config.vocab_size
    per_id = weights.new_zeros(vocab).scatter_reduce_(0, ids, weights, "amax", include_self=True)
    return to_sparse(per_id, params.max_active_dims)


def bge_m3_token_weights(
    pooler: Pooler, rows: torch.Tensor, ids: torch.Tensor | None, params: PoolingParams
) -> torch.Tensor:
    # vLLM's BGE-M3 token_classify: the BOS and EOS rows filtered out, one weight per token.
    return _m3_token_weights(pooler, rows[1:-1])[:, None].cpu()


def bge_m3_colbert(
    pooler: Pooler, rows: torch.Tensor, ids: torch.Tensor | None, params: PoolingParams
) -> torch.Tensor:
    vectors = pooler.model.compute_token_vectors(rows[1:]).float()  # type: ignore[union-attr]
    return pooler.finish_embedding(vectors.cpu(), params)


def token_classify(
    pooler: Pooler, rows: torch.Tensor, ids: torch.Tensor | None, params: PoolingParams
) -> torch.Tensor:
    logits = pooler.model.compute_token_logits(rows).float()  # type: ignore[union-attr]
    return pooler.finish_logits(logits.cpu(), params)


def token_embed(
    pooler: Pooler, rows: torch.Tensor, ids: torch.Tensor | None, params: PoolingParams
) -> torch.Tensor:
    return pooler.finish_embedding(pooler.apply_dense(rows.float()).cpu(), params)


TOKEN_POOLERS: dict[tuple[str, str], TokenPooler] = {
    ("task", "token_embed"): token_embed,
    ("splade", "embed_sparse"): splade_sparse,
    ("bge_m3", "embed_sparse"): bge_m3_sparse,
    ("bge_m3", "token_classify"): bge_m3_token_weights,
    ("bge_m3", "token_embed"): bge_m3_colbert,
    ("token_classifier", "token_classify"): token_classify,
}
"""(output head, task) → the pooler of that task's rows."""


_HEAD_PROTOCOLS: dict[str, tuple[type, str]] = {
    "splade": (VocabLogitsHead, "MLM head (compute_vocab_logits)"),
    "bge_m3": (TokenWeightHead, "sparse_linear head (compute_token_weights)"),
    "token_classifier": (TokenClassifierHead, "per-token classifier head (compute_token_logits)"),
}


def check_head(output_head: str, model: object) -> None:
    """TypeError when `model` lacks the head its config's output head needs."""
    needed = _HEAD_PROTOCOLS.get(output_head)
    if needed is not None and not isinstance(model, needed[0]):
        raise TypeError(f"{type(model).__name__} has no {needed[1]}: it cannot serve {output_head}")
