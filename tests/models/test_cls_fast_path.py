"""CLS pooling's fast path: the encoder's last layer computes only each sequence's first row.

Tolerance: the float32 bound of tests/tolerances.py (relative to the magnitude of the compared
values, growing with depth and reduction length). Both paths do the same math on the rows that
are read: layers 0..N-2 are the same calls, the last layer's qkv GEMM is the same, attention is
one SDPA per bucket over the same keys, values and mask (only the query rows nobody reads are
dropped), and the GEMMs, LayerNorms and GELU are row-wise. They are not bit-identical: oneDNN and
SDPA block their loops by the number of rows (num_seqs instead of every slot), and the blocking
differs between CPUs (AVX2 / AVX-512 / AMX), which reorders float32 sums. Measured: 2-7 ulps of
hidden states of |x| ~ 3 (3.6e-7 to 1.2e-6); the bound here is ~6e-4. A wrong row (another
token, another sequence, a padding slot) moves the result by > 1e-2, well past the bound.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_SIZES
from tolerances import assert_close, float32_rtol

from tidepool import PoolingParams
from tidepool.attention.common import encoder_step
from tidepool.attention.metadata import build_encoder_metadata

# The tiny models' layers plus the head; the longest reduction is at most max_position_embeddings.
BOUND = dict(
    depth=TINY_SIZES["num_hidden_layers"] + 1,
    reduction=max(TINY_SIZES["intermediate_size"], TINY_SIZES["max_position_embeddings"]),
)
WRONG_ROW = 1e-2  # what a wrong row moves the outputs by, at least
# Longest first (as the runner lays them out): several buckets, padding in some, a 1-token one.
SEQ_LENS = [41, 40, 37, 36, 22, 21, 19, 9, 8, 8, 3, 1]
KINDS = ["bert-cross-encoder", "roberta-classifier", "bert"]


class _RowCounter:
    """Counts the rows reaching the last layer's FFN output GEMM, per forward call."""

    def __init__(self, model: torch.nn.Module) -> None:
        body = getattr(model, "body", model)
        self.rows: list[int] = []
        self._handle = body.encoder.layer[-1].output.dense.register_forward_hook(
            lambda _m, args, _out: self.rows.append(args[0].shape[0])
        )

    def close(self) -> None:
        self._handle.remove()


@pytest.fixture
def count_rows():
    counters: list[_RowCounter] = []

    def make(llm) -> _RowCounter:
        counters.append(_RowCounter(llm.engine.model_runner.model))
        return counters[-1]

    yield make
    for counter in counters:
        counter.close()


@pytest.fixture
def full_path(monkeypatch):
    """Runs the engine with the fast path switched off (the reference)."""

    def disable(llm) -> None:
        monkeypatch.setattr(llm.engine.model_runner, "_pools_first_tokens_only", lambda _p: False)

    return disable


def _batch(llm, seq_lens: list[int], seed: int, with_token_types: bool):
    config = llm.model_config.hf_config
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(seq_lens)
    # Ids from 3 up: clear of RoBERTa's pad id (1), any id is a real token to the model.
    input_ids = torch.randint(3, config.vocab_size, (num_tokens,), generator=gen)
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    token_type_ids = None
    if with_token_types:
        token_type_ids = torch.cat([(torch.arange(n) >= n // 2).long() for n in seq_lens])
    step = encoder_step(
        seq_lens, torch.device("cpu"), torch.float32, num_heads=config.num_attention_heads
    )
    meta = llm.engine.model_runner.attn_builder.build(step)  # the model's backend's metadata
    return input_ids, positions, meta, token_type_ids


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seq_lens", [SEQ_LENS, [12, 12, 12], [5]], ids=["mixed", "packed", "one"])
@torch.inference_mode()
def test_first_token_rows_equal_full_forward(kind, seq_lens, tiny_llm):
    llm = tiny_llm(kind)
    model = llm.engine.model_runner.model
    with_token_types = kind.startswith("bert")
    input_ids, positions, meta, token_type_ids = _batch(llm, seq_lens, 0, with_token_types)
    if seq_lens is SEQ_LENS:
        buckets = build_encoder_metadata(seq_lens, torch.device("cpu")).buckets
        assert len(buckets) >= 4 and any(b.key_mask is not None for b in buckets)
    full = model(input_ids, positions, meta, token_type_ids)
    fast = model(input_ids, positions, meta, token_type_ids, first_token_only=True)
    starts = torch.tensor([0, *seq_lens]).cumsum(0)[:-1]
    expected = full.index_select(0, starts)
    assert fast.shape == (len(seq_lens), full.shape[1])
    assert_close(fast, expected, **BOUND, msg=kind)
    # A wrong row would be caught: the second token's state is far from the first's, farther than
    # the bound allows.
    has_second = torch.tensor(seq_lens) > 1
    second = full[starts[has_second] + 1]
    assert float32_rtol(**BOUND) * expected.abs().max() < WRONG_ROW
    assert (second - expected[has_second]).abs().max() > WRONG_ROW


def _pairs(tiny_texts):
    """Pairs of mixed lengths: short queries against each tiny text."""
    docs = list(tiny_texts)
    queries = [("what do encoders share?", "hi")[i % 2] for i in range(len(docs))]
    return queries, docs


@pytest.mark.parametrize("kind", ["bert-cross-encoder", "roberta-classifier"])
@pytest.mark.parametrize("activation", [None, False])
def test_cross_encoder_scores_equal_full_path(
    kind, activation, tiny_llm, tiny_texts, count_rows, full_path
):
    llm = tiny_llm(kind)
    queries, docs = _pairs(tiny_texts)
    params = PoolingParams(activation=activation)

    def run() -> list:
        if kind.startswith("bert"):  # one label: score, sigmoid or the raw logit
            outs = llm.score(queries, docs, pooling_params=params, use_tqdm=False)
            return [o.outputs.score for o in outs]
        # a multi-label classifier: classify, softmax or raw logits
        return [o.outputs.probs for o in llm.classify(docs, pooling_params=params, use_tqdm=False)]

    counter = count_rows(llm)
    fast = torch.tensor(run())
    assert sum(counter.rows) == len(docs)  # one row per sequence reached the last FFN
    full_path(llm)
    counter.rows.clear()
    full = torch.tensor(run())
    assert sum(counter.rows) > 4 * len(docs)  # every slot did
    assert_close(fast, full, **BOUND)


@pytest.mark.parametrize(
    "params",
    [PoolingParams(), PoolingParams(normalize=False), PoolingParams(dimensions=16)],
    ids=["default", "raw", "dimensions"],
)
def test_cls_embedder_equals_full_path(params, tiny_llm, tiny_texts, count_rows, full_path):
    llm = tiny_llm("bert")
    assert llm.engine.model_runner.pooler.pooling_type == "CLS"
    counter = count_rows(llm)
    fast = torch.tensor(
        [o.outputs.embedding for o in llm.embed(tiny_texts, pooling_params=params, use_tqdm=False)]
    )
    assert sum(counter.rows) == len(tiny_texts)
    full_path(llm)
    full = torch.tensor(
        [o.outputs.embedding for o in llm.embed(tiny_texts, pooling_params=params, use_tqdm=False)]
    )
    assert fast.shape == full.shape
    assert_close(fast, full, **BOUND)


def test_mean_pooling_takes_full_path(tiny_llm, tiny_texts, count_rows):
    llm = tiny_llm("bert-mean")
    assert llm.engine.model_runner.pooler.pooling_type == "MEAN"
    counter = count_rows(llm)
    llm.embed(tiny_texts, use_tqdm=False)
    num_tokens = sum(len(llm.get_tokenizer()(t)["input_ids"]) for t in tiny_texts)
    assert sum(counter.rows) >= num_tokens


def test_token_task_in_step_takes_full_path(tiny_llm, tiny_texts, count_rows):
    """A step with a token_embed request computes every row; its embed requests still get CLS."""
    llm = tiny_llm("bert")
    texts = tiny_texts[:4]
    expected = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    params = [PoolingParams(task="token_embed")] + [PoolingParams(task="embed")] * (len(texts) - 1)
    counter = count_rows(llm)
    results, errors = llm._run(llm.input_processor.process(texts, params), use_tqdm=False)
    assert not errors and len(counter.rows) == 1  # one step held all four
    num_tokens = sum(len(llm.get_tokenizer()(t)["input_ids"]) for t in texts)
    assert counter.rows[0] >= num_tokens
    assert results[0].outputs.data.dim() == 2  # per-token rows
    for result, embedding in zip(results[1:], expected[1:], strict=True):
        assert_close(result.outputs.data, torch.tensor(embedding), **BOUND)


def test_fast_path_needs_model_support(tiny_llm):
    runner = tiny_llm("bert").engine.model_runner
    embed, token = PoolingParams(task="embed"), PoolingParams(task="token_embed")
    assert runner._pools_first_tokens_only([embed, embed])
    assert not runner._pools_first_tokens_only([embed, token])
    model = runner.model
    try:
        model.supports_first_token_only = False  # as the transformers-backend encoders
        assert not runner._pools_first_tokens_only([embed])
    finally:
        del model.supports_first_token_only
