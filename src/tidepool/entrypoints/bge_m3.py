"""BGE-M3's combined relevance score offline: FlagEmbedding's `BGEM3FlagModel.compute_score` on a
tidepool `LLM` (exported as `tidepool.bge_m3_compute_score`).

    from tidepool import LLM, bge_m3_compute_score
    llm = LLM("BAAI/bge-m3")
    bge_m3_compute_score(llm, [(query, passage), ...], weights_for_different_modes=[0.4, 0.2, 0.4])
    → {"dense": [...], "sparse": [...], "colbert": [...], "sparse+dense": [...],
       "colbert+sparse+dense": [...]}

Per pair, as FlagEmbedding scores it: dense = the dot product of the normalized CLS vectors;
sparse = the sum over shared token ids of the product of their lexical weights; colbert = the
sum over the query's ColBERT vectors of the largest dot product with a passage vector, divided
by the number of query vectors; the two mixes are weighted means with weights (dense, sparse,
colbert), default [1, 1, 1]. FlagEmbedding pads a batch's passages with zero vectors, so where
every real dot product of a query vector is negative its colbert score depends on the batch
(the padding's 0 wins); tidepool scores each pair alone, as FlagEmbedding with batch_size=1.
Texts are truncated to max_query_length / max_passage_length tokens (None: the model's length),
as FlagEmbedding truncates. Each text runs once per output (three requests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from tidepool.engine.pooling import maxsim
from tidepool.outputs import sparse_pairs
from tidepool.params import PoolingParams

if TYPE_CHECKING:
    from tidepool.entrypoints.llm import LLM

_TASKS = ("embed", "embed_sparse", "token_embed")


def bge_m3_compute_score(
    llm: LLM,
    sentence_pairs: Sequence[tuple[str, str]] | tuple[str, str],
    max_query_length: int | None = None,
    max_passage_length: int | None = None,
    weights_for_different_modes: Sequence[float] | None = None,
    use_tqdm: bool = False,
) -> dict[str, list[float]] | dict[str, float]:
    """FlagEmbedding's compute_score: the five scores of each (query, passage) pair (of the one
    pair, as floats, when given a single pair)."""
    missing = [t for t in _TASKS if t not in llm.model_config.pooling_tasks]
    if missing:
        raise ValueError(
            f"bge_m3_compute_score needs a BGE-M3 model (dense, sparse and ColBERT outputs); "
            f"this one lacks {', '.join(missing)}"
        )
    weights = [float(w) for w in (weights_for_different_modes or (1.0, 1.0, 1.0))]
    if len(weights) != 3:
        raise ValueError("weights_for_different_modes takes 3 weights: dense, sparse, colbert")
    single = isinstance(sentence_pairs, tuple) and isinstance(sentence_pairs[0], str)
    pairs = cast(list[tuple[str, str]], [sentence_pairs] if single else list(sentence_pairs))
    queries = _outputs(llm, [q for q, _ in pairs], max_query_length, use_tqdm)
    passages = _outputs(llm, [p for _, p in pairs], max_passage_length, use_tqdm)
    scores: dict[str, list[float]] = {name: [] for name in ("colbert", "sparse", "dense")}
    for q, p in zip(queries, passages, strict=True):
        scores["dense"].append(float(q["embed"].float() @ p["embed"].float()))
        scores["sparse"].append(_lexical_matching_score(q["embed_sparse"], p["embed_sparse"]))
        query_vectors = q["token_embed"]
        scores["colbert"].append(maxsim(query_vectors, p["token_embed"]) / query_vectors.shape[0])
    dense_w, sparse_w, colbert_w = weights
    scores["sparse+dense"] = [
        (s * sparse_w + d * dense_w) / (sparse_w + dense_w)
        for s, d in zip(scores["sparse"], scores["dense"], strict=True)
    ]
    scores["colbert+sparse+dense"] = [
        (c * colbert_w + s * sparse_w + d * dense_w) / sum(weights)
        for c, s, d in zip(scores["colbert"], scores["sparse"], scores["dense"], strict=True)
    ]
    if single:
        return {name: values[0] for name, values in scores.items()}
    return scores


def _lexical_matching_score(query: torch.Tensor, passage: torch.Tensor) -> float:
    """Sum over the token ids both have of the product of their weights (sparse [vocab])."""
    weights = dict(zip(*sparse_pairs(query), strict=True))
    return sum(weights[i] * w for i, w in zip(*sparse_pairs(passage), strict=True) if i in weights)


def _outputs(
    llm: LLM, texts: list[str], max_length: int | None, use_tqdm: bool
) -> list[dict[str, torch.Tensor]]:
    """Per text, its dense, sparse ([vocab]) and ColBERT outputs, from one batch."""
    truncate = -1 if max_length is None else max_length
    params = [
        PoolingParams(task=task, truncate_prompt_tokens=truncate)  # type: ignore[arg-type]
        for _ in texts
        for task in _TASKS
    ]
    prompts: list[Any] = [text for text in texts for _ in _TASKS]
    outputs = llm.encode(prompts, pooling_params=params, use_tqdm=use_tqdm)
    per_text = len(_TASKS)
    return [
        {task: outputs[i * per_text + k].outputs.data for k, task in enumerate(_TASKS)}
        for i in range(len(texts))
    ]
