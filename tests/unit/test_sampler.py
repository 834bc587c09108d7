"""Sampler: masks (top-k, top-p, min-p), penalties, seeds, logprobs; stop strings; SamplingParams."""

from __future__ import annotations

import math

import pytest
import torch

from tidepool.engine.output_processor import find_stop_string
from tidepool.params import SamplingParams
from tidepool.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
    top_k_candidates,
)

VOCAB = 8


def _meta(params, outputs=None, prompts=None, stops=None, generators=None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        outputs or [[] for _ in range(n)],
        prompts or [[0] for _ in range(n)],
        stops or [[] for _ in range(n)],
        generators or {},
        VOCAB,
    )


def _logits(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_top_k_top_p_min_p_masks():
    logits = _logits([4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0])
    kept = apply_top_k_top_p(logits, torch.tensor([3]), None)
    assert torch.isfinite(kept[0]).tolist() == [True] * 3 + [False] * 5
    probs = torch.softmax(logits, -1)[0]  # 0.64, 0.23, 0.09, ...
    kept = apply_top_k_top_p(logits, None, torch.tensor([0.8]))
    assert torch.isfinite(kept[0]).sum() == 2 and probs[:2].sum() >= 0.8
    kept = apply_top_k_top_p(logits, None, torch.tensor([0.1]))
    assert torch.isfinite(kept[0]).tolist() == [True] + [False] * 7  # at least the top token
    kept = apply_min_p(logits, torch.tensor([0.1]))  # keep p >= 0.064
    assert torch.isfinite(kept[0]).tolist() == [True] * 3 + [False] * 5
    assert torch.equal(kept[0, :3], logits[0, :3])


def test_sampling_respects_masks_and_seeds():
    sampler = Sampler()
    logits = _logits(*[[4.0, 3.9, 3.8, 0.0, 0.0, 0.0, 0.0, 0.0]] * 200)
    params = [SamplingParams(temperature=1.0, top_k=2)] * 200
    tokens = sampler(logits.clone(), _meta(params)).token_ids
    assert set(tokens) == {0, 1}
    # Seeded: the same stream whatever else is in the batch (alone vs among unseeded rows).
    seeded = SamplingParams(temperature=1.5, seed=1234)
    gen_a, gen_b = torch.Generator().manual_seed(1234), torch.Generator().manual_seed(1234)
    others = [SamplingParams(), seeded, SamplingParams()]
    first, mixed = [], []
    for _ in range(20):
        first.append(
            sampler(logits[:1].clone(), _meta([seeded], generators={0: gen_a})).token_ids[0]
        )
        mixed.append(sampler(logits[:3].clone(), _meta(others, generators={1: gen_b})).token_ids[1])
    assert first == mixed
    assert len(set(first)) > 1  # it does sample


def test_greedy_rows_take_argmax_in_a_mixed_batch():
    logits = _logits([0.0, 5.0, 0.0, 0, 0, 0, 0, 0], [9.0, 0.0, 0, 0, 0, 0, 0, 0])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=1)]
    assert Sampler()(logits, _meta(params)).token_ids == [1, 0]


def test_penalties_follow_vllm():
    logits = _logits([2.0, -2.0, 1.0, 1.0, 0, 0, 0, 0])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    meta = _meta([params], outputs=[[2, 2, 3]], prompts=[[0, 1]])
    from tidepool.worker.sampler import apply_penalties

    apply_penalties(logits, meta)
    # token 0 (prompt, positive) /2; 1 (prompt, negative) *2; 2: /2 - 2*0.5 - 0.25; 3: /2 - 0.5 - 0.25
    assert logits[0, :4].tolist() == [1.0, -4.0, 0.5 - 1.0 - 0.25, 0.5 - 0.5 - 0.25]
    assert logits[0, 4:].tolist() == [0.0] * 4


def test_min_tokens_masks_stop_tokens():
    logits = _logits([0.0, 0.0, 9.0, 1.0, 0, 0, 0, 0])
    params = SamplingParams(temperature=0.0, min_tokens=2)
    meta = _meta([params], outputs=[[5]], stops=[[2]])
    assert Sampler()(logits.clone(), meta).token_ids == [3]
    meta = _meta([params], outputs=[[5, 5]], stops=[[2]])
    assert Sampler()(logits.clone(), meta).token_ids == [2]


def test_logprobs_are_raw_with_ranks():
    logits = _logits([1.0, 3.0, 2.0, 0, 0, 0, 0, 0])
    params = SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.5)
    out = Sampler()(logits.clone(), _meta([params], prompts=[[1]]))
    raw = torch.log_softmax(logits[0], -1)
    # The penalty divides token 1's logit to 2.0 (ties with token 2; argmax takes the first),
    # but logprobs report the model's raw distribution.
    assert out.token_ids == [1]
    chosen, *top = out.logprobs[0]
    assert (
        chosen[0] == 1 and math.isclose(chosen[1], raw[1].item(), abs_tol=1e-6) and chosen[2] == 1
    )
    assert [t for t, _, _ in top] == [1, 2] and [r for _, _, r in top] == [1, 2]


@pytest.mark.parametrize(
    "text, new, stop, include, expected",
    [
        ("Hello world.", 4, ["wor"], False, ("wor", 6)),
        ("Hello world.", 4, ["wor"], True, ("wor", 9)),
        ("Hello world.", 3, ["wor"], False, None),  # "wor" ended before the new "ld."
        ("Hello world.", 1, ["Hello"], False, None),  # ended before the new text
        ("abc###", 2, ["###", "c#"], False, ("###", 3)),
        ("abc", 1, ["x"], False, None),
    ],
)
def test_stop_strings(text, new, stop, include, expected):
    assert find_stop_string(text, new, stop, include) == expected


def test_sampling_params_validation():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    for bad, match in [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(stop=[""]), "stop strings"),
        (dict(n=0), "n must"),
    ]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)


def test_top_k_candidates_keep_what_the_mask_keeps():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 1000, generator=g)
    logits[3, :6] = torch.tensor([9.0, 8.0, 8.0, 8.0, 7.0, 7.0])  # ties at the k-th, inside
    top_k = torch.randint(1, 40, (16,), generator=g)
    top_k[3] = 3
    candidates = top_k_candidates(logits, top_k)
    assert candidates is not None
    values, ids = candidates
    masked = apply_top_k_top_p(logits, top_k, None)
    for row in range(16):
        kept = set(ids[row][torch.isfinite(values[row])].tolist())
        assert kept == set(torch.isfinite(masked[row]).nonzero().squeeze(1).tolist())
        assert torch.equal(
            values[row][torch.isfinite(values[row])],
            logits[row, sorted(kept)].sort(descending=True).values,
        )
    assert torch.isfinite(values[3]).sum() == 4  # k = 3: the three 8.0s tie, all kept
    # A tie reaching the last candidate (or k near the vocabulary): undecidable, None.
    assert top_k_candidates(logits[3:4], torch.tensor([2])) is None  # 8.0 x 3, width 3
    assert top_k_candidates(logits, torch.full((16,), 600)) is None


def test_top_k_sampling_follows_the_renormalized_distribution():
    logits = _logits(*[[2.0, 1.0, 0.0, 5.0, -1.0, -2.0, -3.0, -4.0]] * 6000)
    params = [SamplingParams(temperature=1.0, top_k=3)] * 6000
    tokens = torch.tensor(Sampler()(logits.clone(), _meta(params)).token_ids)
    expected = torch.softmax(torch.tensor([5.0, 2.0, 1.0]), -1)
    for token, p in zip([3, 0, 1], expected.tolist(), strict=True):
        freq = (tokens == token).float().mean().item()
        assert abs(freq - p) < 4 * (p * (1 - p) / 6000) ** 0.5, (token, freq, p)
    assert set(tokens.tolist()) == {0, 1, 3}
