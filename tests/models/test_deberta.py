"""Native DeBERTa-v2 / v3 (disentangled attention) vs transformers and sentence-transformers,
float32 on CPU.

Two layers of checks:

* The option sweep (`test_body_matches_transformers`): tidepool's DebertaV2Model against
  transformers' on the same random weights, one config per option DebertaV2Config exposes
  (position_buckets 0 / small / 256 of 512 positions, max_relative_positions -1 / explicit,
  share_att_key, norm_rel_ebd, each pos_att_type subset, relative_attention off, absolute positions,
  token types, head dims, embedding_size, the v2-xlarge convolution), on one packed step of mixed
  lengths from 1 to max_position_embeddings (past the exact range of the buckets, past the clamp of
  max_relative_positions, padded buckets and plain ones), the full forward and the CLS-only last
  layer. Each sequence is compared with transformers run on it alone. `TIDEPOOL_DEBERTA_GRID=1`
  runs the cartesian product of the options instead (the slow mode, ~150 configs).
* End to end through LLM: a v3-style embedder vs SentenceTransformer, v2 / v3 / v2-xlarge-style
  cross-encoders vs CrossEncoder.predict, a token classifier vs transformers, on prompts from 1
  to ~128 tokens (16 position buckets: most pairs reach the log-bucketed range), batched and alone.

Tolerances: tests/tolerances.py (float32 rounding relative to the magnitude, growing with depth and
the longest reduction).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import TINY_TEXTS, copy_bert_tokenizer, write_st_pooling
from sparse_models import NER_LABELS
from tolerances import assert_close, assert_cosine_close, float32_rtol

from tidepool import LLM, PoolingParams
from tidepool.attention.common import encoder_step
from tidepool.attention.metadata import EncoderAttentionMetadata
from tidepool.models import deberta_v2

RAW = PoolingParams(normalize=False)
SIZES = dict(
    vocab_size=30522,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    max_position_embeddings=128,
    initializer_range=0.2,
    pad_token_id=0,
    relative_attention=True,
    pos_att_type=["p2c", "c2p"],
)
V3 = dict(
    share_att_key=True,
    position_buckets=16,
    max_relative_positions=-1,  # = max_position_embeddings (128): log buckets out to 128
    norm_rel_ebd="layer_norm",
    position_biased_input=False,
    type_vocab_size=0,
)
V2 = dict(
    share_att_key=False,
    position_buckets=-1,
    max_relative_positions=16,
    position_biased_input=True,
    type_vocab_size=2,
    num_labels=1,
)
# DeBERTa-v2 xlarge / xxlarge: buckets, shared keys and a convolution after the first layer.
V2_XLARGE = dict(V3, conv_kernel_size=3, conv_act="gelu", num_labels=1)
# No relative attention, pos_att_type still set (it scales the content scores in transformers).
NO_RELATIVE = dict(V2, relative_attention=False)
NER = dict(V3, num_labels=len(NER_LABELS), id2label=NER_LABELS)

# Float32 bound of the end-to-end models: 2 layers + head, reductions up to 128.
BOUND = dict(depth=SIZES["num_hidden_layers"] + 1, reduction=SIZES["max_position_embeddings"])

_WORDS = "the encoder reads every token and each relative distance gets its own bucket".split()
# 40 to 123 tokens with the BERT tokenizer: relative distances well past 8 (half of 16 buckets).
LONG_TEXTS = [
    " ".join(_WORDS[(i + j) % len(_WORDS)] for j in range(n))
    for i, n in enumerate([32, 50, 67, 84, 96, 105])
]


@pytest.fixture(scope="module")
def deberta_paths(tmp_path_factory, minilm_path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deberta")
    paths = {}
    kinds = [
        ("embed", V3, transformers.DebertaV2Model),
        ("score", V2, transformers.DebertaV2ForSequenceClassification),
        ("ner", NER, transformers.DebertaV2ForTokenClassification),
        ("score-v3", dict(V3, num_labels=1), transformers.DebertaV2ForSequenceClassification),
        ("score-xlarge", V2_XLARGE, transformers.DebertaV2ForSequenceClassification),
        ("score-norel", NO_RELATIVE, transformers.DebertaV2ForSequenceClassification),
    ]
    for seed, (kind, extra, cls) in enumerate(kinds):
        folder = root / kind
        folder.mkdir()
        copy_bert_tokenizer(minilm_path, folder)
        torch.manual_seed(50 + seed)
        config = transformers.DebertaV2Config(**{**SIZES, **extra})
        cls(config).eval().save_pretrained(str(folder))
        if kind == "embed":
            write_st_pooling(folder, "mean")
        paths[kind] = folder
    return paths


def _embed(llm: LLM, texts: list[str]) -> torch.Tensor:
    outs = llm.embed(texts, pooling_params=RAW, use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outs])


def test_embeddings_match_sentence_transformers(deberta_paths, report_tolerance):
    from sentence_transformers import SentenceTransformer

    path = deberta_paths["embed"]
    texts = TINY_TEXTS + LONG_TEXTS
    expected = torch.from_numpy(SentenceTransformer(str(path), device="cpu").encode(texts))
    llm = LLM(str(path), device="cpu", dtype="float32")
    assert llm.model_config.model_impl == "native"
    assert max(len(t) for t in llm.get_tokenizer()(LONG_TEXTS)["input_ids"]) > 100
    got = _embed(llm, texts)
    report_tolerance("tiny DeBERTa-v3 MEAN", got, expected)
    assert_close(got, expected, **BOUND, dim=-1)
    assert_cosine_close(got, expected, **BOUND)
    # Batch invariance: alone equals batched, and different prompts differ.
    alone = torch.cat([_embed(llm, [t]) for t in texts])
    assert_close(alone, got, **BOUND, dim=-1)
    assert F.cosine_similarity(got[:1], got[1:]).max() < 0.999


def _pairs() -> tuple[list[str], list[str]]:
    """Pairs of 5 to 125 tokens (max_position_embeddings 128: no truncation on either side)."""
    queries = [TINY_TEXTS[i % len(TINY_TEXTS)] for i in range(10)]
    docs = [TINY_TEXTS[(3 * i + 1) % len(TINY_TEXTS)] for i in range(10)]
    queries += ["hi"] * len(LONG_TEXTS) + ["what is the capital of france?"] * 4
    docs += LONG_TEXTS + LONG_TEXTS[:4]
    return queries, docs


@pytest.mark.parametrize("kind", ["score", "score-v3", "score-xlarge", "score-norel"])
def test_cross_encoder_scores_match_sentence_transformers(kind, deberta_paths, report_tolerance):
    """v2 (clamp at 16, own projections, token types), v3 (16 buckets out to 128), v2-xlarge
    (buckets + the convolution), no relative attention (its scale still counts pos_att_type)."""
    from sentence_transformers import CrossEncoder

    path = deberta_paths[kind]
    queries, docs = _pairs()
    logits = PoolingParams(activation=False)
    cross_encoder = CrossEncoder(str(path), device="cpu")
    expected = torch.tensor(
        cross_encoder.predict(
            list(zip(queries, docs, strict=True)), activation_fn=torch.nn.Identity()
        )
    )
    llm = LLM(str(path), device="cpu", dtype="float32")
    assert llm.model_config.model_impl == "native" and llm.model_config.task == "classify"
    outs = llm.score(queries, docs, pooling_params=logits, use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outs) >= 120  # far into the log-bucketed range
    got = torch.tensor([o.outputs.score for o in outs])
    report_tolerance(f"tiny DeBERTa {kind} logits", got[:, None], expected[:, None])
    assert_close(got, expected, **BOUND)
    assert len({round(float(s), 3) for s in expected}) > 8  # distinct scores
    pairs = zip(queries, docs, strict=True)
    alone = [llm.score(q, d, pooling_params=logits, use_tqdm=False)[0] for q, d in pairs]
    assert_close(torch.tensor([o.outputs.score for o in alone]), got, **BOUND)


def test_token_classification_matches_transformers(deberta_paths, report_tolerance):
    path = deberta_paths["ner"]
    llm = LLM(str(path), device="cpu", dtype="float32")
    assert llm.model_config.model_impl == "native"
    assert llm.model_config.pooling_tasks == ("token_classify",)
    assert type(llm.engine.model_runner.model).__name__ == "DebertaV2ForTokenClassification"
    logits = PoolingParams(activation=False)
    texts = TINY_TEXTS + LONG_TEXTS
    outputs = llm.encode(texts, logits, pooling_task="token_classify", use_tqdm=False)
    model = transformers.DebertaV2ForTokenClassification.from_pretrained(str(path)).eval()
    for out in outputs:
        with torch.no_grad():
            expected = model(input_ids=torch.tensor([out.prompt_token_ids])).logits[0]
        assert out.outputs.data.shape == (len(out.prompt_token_ids), len(NER_LABELS))
        assert_close(out.outputs.data, expected, **BOUND)
        report_tolerance("tiny DeBERTa-v3 token classify", out.outputs.data, expected)
    # Batch invariance: alone equals batched, and different tokens get different logits.
    assert not torch.allclose(outputs[1].outputs.data[1], outputs[1].outputs.data[2], atol=1e-3)
    for text, out in zip(texts, outputs, strict=True):
        alone = llm.encode([text], logits, pooling_task="token_classify", use_tqdm=False)[0]
        assert_close(alone.outputs.data, out.outputs.data, **BOUND)


@pytest.mark.parametrize("kind", ["score", "score-xlarge"])  # v2 (clamp), v2-xlarge (conv)
@torch.inference_mode()
def test_first_token_rows_equal_full_forward(kind, deberta_paths):
    """The CLS-only last layer: each sequence's first row equals the full forward's (the
    position terms gathered for query row 0 only), on several buckets with padding."""
    llm = LLM(str(deberta_paths[kind]), device="cpu", dtype="float32")
    body = llm.engine.model_runner.model.body
    seq_lens = [41, 40, 37, 36, 22, 21, 19, 9, 8, 8, 3, 1]
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1000, 30000, (sum(seq_lens),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    token_types = torch.cat([(torch.arange(n) >= n // 2).long() for n in seq_lens])
    token_types = token_types if kind == "score" else None
    meta = _padded(body, seq_lens)
    assert len(meta.buckets) >= 4 and any(b.key_mask is not None for b in meta.buckets)
    full = body(input_ids, positions, meta, token_types)
    fast = body(input_ids, positions, meta, token_types, first_token_only=True)
    expected = full.index_select(0, meta.packed_buckets.cu_seqlens[:-1])
    assert_close(fast, expected, **BOUND)
    second = full[meta.packed_buckets.cu_seqlens[:-1][torch.tensor(seq_lens) > 1] + 1]
    assert (second - expected[torch.tensor(seq_lens) > 1]).abs().max() > 1e-2  # rows differ


# ----------------------------------------------------------------------- the option sweep

SWEEP_SIZES = dict(
    vocab_size=100,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=128,
    initializer_range=0.2,
    pad_token_id=0,
    relative_attention=True,
    pos_att_type=["p2c", "c2p"],
    share_att_key=True,
    position_buckets=16,
    max_relative_positions=-1,
    norm_rel_ebd="layer_norm",
    position_biased_input=False,
    type_vocab_size=0,
)
SWEEP = {
    "v3": {},  # 16 buckets of 128 positions: the brief's 256 / 512 scaled down
    "v3-256-buckets-512-positions": dict(position_buckets=256, max_position_embeddings=512),
    "8-buckets-explicit-max-relative": dict(
        position_buckets=8, max_relative_positions=40, max_position_embeddings=200
    ),
    "12-buckets-max-relative-past-positions": dict(position_buckets=12, max_relative_positions=300),
    "no-buckets-max-relative=-1": dict(position_buckets=-1),
    "no-buckets-clamp-16": dict(position_buckets=0, max_relative_positions=16),
    "own-projections": dict(share_att_key=False),
    "own-projections-c2p": dict(share_att_key=False, pos_att_type=["c2p"]),
    "own-projections-p2c": dict(share_att_key=False, pos_att_type=["p2c"]),
    "shared-c2p": dict(pos_att_type=["c2p"]),
    "shared-p2c": dict(pos_att_type=["p2c"]),
    "no-position-terms": dict(pos_att_type=[]),
    "norm-rel-none": dict(norm_rel_ebd="none"),
    "no-relative-attention": dict(relative_attention=False, position_biased_input=True),
    "no-relative-no-pos-att-type": dict(
        relative_attention=False, pos_att_type=None, position_biased_input=True
    ),
    "absolute-positions-and-token-types": dict(position_biased_input=True, type_vocab_size=2),
    "head-dim-8": dict(num_attention_heads=4),
    "head-dim-48": dict(hidden_size=96, num_attention_heads=2),
    "attention-head-size": dict(num_attention_heads=4, attention_head_size=8),
    "embedding-size": dict(embedding_size=16),
    "conv": dict(conv_kernel_size=3, conv_act="gelu"),
    "conv-5-groups-tanh": dict(conv_kernel_size=5, conv_groups=2),
    "gelu-new-1-layer": dict(hidden_act="gelu_new", num_hidden_layers=1),
}
GRID = {
    "position_buckets": [-1, 8, 16],
    "max_relative_positions": [-1, 24],
    "share_att_key": [True, False],
    "pos_att_type": [["c2p", "p2c"], ["c2p"], ["p2c"], []],
    "norm_rel_ebd": ["layer_norm", "none"],
    "position_biased_input": [False, True],
}


def _grid() -> dict[str, dict]:
    if os.environ.get("TIDEPOOL_DEBERTA_GRID") != "1":
        return SWEEP
    keys = list(GRID)
    return {
        "-".join(f"{k}={v}" for k, v in zip(keys, values, strict=True)): dict(
            zip(keys, values, strict=True)
        )
        for values in itertools.product(*GRID.values())
    }


def _sweep_lengths(config) -> list[int]:
    """Longest first (the runner's order): max_position_embeddings down to 1, around half the
    buckets (where exact distances end) and max_relative_positions (the clamp / the log range's
    end), some lengths sharing a padded bucket."""
    top = config.max_position_embeddings
    buckets, max_relative, _ = deberta_v2.relative_span(config)
    half = max(buckets, 2) // 2
    lens = {top, top - 1, top * 3 // 4, top // 2 + 1, half + 2, half + 1, half, 17, 16, 2, 1}
    lens |= {max_relative + 1, max_relative, max_relative - 1}
    return sorted((n for n in lens if 1 <= n <= top), reverse=True)


def _padded(body: deberta_v2.DebertaV2Model, seq_lens: list[int]) -> EncoderAttentionMetadata:
    """The step's metadata as the body's backend builds it (padded buckets: PADDED_BUCKETS)."""
    step = encoder_step(seq_lens, torch.device("cpu"), torch.float32, num_heads=2)
    meta = body.attention_backend.metadata_builder().build(step)
    assert isinstance(meta, EncoderAttentionMetadata)
    return meta


def _tidepool_body(reference: torch.nn.Module) -> deberta_v2.DebertaV2Model:
    """tidepool's DebertaV2Model on `reference`'s weights, prepared as the loader prepares it."""
    model = deberta_v2.DebertaV2Model(reference.config)
    model.load_weights(("deberta." + k, v) for k, v in reference.state_dict().items())
    model.eval().requires_grad_(False)
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    return model


@pytest.mark.parametrize("name", list(_grid()))
@torch.inference_mode()
def test_body_matches_transformers(name):
    config = transformers.DebertaV2Config(**{**SWEEP_SIZES, **_grid()[name]})
    torch.manual_seed(sum(map(ord, name)))
    reference = transformers.DebertaV2Model(config).eval()
    ours = _tidepool_body(reference)
    seq_lens = _sweep_lengths(config)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, config.vocab_size, (n,), generator=gen) for n in seq_lens]
    types = (
        [(torch.arange(n) >= n // 2).long() for n in seq_lens] if config.type_vocab_size else None
    )
    meta = _padded(ours, seq_lens)
    assert any(b.key_mask is not None for b in meta.buckets)  # a padded bucket
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    packed_types = None if types is None else torch.cat(types)
    full = ours(torch.cat(ids), positions, meta, packed_types)
    first = ours(torch.cat(ids), positions, meta, packed_types, first_token_only=True)
    bound = dict(
        depth=config.num_hidden_layers + 1,
        reduction=max(config.intermediate_size, config.max_position_embeddings),
    )
    starts = meta.cu_seqlens.tolist()
    for i, n in enumerate(seq_lens):
        kwargs = {} if types is None else {"token_type_ids": types[i][None]}
        expected = reference(input_ids=ids[i][None], **kwargs).last_hidden_state[0]
        got = full[starts[i] : starts[i + 1]]
        assert_close(got, expected, **bound, msg=f"{name} length {n}")
        assert_close(first[i], expected[0], **bound, msg=f"{name} length {n}, first row")
    # The guard: a relative index off by one (the rows shifted by one bucket) moves the longest
    # sequence by far more than the bound.
    if config.relative_attention and config.pos_att_type:
        table = reference.encoder.rel_embeddings.weight
        table.copy_(table.roll(1, 0))
        shifted = reference(
            input_ids=ids[0][None], **({} if types is None else {"token_type_ids": types[0][None]})
        ).last_hidden_state[0]
        moved = (shifted - full[: seq_lens[0]]).abs().max()
        assert moved > 100 * float32_rtol(**bound) * full[: seq_lens[0]].abs().max()


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (dict(position_buckets=1), "position_buckets=1"),
        (dict(conv_kernel_size=2), "conv_kernel_size=2"),
    ],
)
def test_options_without_a_meaning_are_refused_at_load(option, message, tmp_path):
    """Options transformers cannot run either (NaN buckets, a length-changing convolution) are
    refused when the model is built, with the option's name, never run."""
    config = transformers.DebertaV2Config(**{**SWEEP_SIZES, **option})
    with pytest.raises(ValueError, match=message):
        deberta_v2.DebertaV2Model(config)


@pytest.mark.skipif(
    not __import__("tidepool.quantization.int8_linear", fromlist=["x"]).int8_gemm_available(),
    reason="this torch build has no oneDNN int8 linear",
)
def test_int8_close_to_float32(deberta_paths):
    """quantization="int8" on DeBERTa-v2/v3 (issue 14: each new native model in int8): vectors
    within the int8 suite's bound of float32 (cos >= 0.99), scores within 2% of their scale."""
    vectors = {
        q: _embed(LLM(str(deberta_paths["embed"]), quantization=q), TINY_TEXTS)
        for q in (None, "int8")
    }
    assert F.cosine_similarity(vectors["int8"], vectors[None]).min() >= 0.99
    docs = TINY_TEXTS[1:]
    scores = {
        q: torch.tensor(
            [
                o.outputs.score
                for o in LLM(str(deberta_paths["score"]), quantization=q).score(
                    TINY_TEXTS[0], docs, use_tqdm=False
                )
            ]
        )
        for q in (None, "int8")
    }
    ref = scores[None]
    assert (scores["int8"] - ref).abs().max() < 0.02 * max(1.0, float(ref.abs().max()))
