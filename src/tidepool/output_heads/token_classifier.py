"""The "token_classifier" head: a *ForTokenClassification checkpoint's per-token labels.

    token_classify   logits [len, num_labels] → softmax (one label: sigmoid) → same shape

The pooler calls it on each text's token rows.
"""

from __future__ import annotations

import torch

from tidepool.models.interfaces import TokenClassifierHead
from tidepool.output_heads.base import Checkpoint, HeadChoice, OutputHead, PoolerContext
from tidepool.params import PoolingParams


def token_classify(
    model: TokenClassifierHead,
    pooler: PoolerContext,
    rows: torch.Tensor,
    ids: torch.Tensor | None,
    params: PoolingParams,
) -> torch.Tensor:
    logits = model.compute_token_logits(rows).float()
    return pooler.finish_logits(logits.cpu(), params)


def detect(checkpoint: Checkpoint) -> HeadChoice | None:
    """Any *ForTokenClassification architecture (on every implementation)."""
    if checkpoint.may_take_a_head and checkpoint.architecture.endswith("ForTokenClassification"):
        return HeadChoice("classify", checkpoint.architecture, "token_classifier")
    return None


TOKEN_CLASSIFIER = OutputHead(
    name="token_classifier",
    tasks=("token_classify",),
    protocol=TokenClassifierHead,
    provides="per-token classifier head (compute_token_logits)",
    token_poolers={"token_classify": token_classify},
    detect=detect,
    kind="a token classification model",
    label="*ForTokenClassification",
    task_needs={"token_classify": "a token classification model"},
)
