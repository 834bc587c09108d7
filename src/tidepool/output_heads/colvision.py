"""The "colvision" head: ColPali-family retrievers (ColQwen2, ColPali): one vector per image and text
token from the model's own projection, normalized; scored by MaxSim (engine/pooling.py).

    token_embed   rows [len, hidden] → compute_token_vectors → [len, dim] → L2 per token

transformers' ColQwen2ForRetrieval / ColPaliForRetrieval(...).embeddings are these vectors (its padding rows zeroed).
"""

from __future__ import annotations

import torch

from tidepool.models.interfaces import TokenVectorHead
from tidepool.output_heads.base import Checkpoint, HeadChoice, OutputHead, PoolerContext
from tidepool.params import PoolingParams

COLVISION_ARCHITECTURES = ("ColQwen2ForRetrieval", "ColPaliForRetrieval")
"""The checkpoints' architectures this head serves (each a native model with the projection)."""


def token_embed(
    model: TokenVectorHead,
    pooler: PoolerContext,
    rows: torch.Tensor,
    ids: torch.Tensor | None,
    params: PoolingParams,
) -> torch.Tensor:
    vectors = model.compute_token_vectors(rows).float().cpu()
    return pooler.finish_embedding(vectors, params)


def detect(checkpoint: Checkpoint) -> HeadChoice | None:
    if checkpoint.may_take_a_head and checkpoint.architecture in COLVISION_ARCHITECTURES:
        return HeadChoice("embed", checkpoint.architecture, "colvision")
    return None


COLVISION = OutputHead(
    name="colvision",
    tasks=("token_embed",),
    protocol=TokenVectorHead,
    provides="per-token projection (compute_token_vectors)",
    token_poolers={"token_embed": token_embed},
    detect=detect,
    kind="a visual document retriever (ColQwen2, ColPali)",
    label="ColQwen2 / ColPali",
    task_needs={"token_embed": "an embedding model"},
)
