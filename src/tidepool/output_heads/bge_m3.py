"""The "bge_m3" head: BGE-M3 (an XLM-R body with FlagEmbedding's sparse_linear.pt and
colbert_linear.pt beside it) serves dense, sparse and multi-vector outputs from one forward.

    embed           the CLS row (the pooler's sequence path)
    embed_sparse    relu(sparse_linear(h)) [len] → max per token id, special tokens dropped
                    → sparse [vocab]             (FlagEmbedding's lexical weights)
    token_classify  the same weights per token, first / last rows (<s>, </s>) dropped
                    → [len - 2, 1]               (vLLM's BGE-M3 token_classify)
    token_embed     colbert_linear(h[1:]) normalized → [len - 1, dim]
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from tidepool.config import SparseHeadConfig
from tidepool.models.interfaces import TokenVectorHead, TokenWeightHead
from tidepool.output_heads.base import (
    Checkpoint,
    HeadChoice,
    OutputHead,
    PoolerContext,
    to_sparse,
)
from tidepool.params import PoolingParams


@runtime_checkable
class BgeM3Heads(TokenWeightHead, TokenVectorHead, Protocol):
    """BGE-M3's two projections: lexical weights and ColBERT vectors."""


def bge_m3_sparse(
    model: BgeM3Heads,
    pooler: PoolerContext,
    rows: torch.Tensor,
    ids: torch.Tensor | None,
    params: PoolingParams,
) -> torch.Tensor:
    if ids is None:
        raise ValueError("BGE-M3 sparse weights need the prompt's token ids")
    cfg = pooler.model_config.sparse or SparseHeadConfig()
    weights = model.compute_token_weights(rows).float()
    if cfg.skip_token_ids:
        skip = torch.tensor(cfg.skip_token_ids, device=ids.device)
        weights = weights.masked_fill(torch.isin(ids, skip), 0.0)
    vocab = pooler.model_config.hf_config.vocab_size
    per_id = weights.new_zeros(vocab).scatter_reduce_(0, ids, weights, "amax", include_self=True)
    return to_sparse(per_id, params.max_active_dims)


def bge_m3_token_weights(
    model: BgeM3Heads,
    pooler: PoolerContext,
    rows: torch.Tensor,
    ids: torch.Tensor | None,
    params: PoolingParams,
) -> torch.Tensor:
    # vLLM's BGE-M3 token_classify: the BOS and EOS rows filtered out, one weight per token.
    return model.compute_token_weights(rows[1:-1]).float()[:, None].cpu()


def bge_m3_colbert(
    model: BgeM3Heads,
    pooler: PoolerContext,
    rows: torch.Tensor,
    ids: torch.Tensor | None,
    params: PoolingParams,
) -> torch.Tensor:
    vectors = model.compute_token_vectors(rows[1:]).float()
    return pooler.finish_embedding(vectors.cpu(), params)


def skipped_ids(path: Path) -> tuple[int, ...]:
    """The ids FlagEmbedding drops from BGE-M3's lexical weights: CLS, EOS, PAD, UNK."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    names = ("cls_token", "eos_token", "pad_token", "unk_token")
    tokens = [getattr(tokenizer, name, None) for name in names]
    return tuple(sorted({int(tokenizer.convert_tokens_to_ids(t)) for t in tokens if t is not None}))


def detect(checkpoint: Checkpoint) -> HeadChoice | None:
    """An XLM-R embedder with sparse_linear.pt and colbert_linear.pt in its folder (native
    models only)."""
    if not checkpoint.may_take_a_head or checkpoint.model_impl == "transformers":
        return None
    path = checkpoint.path
    if (
        checkpoint.task == "embed"
        and checkpoint.resolved_architecture == "XLMRobertaModel"
        and (path / "sparse_linear.pt").is_file()
        and (path / "colbert_linear.pt").is_file()
    ):
        settings = SparseHeadConfig(skip_token_ids=skipped_ids(path))
        return HeadChoice("embed", "BgeM3EmbeddingModel", "bge_m3", settings)
    return None


BGE_M3 = OutputHead(
    name="bge_m3",
    tasks=("embed", "embed_sparse", "token_embed", "token_classify"),
    protocol=BgeM3Heads,
    provides="sparse_linear and colbert_linear heads (compute_token_weights, "
    "compute_token_vectors)",
    token_poolers={
        "embed_sparse": bge_m3_sparse,
        "token_classify": bge_m3_token_weights,
        "token_embed": bge_m3_colbert,
    },
    detect=detect,
    kind="a BGE-M3 model",
    label="BGE-M3",
)
