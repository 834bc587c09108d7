"""Logits → next tokens, one row per generating request, in vLLM's order of processing:

    raw logprobs (if asked)  ← log_softmax of the model's logits, before anything below
    min_tokens               stop tokens masked until the request has min_tokens outputs
    penalties                repetition (prompt + output), frequency and presence (output)
    greedy rows              argmax (after penalties, before temperature)
    temperature → min_p → top_k / top_p → sample

Sampling draws one exponential variate per vocabulary entry and takes argmax(probs / q): the same
distribution as multinomial, but one batched op. A request with a seed draws its variates from its
own generator, so its tokens do not depend on what else is in the batch. When every row has a
top-k, no row a top-p and none a seed, the rows sample among their torch.topk candidates only (no sort of the
vocabulary, variates for k tokens, not for all; figures in docs/performance.md, 'Choices elsewhere in the code').
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tidepool.params import SamplingParams


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row parameters of one step's sampling (built by SamplingMetadata.build)."""

    temperature: torch.Tensor
    """[rows] float32; 1.0 on greedy rows (unused there)."""
    greedy: torch.Tensor
    """[rows] bool."""
    all_greedy: bool
    top_k: torch.Tensor | None
    """[rows] int64, vocab size where disabled; None when no row uses it."""
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    """Row → its request's generator (seeded requests only)."""
    output_token_ids: list[list[int]]
    prompt_token_ids: list[list[int]]
    penalty_rows: list[int]
    """Rows with a non-neutral penalty (the others skip the penalty ops)."""
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    repetition_penalty: torch.Tensor
    min_tokens_masks: dict[int, list[int]]
    """Row → stop token ids to mask this step (the request has fewer than min_tokens outputs)."""
    num_logprobs: list[int | None]
    """Row → top logprobs to return (None: no logprobs)."""

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        stop_token_ids: Sequence[Sequence[int]],
        generators: dict[int, torch.Generator],
        vocab_size: int,
    ) -> SamplingMetadata:
        """stop_token_ids[i]: row i's EOS ids (unless ignore_eos) plus its stop_token_ids."""
        greedy = [p.greedy for p in params]
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        penalty_rows = [i for i, p in enumerate(params) if p.has_penalties]
        min_tokens_masks = {
            i: list(stop_token_ids[i])
            for i, p in enumerate(params)
            if p.min_tokens and len(output_token_ids[i]) < p.min_tokens and stop_token_ids[i]
        }
        return cls(
            temperature=torch.tensor(
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
            ),
            greedy=torch.tensor(greedy),
            all_greedy=all(greedy),
            top_k=torch.tensor(top_k) if any(k < vocab_size for k in top_k) else None,
            top_p=torch.tensor([p.top_p for p in params])
            if any(p.top_p < 1 for p in params)
            else None,
            min_p=torch.tensor([p.min_p for p in params])
            if any(p.min_p > 0 for p in params)
            else None,
            generators=generators,
            output_token_ids=output_token_ids,
            prompt_token_ids=prompt_token_ids,
            penalty_rows=penalty_rows,
            presence_penalty=torch.tensor([params[i].presence_penalty for i in penalty_rows]),
            frequency_penalty=torch.tensor([params[i].frequency_penalty for i in penalty_rows]),
            repetition_penalty=torch.tensor([params[i].repetition_penalty for i in penalty_rows]),
            min_tokens_masks=min_tokens_masks,
            num_logprobs=[p.logprobs for p in params],
        )


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    """One sampled token per row."""
    logprobs: list[list[tuple[int, float, int]] | None]
    """Row → [(token id, logprob, rank)]: the sampled token first, then the top ones."""


class Sampler(nn.Module):
    @torch.inference_mode()
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [rows, vocab] float32 (modified in place)."""
        raw_logprobs = None
        if any(n is not None for n in meta.num_logprobs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        for row, token_ids in meta.min_tokens_masks.items():
            logits[row, token_ids] = -torch.inf
        if meta.penalty_rows:
            apply_penalties(logits, meta)
        sampled = logits.max(dim=-1).indices  # faster than argmax on CPU (same first-max rule)
        if not meta.all_greedy:
            random = self._sample_random(logits, meta)
            sampled = torch.where(meta.greedy.to(logits.device), sampled, random)
        token_ids = sampled.tolist()
        logprobs = None if raw_logprobs is None else _gather_logprobs(raw_logprobs, token_ids, meta)
        return SamplerOutput(token_ids, logprobs or [None] * len(token_ids))

    def _sample_random(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        logits = logits / meta.temperature.to(logits.device)[:, None]
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p.to(logits.device))
        # Seeded rows keep the whole-vocabulary draw: the candidates' width depends on the batch.
        if meta.top_k is not None and meta.top_p is None and not meta.generators:
            candidates = top_k_candidates(logits, meta.top_k)
            if candidates is not None:  # sample among each row's top k only
                values, ids = candidates
                chosen = _race(torch.softmax(values, dim=-1), meta.generators)
                return ids.gather(1, chosen[:, None]).squeeze(1)
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        return _race(torch.softmax(logits, dim=-1), meta.generators)


def _race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One draw per row from `probs` [rows, n] (modified): argmax(probs / q), q ~ Exp(1) drawn
    as -log(u), u uniform (faster than exponential_ on CPU; the same distribution)."""
    u = torch.rand_like(probs)
    for row, generator in generators.items():
        u[row] = torch.rand(probs.shape[1], generator=generator, device=probs.device)
    return probs.div_(u.log_().neg_()).max(dim=-1).indices


def top_k_candidates(
    logits: torch.Tensor, top_k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(values, token ids) [rows, max k + 1]: each row's likeliest tokens by torch.topk, those
    past the row's own k set to -inf: what apply_top_k_top_p keeps (tokens tied with the k-th
    kept too), without sorting the vocabulary. None where that cannot be decided from them: k
    covers most of the vocabulary, or ties with a row's k-th value reach the last candidate."""
    vocab_size = logits.shape[1]
    width = int(top_k.max()) + 1
    if 2 * width > vocab_size:
        return None
    values, ids = logits.topk(width, dim=-1)
    k = top_k.to(logits.device).clamp(1, vocab_size)[:, None]
    threshold = values.gather(1, k - 1)
    if bool((values[:, -1:] >= threshold).any()):
        return None
    return values.masked_fill_(values < threshold, -torch.inf), ids


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """vLLM's penalties on the rows that have any (in place)."""
    rows = meta.penalty_rows
    vocab_size = logits.shape[1]
    device = logits.device
    output_counts = torch.zeros(len(rows), vocab_size, device=device)
    prompt_mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    for j, row in enumerate(rows):
        if meta.output_token_ids[row]:
            ids = torch.tensor(meta.output_token_ids[row], device=device)
            output_counts[j].index_add_(0, ids, torch.ones(len(ids), device=device))
        if meta.repetition_penalty[j] != 1.0:
            prompt_mask[j, torch.tensor(meta.prompt_token_ids[row], device=device)] = True
    index = torch.tensor(rows, device=device)
    sub = logits.index_select(0, index)
    repetition = meta.repetition_penalty.to(device)[:, None]
    seen = prompt_mask | (output_counts > 0)
    penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(seen, penalized, sub)
    sub -= meta.frequency_penalty.to(device)[:, None] * output_counts
    sub -= meta.presence_penalty.to(device)[:, None] * (output_counts > 0).float()
    logits.index_copy_(0, index, sub)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p x the likeliest token's."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, -torch.inf)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep the top_k likeliest tokens, then the smallest set reaching top_p (vLLM's rule)."""
    logits_sort, order = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[1]
    if top_k is not None:
        kth = (vocab_size - top_k.to(logits.device)).clamp(0, vocab_size - 1)
        threshold = logits_sort.gather(1, kth[:, None].long())
        logits_sort = logits_sort.masked_fill(logits_sort < threshold, -torch.inf)
    if top_p is not None:
        probs_sort = logits_sort.softmax(dim=-1)
        cumulative = probs_sort.cumsum(dim=-1)
        drop = cumulative <= 1 - top_p.to(logits.device)[:, None]
        drop[:, -1] = False  # always keep the likeliest token
        logits_sort = logits_sort.masked_fill(drop, -torch.inf)
    return torch.empty_like(logits).scatter_(1, order, logits_sort)


def _gather_logprobs(
    raw_logprobs: torch.Tensor, token_ids: list[int], meta: SamplingMetadata
) -> list[list[tuple[int, float, int]] | None]:
    rows = [i for i, n in enumerate(meta.num_logprobs) if n is not None]
    max_k = max(meta.num_logprobs[i] or 0 for i in rows)
    sub = raw_logprobs[rows]
    chosen = torch.tensor([token_ids[i] for i in rows], device=sub.device)
    chosen_logprobs = sub.gather(1, chosen[:, None])
    ranks = (sub > chosen_logprobs).sum(dim=-1) + 1
    top_values, top_ids = sub.topk(max_k, dim=-1) if max_k else (None, None)
    out: list[list[tuple[int, float, int]] | None] = [None] * len(token_ids)
    chosen_list, ranks_list = chosen_logprobs[:, 0].tolist(), ranks.tolist()
    for j, row in enumerate(rows):
        entries = [(token_ids[row], chosen_list[j], ranks_list[j])]
        k = meta.num_logprobs[row] or 0
        if k:
            assert top_ids is not None and top_values is not None  # max_k >= k > 0
            ids, values = top_ids[j, :k].tolist(), top_values[j, :k].tolist()
            entries += [(t, v, r + 1) for r, (t, v) in enumerate(zip(ids, values, strict=True))]
        out[row] = entries
    return out
