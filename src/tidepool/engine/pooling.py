"""Scoring rules shared by the offline `LLM` and the server: which rule scores a pair, pair
expansion, cross-encoder scores, cosine of embeddings, MaxSim of token vectors.

Pure functions: callers run the requests their own way (the offline loop, or awaiting the async
engine) and combine the results here. Scoring by embedding, for example:

    pairs = expand_score_pairs(queries, docs)              # 1-to-N or N-to-N
    plan = plan_embedding_scores(pairs)                    # each distinct text once
    embeddings = <embed plan.texts>                        # None where a text failed
    scores = cosine_scores(embeddings, plan.pair_slots)    # one float (or None) per pair

A ColBERT model (ModelConfig.multi_vector) scores by late interaction instead: queries and
documents are encoded apart (prompt_name "query" / "document"), and MaxSim sums, over the query's
vectors, the best dot product with any of the document's:

    plan = plan_late_interaction_scores(pairs)             # distinct queries, distinct documents
    <token_embed plan.queries as queries, plan.documents as documents>
    scores = maxsim_scores(query_vectors, document_vectors, plan.pair_slots)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

T = TypeVar("T")


def scoring_rule(model_task: str, multi_vector: bool, default_task: str | None = None) -> str:
    """How `score` / `rerank` score a pair: "cross_encoder" (the pair read together),
    "late_interaction" (MaxSim of token vectors: a ColBERT model, or a model whose pooling task
    is token_embed, as vLLM scores it) or "cosine" (of two embeddings)."""
    if model_task == "classify":
        return "cross_encoder"
    late = multi_vector or default_task == "token_embed"
    return "late_interaction" if late else "cosine"


def expand_score_pairs(
    first: Sequence[T], second: Sequence[T], names: tuple[str, str] = ("data_1", "data_2")
) -> list[tuple[T, T]]:
    """The (first, second) pairs to score: 1-to-N when `first` has one item, else N-to-N.
    ValueError (naming the two sides as `names`) when the counts do not match either way."""
    if len(first) == 1:
        first = list(first) * len(second)
    elif len(first) != len(second):
        raise ValueError(
            f"{names[0]} has {len(first)} items and {names[1]} {len(second)}: give one "
            f"{names[0]} item (1-to-N) or as many as {names[1]} (N-to-N)"
        )
    return list(zip(first, second, strict=True))


def cross_encoder_score(data: torch.Tensor) -> float:
    """A cross-encoder's score of one pair from its pooled output (one label)."""
    return float(data.reshape(-1)[0])


@dataclass(frozen=True)
class EmbeddingScorePlan:
    """What to embed to score pairs by cosine."""

    texts: list[Any]
    """Each distinct text once, in first-seen order (1-to-N embeds the query once). Strings are
    compared by value, other prompts (dicts) by identity."""
    pair_slots: list[tuple[int, int]]
    """Per pair, the places of its two texts in `texts`."""


def plan_embedding_scores(pairs: Sequence[tuple[Any, Any]]) -> EmbeddingScorePlan:
    texts: list[Any] = []
    slot_of: dict[Any, int] = {}
    pair_slots = []
    for pair in pairs:
        slots = []
        for text in pair:
            key = text if isinstance(text, str) else id(text)
            if key not in slot_of:
                slot_of[key] = len(texts)
                texts.append(text)
            slots.append(slot_of[key])
        pair_slots.append((slots[0], slots[1]))
    return EmbeddingScorePlan(texts, pair_slots)


def cosine_scores(
    embeddings: Sequence[torch.Tensor | None], pair_slots: Sequence[tuple[int, int]]
) -> list[float | None]:
    """Per pair, the cosine of its two texts' embeddings (one batched op); None where either
    embedding is missing (its text failed). A non-finite cosine (a zero vector) scores 0.0."""
    present = [i for i, e in enumerate(embeddings) if e is not None]
    row_of = {slot: row for row, slot in enumerate(present)}
    scored = [i for i, (a, b) in enumerate(pair_slots) if a in row_of and b in row_of]
    scores: list[float | None] = [None] * len(pair_slots)
    if not scored:
        return scores
    stacked = torch.stack([embeddings[i] for i in present])
    left = stacked[[row_of[pair_slots[i][0]] for i in scored]]
    right = stacked[[row_of[pair_slots[i][1]] for i in scored]]
    for i, score in zip(scored, F.cosine_similarity(left, right, dim=-1).tolist(), strict=True):
        scores[i] = score if math.isfinite(score) else 0.0
    return scores


def pair_failures(
    pair_slots: Sequence[tuple[int, int]],
    failed: dict[int, str],
    names: tuple[str, str] = ("data_1", "data_2"),
) -> dict[int, str]:
    """pair index → why it cannot be scored by embedding (the failure of each side's text), for
    the pairs a failed text belongs to. `failed`: text slot → its error message."""
    reasons = {}
    for index, slots in enumerate(pair_slots):
        bad = [f"{name}: {failed[s]}" for name, s in zip(names, slots, strict=True) if s in failed]
        if bad:
            reasons[index] = "; ".join(bad)
    return reasons


@dataclass(frozen=True)
class LateInteractionPlan:
    """What to encode to score pairs by MaxSim."""

    queries: list[Any]
    """Each distinct first text once (encoded as a query)."""
    documents: list[Any]
    """Each distinct second text once (encoded as a document)."""
    pair_slots: list[tuple[int, int]]
    """Per pair, (its query's place in `queries`, its document's place in `documents`)."""


def plan_late_interaction_scores(pairs: Sequence[tuple[Any, Any]]) -> LateInteractionPlan:
    queries = plan_embedding_scores([(q, q) for q, _ in pairs])
    documents = plan_embedding_scores([(d, d) for _, d in pairs])
    pair_slots = [
        (q[0], d[0]) for q, d in zip(queries.pair_slots, documents.pair_slots, strict=True)
    ]
    return LateInteractionPlan(queries.texts, documents.texts, pair_slots)


def maxsim(query: torch.Tensor, document: torch.Tensor) -> float:
    """Late interaction (ColBERT's MaxSim): query [num_q, dim], document [num_d, dim] →
    sum over query vectors of the largest dot product with a document vector."""
    if document.shape[0] == 0:
        return 0.0
    return float((query.float() @ document.float().T).amax(dim=1).sum())


def maxsim_scores(
    queries: Sequence[torch.Tensor | None],
    documents: Sequence[torch.Tensor | None],
    pair_slots: Sequence[tuple[int, int]],
) -> list[float | None]:
    """Per pair, MaxSim of its query's and its document's vectors; None where either is missing
    (its text failed)."""
    scores: list[float | None] = []
    for q, d in pair_slots:
        query, document = queries[q], documents[d]
        scores.append(None if query is None or document is None else maxsim(query, document))
    return scores
