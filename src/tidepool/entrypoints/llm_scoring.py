"""`LLM.score` for bi-encoders: cosine of embeddings, MaxSim of ColBERT vectors, and the prompts
of each side.

    prompt_name            data_1's prompt (the query side)
    document_prompt_name   data_2's prompt (the document side)

As sentence-transformers: a bi-encoder embeds data_1 as `encode_query(prompt_name=)` and data_2
as `encode_document(prompt_name=)` would, each side with its own prompt (neither given: the
model's default prompt on both, as before); a cross-encoder gets prompt_name's text before each
data_1 text, as `CrossEncoder.predict(prompt_name=)` puts it before the first text of each pair
(document_prompt_name before each data_2 text). A ColBERT model's sides are its "query" and
"document" encodings already; other names are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tidepool.config import ModelConfig
from tidepool.engine.pooling import (
    cosine_scores,
    maxsim_scores,
    pair_failures,
    plan_embedding_scores,
    plan_late_interaction_scores,
)
from tidepool.engine.prompts import check_prompt_name
from tidepool.entrypoints.llm_outputs import late_interaction_failures, pair_score_outputs
from tidepool.outputs import BatchInputError, PoolingRequestOutput, RequestError
from tidepool.outputs import ScoringRequestOutput as ScoreOut
from tidepool.utils.lists import filled

Encode = Callable[
    [list[Any], str, str | None], tuple[list[PoolingRequestOutput | None], list[RequestError]]
]
"""(texts, pooling task, prompt name) → the LLM's outputs per text and its per-text errors."""


def check_score_prompts(
    model_config: ModelConfig, prompt_name: str | None, document_prompt_name: str | None
) -> None:
    """ValueError for a name the model lacks, or for a ColBERT side given another role."""
    for name in (prompt_name, document_prompt_name):
        check_prompt_name(model_config, name)
    if model_config.multi_vector is not None and (
        prompt_name not in (None, "query") or document_prompt_name not in (None, "document")
    ):
        raise ValueError(
            "a ColBERT model scores data_1 as queries and data_2 as documents: prompt_name "
            f"may be 'query' and document_prompt_name 'document' only, got {prompt_name!r} and "
            f"{document_prompt_name!r}"
        )


def prompted_pairs(
    model_config: ModelConfig,
    pairs: list[tuple[Any, Any]],
    prompt_name: str | None,
    document_prompt_name: str | None,
) -> list[tuple[Any, Any]]:
    """Cross-encoder pairs with each side's prompt text in front (CrossEncoder.predict's rule;
    names checked). Non-string sides are left for the input processor to refuse."""
    if prompt_name is None and document_prompt_name is None:
        return pairs
    prompts = model_config.st.prompts
    first = prompts[prompt_name] if prompt_name is not None else ""
    second = prompts[document_prompt_name] if document_prompt_name is not None else ""

    def put(prefix: str, text: Any) -> Any:
        return prefix + text if isinstance(text, str) and text else text

    return [(put(first, a), put(second, b)) for a, b in pairs]


def score_by_embedding(
    pairs: list[tuple[Any, Any]],
    encode: Encode,
    prompt_name: str | None,
    document_prompt_name: str | None,
) -> list[ScoreOut]:
    """Cosine of the two sides' embeddings; each distinct text embedded once (once per side
    when the sides have prompts of their own)."""
    if prompt_name is None and document_prompt_name is None:
        plan = plan_embedding_scores(pairs)
        results, text_errors = encode(plan.texts, "embed", None)
        embeddings = [None if r is None else r.outputs.data for r in results]
        scores = cosine_scores(embeddings, plan.pair_slots)
        failures = pair_failures(plan.pair_slots, {e.index: e.message for e in text_errors})
        outputs = pair_score_outputs(results, results, plan.pair_slots, scores)
        if failures:
            errors = [RequestError(i, message) for i, message in sorted(failures.items())]
            raise BatchInputError(errors, outputs)
        return filled(outputs)
    sides = plan_late_interaction_scores(pairs)
    queries, query_errors = encode(sides.queries, "embed", prompt_name)
    documents, document_errors = encode(sides.documents, "embed", document_prompt_name)
    num_queries = len(queries)
    embeddings = [None if r is None else r.outputs.data for r in [*queries, *documents]]
    slots = [(q, num_queries + d) for q, d in sides.pair_slots]
    scores = cosine_scores(embeddings, slots)
    return _outputs(queries, documents, sides.pair_slots, scores, query_errors, document_errors)


def score_by_late_interaction(
    pairs: list[tuple[Any, Any]],
    encode: Encode,
    query_prompt: str | None = "query",
    document_prompt: str | None = "document",
) -> list[ScoreOut]:
    """MaxSim of data_1's and data_2's token vectors (a ColBERT model encodes them as queries
    and documents; another token_embed model with the given prompts)."""
    plan = plan_late_interaction_scores(pairs)
    queries, query_errors = encode(plan.queries, "token_embed", query_prompt)
    documents, document_errors = encode(plan.documents, "token_embed", document_prompt)
    scores = maxsim_scores(
        [None if r is None else r.outputs.data for r in queries],
        [None if r is None else r.outputs.data for r in documents],
        plan.pair_slots,
    )
    return _outputs(queries, documents, plan.pair_slots, scores, query_errors, document_errors)


def _outputs(
    queries: Sequence[PoolingRequestOutput | None],
    documents: Sequence[PoolingRequestOutput | None],
    pair_slots: list[tuple[int, int]],
    scores: Sequence[float | None],
    query_errors: list[RequestError],
    document_errors: list[RequestError],
) -> list[ScoreOut]:
    failures = late_interaction_failures(pair_slots, query_errors, document_errors)
    outputs = pair_score_outputs(queries, documents, pair_slots, scores)
    if failures:
        raise BatchInputError(failures, outputs)
    return filled(outputs)
