"""Batch invariance on tiny models: a prompt's output does not depend on its batch neighbours,
on the step it lands in, or on the other requests' pooling parameters.

Tolerance: max abs diff <= 1e-5 (raw float32 outputs of magnitude ~1). Alone, a sequence is
attended to as a plain slice; in a batch it shares a padded, masked bucket with sequences of
similar length (attention/metadata.py); the two differ by float rounding only (~1e-7). Attention
leaking across sequences or a misplaced output would cost > 1e-2.
"""

from __future__ import annotations

import random

import pytest
import torch

from tidepool import LLM, PoolingParams

ATOL = 1e-5
RAW = PoolingParams(normalize=False)


def _mixed_length_prompts(num: int, seed: int, cls_id: int, sep_id: int, vocab: range):
    """Token-id prompts of 2..128 tokens; runs of equal and near-equal lengths on purpose, so
    buckets with and without padding both occur."""
    rng = random.Random(seed)
    lengths = [rng.choice([2, 3, 17, 17, 17, 40, 41, 44, 90, 100, 126, 128]) for _ in range(num)]
    lengths += [rng.randint(2, 128) for _ in range(num - len(lengths))]
    return [
        {"prompt_token_ids": [cls_id, *(rng.choice(vocab) for _ in range(n - 2)), sep_id]}
        for n in lengths
    ]


@pytest.fixture(scope="module")
def bert_prompts():
    return _mixed_length_prompts(50, seed=11, cls_id=101, sep_id=102, vocab=range(1000, 30000))


def _data(outs) -> list[torch.Tensor]:
    return [o.outputs.data for o in outs]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kind", ["bert", "bert-mean", "roberta"])
def test_embedding_alone_vs_batch_vs_small_steps(
    kind, tiny_llm, tiny_model_path, bert_prompts, report_tolerance
):
    llm = tiny_llm(kind)
    prompts = bert_prompts
    if kind == "roberta":  # its vocabulary is smaller, its max length 126
        prompts = _mixed_length_prompts(50, seed=12, cls_id=0, sep_id=2, vocab=range(5, 300))
        prompts = [{"prompt_token_ids": p["prompt_token_ids"][:126]} for p in prompts]
    alone = [llm.encode(p, RAW, use_tqdm=False)[0].outputs.data for p in prompts]
    batched = _data(llm.encode(prompts, RAW, use_tqdm=False))
    report_tolerance(f"tiny {kind} batch of 50 vs alone", torch.stack(batched), torch.stack(alone))
    assert _max_diff(batched, alone) <= ATOL
    # Shuffled: other neighbours, same results, still in prompt order.
    order = list(range(len(prompts)))
    random.Random(3).shuffle(order)
    shuffled = _data(llm.encode([prompts[i] for i in order], RAW, use_tqdm=False))
    assert _max_diff([shuffled[order.index(i)] for i in range(len(prompts))], alone) <= ATOL
    # One step holds at most 3 sequences and max_model_len tokens: many steps, new neighbours.
    small = LLM(
        str(tiny_model_path(kind)),
        max_num_batched_tokens=llm.model_config.max_model_len,
        max_num_seqs=3,
    )
    stepped = _data(small.encode(prompts, RAW, use_tqdm=False))
    assert small.engine.stats.num_steps >= len(prompts) // 3
    report_tolerance(f"tiny {kind} small steps vs alone", torch.stack(stepped), torch.stack(alone))
    assert _max_diff(stepped, alone) <= ATOL
    # Guard: outputs of different prompts are far apart, so a mix-up could not pass the above.
    distances = torch.cdist(torch.stack(alone), torch.stack(alone))
    same_prompt = torch.tensor(
        [[p["prompt_token_ids"] == q["prompt_token_ids"] for q in prompts] for p in prompts]
    )
    assert distances[~same_prompt].min() > 1e-2


def test_mixed_tasks_and_params_in_one_batch(tiny_llm, bert_prompts):
    """embed (normalized, raw, truncated dims) and token_embed requests share steps."""
    llm = tiny_llm("bert")
    prompts = bert_prompts[:12]
    variants = [
        RAW,
        PoolingParams(),
        PoolingParams(dimensions=7),
        PoolingParams(normalize=False, dimensions=5),
    ]
    params = [variants[i % len(variants)] for i in range(len(prompts))]
    mixed = _data(llm.encode(prompts, params, use_tqdm=False))
    for prompt, p, out in zip(prompts, params, mixed, strict=True):
        assert torch.allclose(out, llm.encode(prompt, p, use_tqdm=False)[0].outputs.data, atol=ATOL)
    # Token-level and sequence-level requests together, one call per task.
    tokens = _data(llm.encode(prompts, RAW, pooling_task="token_embed", use_tqdm=False))
    for prompt, tok in zip(prompts, tokens, strict=True):
        assert tok.shape == (len(prompt["prompt_token_ids"]), 32)
        alone = llm.encode(prompt, RAW, pooling_task="token_embed", use_tqdm=False)[0].outputs.data
        assert (tok - alone).abs().max() <= ATOL
        # CLS pooling is the first token's state.
        assert (
            tok[0] - llm.encode(prompt, RAW, use_tqdm=False)[0].outputs.data
        ).abs().max() <= ATOL


def test_cross_encoder_scores_alone_vs_batch(tiny_llm, tiny_texts):
    llm = tiny_llm("bert-cross-encoder")
    rng = random.Random(5)
    queries = [rng.choice(tiny_texts) for _ in range(50)]
    docs = [rng.choice(tiny_texts) + " " + rng.choice(tiny_texts) for _ in range(50)]
    # Some pairs are longer than 128 tokens: truncated (longest_first, as the tokenizer does).
    kwargs = dict(truncate_prompt_tokens=-1, use_tqdm=False)
    batched = [o.outputs.score for o in llm.score(queries, docs, **kwargs)]
    alone = [llm.score(q, d, **kwargs)[0].outputs.score for q, d in zip(queries, docs, strict=True)]
    assert batched == pytest.approx(alone, abs=ATOL)
    assert len({round(s, 4) for s in alone}) > 10  # distinct scores: a mix-up would show
