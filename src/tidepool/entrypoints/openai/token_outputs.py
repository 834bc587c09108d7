"""The response data of outputs beyond one vector per input, shared by the routes that return
them: sparse index / value pairs (TEI's /embed_sparse, /pooling's embed_sparse) and per-token
labels (/classify on a token classification model):

    /embed_sparse  → [[{"index": token id, "value": weight}, ...], ...]   (TEI's shape)
    /pooling       task "embed_sparse" → data [{"index", "value"}, ...] per input;
                   task "token_classify" → data [num_tokens][num_labels] per input (vLLM's)
    /classify      on a token classifier: per input, probs [num_tokens][num_labels] and one
                   label per token
"""

from __future__ import annotations

import torch

from tidepool.entrypoints.openai import protocol as p
from tidepool.entrypoints.openai import protocol_tei as pt
from tidepool.entrypoints.openai.errors import ApiError
from tidepool.outputs import PoolingRequestOutput, sparse_pairs


def sparse_values(data: torch.Tensor) -> list[pt.SparseValue]:
    """A sparse [vocab] output → TEI's [{"index": id, "value": weight}, ...] (ids ascending)."""
    ids, values = sparse_pairs(data)
    return [pt.SparseValue(index=i, value=v) for i, v in zip(ids, values, strict=True)]


def sparse_pooling_data(data: torch.Tensor, encoding_format: str) -> list[dict]:
    """A /pooling `data` item of a sparse output: TEI's index / value pairs."""
    if encoding_format == "base64":
        raise ApiError(
            400, "encoding_format base64 is not available for sparse outputs", "encoding_format"
        )
    return [v.model_dump() for v in sparse_values(data)]


def token_classification_data(
    outputs: list[PoolingRequestOutput], id2label: dict
) -> list[p.ClassificationData]:
    """/classify on a token classifier: per input, each token's probabilities and label."""
    data = []
    for i, o in enumerate(outputs):
        probs = o.outputs.data
        best = probs.argmax(dim=-1).tolist()
        labels = [id2label.get(b, id2label.get(str(b), f"LABEL_{b}")) for b in best]
        data.append(
            p.ClassificationData(
                index=i, label=labels, probs=probs.tolist(), num_classes=probs.shape[-1]
            )
        )
    return data
