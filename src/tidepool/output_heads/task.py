"""The "task" head: the outputs a model's own task implies (embeddings, sequence logits, LM
logits); its tasks follow from the model (ModelConfig.pooling_tasks), and its one token pooler
returns each token's hidden row (token_embed: Dense, normalize) → [len, dim]."""

from __future__ import annotations

import torch

from tidepool.output_heads.base import OutputHead, PoolerContext
from tidepool.params import PoolingParams


def token_embed(
    model: object,
    pooler: PoolerContext,
    rows: torch.Tensor,
    ids: torch.Tensor | None,
    params: PoolingParams,
) -> torch.Tensor:
    return pooler.finish_embedding(pooler.apply_dense(rows.float()).cpu(), params)


TASK_HEAD = OutputHead(
    name="task",
    tasks=(),
    protocol=object,
    provides="",
    token_poolers={"token_embed": token_embed},
    task_needs={
        "embed": "an embedding model",
        "token_embed": "an embedding model",
        "classify": "a model with a classification head",
        "score": "a cross-encoder (a classification head with one label) or an embedding model",
    },
)
