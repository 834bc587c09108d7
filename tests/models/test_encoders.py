"""Tiny random BERT / RoBERTa / XLM-R models: tidepool vs transformers, float32 on CPU.

Tolerance: max abs diff <= 1e-5 on raw (unnormalized) outputs of magnitude ~1. Both sides run the
same float32 math; they differ only in kernel order (fused qkv GEMM, packed vs single-sequence
attention), which moves results by ~1e-6. A real bug (a wrong position offset, a missing token
type, attention leaking across sequences) moves them by > 1e-2; each test that relies on a property
of the input (positions, token types) also checks that breaking it would be caught.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidepool import BatchInputError, PoolingParams

ATOL = 1e-5
HIDDEN = 32  # tests/conftest.py TINY_SIZES
RAW = PoolingParams(normalize=False)
ARCHITECTURES = {"bert": "BertModel", "roberta": "RobertaModel", "xlm-roberta": "XLMRobertaModel"}


def _embed(llm, texts, params=RAW) -> torch.Tensor:
    outs = llm.embed(texts, pooling_params=params, use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outs])


@torch.inference_mode()
def _hf_hidden(hf, text: str, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Last hidden state [len, hidden] of one text, run alone (no padding)."""
    model, tokenizer = hf
    enc = tokenizer(text, return_tensors="pt")
    extra = {} if position_ids is None else {"position_ids": position_ids[None]}
    return model(**enc, **extra).last_hidden_state[0]


def _assert_close(report, name: str, actual: torch.Tensor, expected: torch.Tensor, atol=ATOL):
    measured = report(name, actual, expected)
    assert measured.max_abs_diff <= atol, f"{name}: max abs diff {measured.max_abs_diff:.3e}"
    return measured


# ----------------------------------------------------------------------------- embeddings


@pytest.mark.parametrize("kind", ["bert", "roberta", "xlm-roberta"])
def test_cls_embedding_matches_transformers(
    kind, tiny_llm, hf_reference, report_tolerance, tiny_texts
):
    llm, hf = tiny_llm(kind), hf_reference(kind)
    assert llm.model_config.architecture == ARCHITECTURES[kind]
    expected = torch.stack([_hf_hidden(hf, t)[0] for t in tiny_texts])
    raw = _embed(llm, tiny_texts)
    _assert_close(report_tolerance, f"tiny {kind} CLS raw", raw, expected)
    # Default: L2-normalized (no sentence-transformers metadata → vLLM's default).
    normalized = _embed(llm, tiny_texts, PoolingParams())
    _assert_close(
        report_tolerance, f"tiny {kind} CLS normalized", normalized, F.normalize(expected, dim=-1)
    )
    assert torch.allclose(normalized.norm(dim=-1), torch.ones(len(tiny_texts)), atol=1e-6)


def test_mean_pooling_from_sentence_transformers_config(
    tiny_llm, hf_reference, report_tolerance, tiny_texts
):
    llm, hf = tiny_llm("bert-mean"), hf_reference("bert-mean")
    expected = torch.stack([_hf_hidden(hf, t).mean(0) for t in tiny_texts])
    cls = torch.stack([_hf_hidden(hf, t)[0] for t in tiny_texts])
    assert (expected - cls).abs().max() > 0.1  # MEAN and CLS are far apart: the mode matters
    # modules.json without Normalize: embeddings are not normalized by default.
    default = _embed(llm, tiny_texts, PoolingParams())
    _assert_close(report_tolerance, "tiny bert MEAN raw", default, expected)


@pytest.mark.parametrize("kind", ["roberta", "xlm-roberta"])
def test_roberta_positions_start_after_padding_idx(kind, tiny_llm, hf_reference, tiny_texts):
    """RoBERTa numbers positions padding_idx + 1, padding_idx + 2, ... (here 2, 3, ...)."""
    llm, hf = tiny_llm(kind), hf_reference(kind)
    text = tiny_texts[1]
    ours = llm.encode(text, RAW, pooling_task="token_embed", use_tqdm=False)[0].outputs.data
    right = _hf_hidden(hf, text)
    num_tokens = len(right)
    assert (ours - right).abs().max() <= ATOL
    # The same model with positions off by one (0-based or 1-based, as BERT) is far away, so the
    # comparison above would catch a wrong offset.
    for start in (0, 1, 3):
        wrong = _hf_hidden(hf, text, torch.arange(start, start + num_tokens))
        assert (ours - wrong).abs().max() > 1e-2, start


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_longest_allowed_prompt_uses_last_position(kind, tiny_llm, hf_reference):
    """A prompt of exactly max_model_len tokens reaches the last position embedding row."""
    llm, (model, tokenizer) = tiny_llm(kind), hf_reference(kind)
    offset = 2 if kind == "roberta" else 0  # padding_idx + 1
    assert (
        llm.model_config.max_model_len
        == llm.model_config.hf_config.max_position_embeddings - offset
    )
    max_len = llm.model_config.max_model_len
    body = tokenizer("fox " * 300, add_special_tokens=False)["input_ids"][: max_len - 2]
    ids = [tokenizer.cls_token_id, *body, tokenizer.sep_token_id]
    assert len(ids) == max_len
    ours = llm.encode({"prompt_token_ids": ids}, RAW, pooling_task="token_embed", use_tqdm=False)
    with torch.inference_mode():
        expected = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    assert ours[0].outputs.data.shape == (max_len, HIDDEN)
    assert (ours[0].outputs.data - expected).abs().max() <= ATOL
    with pytest.raises(BatchInputError, match=rf"{max_len + 1} tokens.*maximum of {max_len}"):
        llm.encode({"prompt_token_ids": [*ids, ids[-1]]}, RAW, use_tqdm=False)


# ----------------------------------------------------------------------------- token embeddings


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_token_embed_returns_every_token(
    kind, tiny_llm, hf_reference, report_tolerance, tiny_texts
):
    llm, hf = tiny_llm(kind), hf_reference(kind)
    outs = llm.encode(tiny_texts, RAW, pooling_task="token_embed", use_tqdm=False)
    normalized = llm.encode(tiny_texts, pooling_task="token_embed", use_tqdm=False)
    for text, out, norm_out in zip(tiny_texts, outs, normalized, strict=True):
        expected = _hf_hidden(hf, text)
        assert (
            out.outputs.data.shape
            == expected.shape
            == (
                len(out.prompt_token_ids),
                HIDDEN,
            )
        )
        _assert_close(report_tolerance, f"tiny {kind} token_embed", out.outputs.data, expected)
        # Default: each token vector L2-normalized.
        _assert_close(
            report_tolerance,
            f"tiny {kind} token_embed normalized",
            norm_out.outputs.data,
            F.normalize(expected, dim=-1),
        )


# ----------------------------------------------------------------------------- Matryoshka


def test_matryoshka_dimensions_truncate_then_renormalize(tiny_llm, tiny_texts):
    llm = tiny_llm("bert")
    raw = _embed(llm, tiny_texts)
    for dims in (1, 8, 31, 32):
        short = _embed(llm, tiny_texts, PoolingParams(dimensions=dims))
        assert short.shape == (len(tiny_texts), dims)
        assert (short - F.normalize(raw[:, :dims], dim=-1)).abs().max() <= 1e-6
    # Per-request dimensions in one call.
    mixed = llm.embed(
        tiny_texts[:3],
        pooling_params=[PoolingParams(dimensions=d) for d in (4, 16, 32)],
        use_tqdm=False,
    )
    assert [o.outputs.hidden_size for o in mixed] == [4, 16, 32]


def test_matryoshka_dimensions_larger_than_hidden_size(tiny_llm):
    llm = tiny_llm("bert")
    with pytest.raises(BatchInputError) as info:
        llm.embed(["one", "two"], pooling_params=PoolingParams(dimensions=33), use_tqdm=False)
    assert [e.index for e in info.value.errors] == [0, 1]
    for error in info.value.errors:
        assert error.message == "dimensions=33 is larger than the model's embedding size 32"
    assert info.value.outputs == [None, None]
    with pytest.raises(ValueError, match="dimensions must be >= 1"):
        PoolingParams(dimensions=0)


# ----------------------------------------------------------------------------- cross-encoders


def test_bert_cross_encoder_score_uses_pair_encoding(
    tiny_llm, hf_reference, report_tolerance, tiny_texts
):
    llm, (model, tokenizer) = tiny_llm("bert-cross-encoder"), hf_reference("bert-cross-encoder")
    query = "what is the capital of france?"
    docs = tiny_texts
    scores = torch.tensor([o.outputs.score for o in llm.score(query, docs, use_tqdm=False)])
    with torch.inference_mode():
        enc = [tokenizer(query, d, return_tensors="pt") for d in docs]
        logits = torch.cat([model(**e).logits for e in enc])  # [n, 1]
        # Guard: the second segment's token types change the logit, so they are being tested.
        no_types = torch.cat(
            [
                model(**{**e, "token_type_ids": torch.zeros_like(e["token_type_ids"])}).logits
                for e in enc
            ]
        )
    assert all(e["token_type_ids"].any() for e in enc)
    assert (torch.sigmoid(no_types) - torch.sigmoid(logits)).abs().max() > 1e-3
    _assert_close(
        report_tolerance, "tiny bert cross-encoder score", scores[:, None], torch.sigmoid(logits)
    )
    # N-to-N gives the same scores pair by pair; raw logits with activation=False.
    n_to_n = llm.score([query] * len(docs), docs, use_tqdm=False)
    assert [o.outputs.score for o in n_to_n] == pytest.approx(scores.tolist(), abs=1e-6)
    raw = llm.score(query, docs, pooling_params=PoolingParams(activation=False), use_tqdm=False)
    raw_logits = torch.tensor([[o.outputs.score] for o in raw])
    _assert_close(report_tolerance, "tiny bert cross-encoder logit", raw_logits, logits)


def test_roberta_classifier_softmax_probs(tiny_llm, hf_reference, report_tolerance, tiny_texts):
    llm, (model, tokenizer) = tiny_llm("roberta-classifier"), hf_reference("roberta-classifier")
    outs = llm.classify(tiny_texts, use_tqdm=False)
    probs = torch.tensor([o.outputs.probs for o in outs])
    with torch.inference_mode():
        logits = torch.cat([model(**tokenizer(t, return_tensors="pt")).logits for t in tiny_texts])
    assert probs.shape == (len(tiny_texts), 3)
    assert all(o.outputs.num_classes == 3 for o in outs)
    assert torch.allclose(probs.sum(-1), torch.ones(len(tiny_texts)), atol=1e-6)
    _assert_close(
        report_tolerance, "tiny roberta classifier probs", probs, torch.softmax(logits, -1)
    )
    raw = llm.classify(tiny_texts, pooling_params=PoolingParams(activation=False), use_tqdm=False)
    _assert_close(
        report_tolerance,
        "tiny roberta classifier logits",
        torch.tensor([o.outputs.probs for o in raw]),
        logits,
    )
    # An embedding task on a classifier is a per-prompt error, with the reason.
    with pytest.raises(BatchInputError, match="task 'token_embed' is not supported"):
        llm.encode(["x"], pooling_task="token_embed", use_tqdm=False)


def test_classify_on_embedding_model_is_rejected(tiny_llm):
    with pytest.raises(ValueError, match="classify\\(\\) needs a model with a classification head"):
        tiny_llm("bert").classify(["x"], use_tqdm=False)
