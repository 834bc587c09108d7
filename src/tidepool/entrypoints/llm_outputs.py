"""The offline API's outputs from the driver's results: score outputs per pair, the failures of
pairs whose texts failed, and the completions a generate call runs (n > 1 as n requests)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tidepool.outputs import (
    PoolingRequestOutput,
    RequestError,
    ScoringOutput,
    ScoringRequestOutput,
)
from tidepool.params import SamplingParams


def pair_score_outputs(
    first: Sequence[PoolingRequestOutput | None],
    second: Sequence[PoolingRequestOutput | None],
    pair_slots: Sequence[tuple[int, int]],
    scores: Sequence[float | None],
) -> list[ScoringRequestOutput | None]:
    """One ScoringRequestOutput per pair from its two sides' outputs (`first[a]`, `second[b]`
    for the pair's slots (a, b)); None where a side failed or the pair has no score."""
    outputs: list[ScoringRequestOutput | None] = []
    for (a, b), score in zip(pair_slots, scores, strict=True):
        left, right = first[a], second[b]
        if score is None or left is None or right is None:
            outputs.append(None)
            continue
        outputs.append(
            ScoringRequestOutput(
                f"score-{left.request_id}-{right.request_id}",
                left.prompt_token_ids + right.prompt_token_ids,
                ScoringOutput(score),
            )
        )
    return outputs


def late_interaction_failures(
    pair_slots: list[tuple[int, int]],
    query_errors: list[RequestError],
    document_errors: list[RequestError],
) -> list[RequestError]:
    """Per pair whose query or document failed, why (both sides' messages)."""
    failed_q = {e.index: e.message for e in query_errors}
    failed_d = {e.index: e.message for e in document_errors}
    errors = []
    for i, (q, d) in enumerate(pair_slots):
        bad = [f"data_1: {failed_q[q]}"] if q in failed_q else []
        bad += [f"data_2: {failed_d[d]}"] if d in failed_d else []
        if bad:
            errors.append(RequestError(i, "; ".join(bad)))
    return errors


def prompt_text(prompt: Any) -> str | None:
    """The text of a prompt (echoed in RequestOutput.prompt); None for token ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return None


def completions(
    num_prompts: int, sampling_params: SamplingParams | Sequence[SamplingParams] | None
) -> list[tuple[int, int, SamplingParams]]:
    """(prompt index, completion index, its parameters) of every completion to run: n > 1 runs
    as n requests of n=1; a seeded request gives completion k the seed + k, as vLLM does."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    params = (
        [sampling_params] * num_prompts
        if isinstance(sampling_params, SamplingParams)
        else list(sampling_params)
    )
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} sampling_params for {num_prompts} prompts")
    return [
        (i, k, p if p.n == 1 else replace(p, n=1, seed=None if p.seed is None else p.seed + k))
        for i, p in enumerate(params)
        for k in range(p.n)
    ]
