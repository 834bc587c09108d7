"""The fallback (transformers_backend/fallback.py): Hugging Face models run as they are, on padded batches, for
architectures the transformers backend cannot plug its attention into. float32 on CPU, against
sentence-transformers on the same folder.

RoFormer (rotary attention, its own attention code) takes an attention mask: buckets of similar
length are padded. FNet mixes tokens with a Fourier transform and takes no mask: it runs buckets
of equal length only (sentence-transformers pads FNet's batches, which changes its outputs, so its
reference runs one text at a time).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import TINY_SIZES, TINY_TEXTS, copy_bert_tokenizer, write_st_pooling
from tolerances import assert_close

from tidepool import LLM, PoolingParams
from tidepool.transformers_backend.attention import UnsupportedAttentionError
from tidepool.transformers_backend.fallback import UnpoolableModelError

RAW = PoolingParams(normalize=False)
MODELS = {
    "roformer": lambda: transformers.RoFormerModel(
        transformers.RoFormerConfig(vocab_size=30522, embedding_size=32, **TINY_SIZES)
    ),
    "fnet": lambda: transformers.FNetModel(
        transformers.FNetConfig(
            vocab_size=30522,
            hidden_size=32,
            num_hidden_layers=2,
            intermediate_size=64,
            max_position_embeddings=128,
            initializer_range=0.2,
        )
    ),
    # On the transformers backend; test_backend_failing_at_first_forward_falls_back breaks it.
    "electra": lambda: transformers.ElectraModel(
        transformers.ElectraConfig(vocab_size=30522, embedding_size=32, **TINY_SIZES)
    ),
    "roformer-classifier": lambda: transformers.RoFormerForSequenceClassification(
        transformers.RoFormerConfig(vocab_size=30522, embedding_size=32, num_labels=1, **TINY_SIZES)
    ),
}


@pytest.fixture(scope="module")
def fallback_path(tmp_path_factory, minilm_path):
    root = tmp_path_factory.mktemp("fallback")
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            folder = root / kind
            folder.mkdir()
            copy_bert_tokenizer(minilm_path, folder)
            torch.manual_seed(60 + list(MODELS).index(kind))
            MODELS[kind]().eval().save_pretrained(str(folder))
            if not kind.endswith("classifier"):
                write_st_pooling(folder, "mean")
            built[kind] = folder
        return built[kind]

    return get


def _embed(llm: LLM, texts: list[str]) -> torch.Tensor:
    outs = llm.embed(texts, pooling_params=RAW, use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outs])


@pytest.mark.parametrize("kind", ["roformer", "fnet"])
def test_fallback_embeddings_equal_sentence_transformers(
    kind, fallback_path, report_tolerance, caplog
):
    from sentence_transformers import SentenceTransformer

    path = fallback_path(kind)
    st = SentenceTransformer(str(path), device="cpu")
    if kind == "fnet":
        expected = torch.cat([torch.from_numpy(st.encode([t])) for t in TINY_TEXTS])
    else:
        expected = torch.from_numpy(st.encode(TINY_TEXTS))
    with caplog.at_level(logging.WARNING, logger="tidepool"):
        llm = LLM(str(path), device="cpu", dtype="float32")
    assert llm.model_config.model_impl == "fallback"
    warnings = [r.getMessage() for r in caplog.records if "fallback" in r.getMessage()]
    assert len(warnings) == 1 and "unpacked" in warnings[0], warnings
    assert type(MODELS[kind]()).__name__ in warnings[0]
    got = _embed(llm, TINY_TEXTS)
    measured = report_tolerance(f"tiny {kind} fallback MEAN", got, expected)
    assert measured.worst_cosine >= 0.99999
    assert measured.max_abs_diff <= 1e-5
    # Batch invariance: alone equals batched, and the prompts' outputs differ.
    alone = torch.cat([_embed(llm, [t]) for t in TINY_TEXTS])
    assert (alone - got).abs().max() <= 1e-5
    assert F.cosine_similarity(got[:1], got[1:]).max() < 0.999


def test_fallback_cross_encoder_equals_sentence_transformers(fallback_path):
    from sentence_transformers import CrossEncoder

    path = fallback_path("roformer-classifier")
    queries = [TINY_TEXTS[i % len(TINY_TEXTS)] for i in range(8)]
    docs = [TINY_TEXTS[(3 * i + 1) % len(TINY_TEXTS)] for i in range(8)]
    expected = torch.tensor(
        CrossEncoder(str(path), device="cpu").predict(list(zip(queries, docs, strict=True)))
    )
    llm = LLM(str(path), device="cpu", dtype="float32")
    assert llm.model_config.model_impl == "fallback"
    got = torch.tensor([o.outputs.score for o in llm.score(queries, docs, use_tqdm=False)])
    assert (got - expected).abs().max() <= 1e-5
    assert len({round(float(s), 4) for s in expected}) > 4


def test_transformers_impl_stays_strict(fallback_path):
    with pytest.raises(UnsupportedAttentionError, match="RoFormerModel does not declare"):
        LLM(str(fallback_path("roformer")), device="cpu", model_impl="transformers")


def test_model_whose_outputs_cannot_be_pooled_is_refused(tmp_path, minilm_path):
    """FunnelBaseModel pools its sequence down: fewer states than tokens."""
    copy_bert_tokenizer(minilm_path, tmp_path)
    config = transformers.FunnelConfig(
        vocab_size=30522, block_sizes=[1, 1], d_model=32, n_head=4, d_head=8, d_inner=64
    )
    config.architectures = ["FunnelBaseModel"]
    torch.manual_seed(0)
    transformers.FunnelBaseModel(config).save_pretrained(str(tmp_path))
    with pytest.raises(UnpoolableModelError, match="not one state per token"):
        LLM(str(tmp_path), device="cpu", model_impl="fallback")


def test_backend_failing_at_first_forward_falls_back(fallback_path, monkeypatch, caplog):
    """A model that passes the backend's checks on the meta device but whose forward raises with
    real tensors: auto falls back (the load-time check at resolve time) with one warning line;
    model_impl="transformers" stays strict (the error comes at load)."""
    from sentence_transformers import SentenceTransformer

    from tidepool.transformers_backend.wrappers import TransformersEncoderModel

    path = fallback_path("electra")
    assert type(LLM(str(path), device="cpu").engine.model_runner.model) is TransformersEncoderModel

    def broken(self, *args, **kwargs):
        raise RuntimeError("simulated attention failure")

    monkeypatch.setattr(TransformersEncoderModel, "forward", broken)
    with caplog.at_level(logging.WARNING, logger="tidepool"):
        llm = LLM(str(path), device="cpu", dtype="float32")
    assert llm.model_config.model_impl == "fallback"
    assert type(llm.engine.model_runner.model).__name__ == "FallbackEncoderModel"
    warnings = [r.getMessage() for r in caplog.records if "fallback" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "ElectraModel" in warnings[0] and "simulated attention failure" in warnings[0]
    expected = torch.from_numpy(SentenceTransformer(str(path), device="cpu").encode(TINY_TEXTS))
    got = _embed(llm, TINY_TEXTS)
    assert F.cosine_similarity(got, expected).min() >= 0.99999
    assert (got - expected).abs().max() <= 1e-5
    with pytest.raises(RuntimeError, match="simulated attention failure"):
        LLM(str(path), device="cpu", model_impl="transformers")


def test_backend_disagreeing_with_transformers_falls_back(fallback_path, monkeypatch, caplog):
    """A backend that runs but computes something else (here: attention scores 1.5x too sharp):
    the load-time check compares it with transformers' own attention on two packed sequences
    and auto runs the fallback, with one line saying why; model_impl="transformers" refuses."""
    from sentence_transformers import SentenceTransformer

    from tidepool.transformers_backend import attention as transformers_attention
    from tidepool.transformers_backend.fallback import BackendDisagreementError

    attend = transformers_attention.EncoderStep.attend

    def too_sharp(self, module, query, key, value, scale, *rest):
        return attend(self, module, query, key, value, 1.5 * scale, *rest)

    monkeypatch.setattr(transformers_attention.EncoderStep, "attend", too_sharp)
    path = fallback_path("electra")
    with caplog.at_level(logging.WARNING, logger="tidepool"):
        llm = LLM(str(path), device="cpu", dtype="float32")
    assert llm.model_config.model_impl == "fallback"
    warnings = [r.getMessage() for r in caplog.records if "fallback" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "ElectraModel" in warnings[0] and "float32 bound" in warnings[0]
    expected = torch.from_numpy(SentenceTransformer(str(path), device="cpu").encode(TINY_TEXTS))
    # 2 layers + embeddings; the longest reduction: the FFN's 64 or the 90-token text.
    assert_close(_embed(llm, TINY_TEXTS), expected, depth=3, reduction=128)
    with pytest.raises(BackendDisagreementError, match="ElectraModel: the transformers backend"):
        LLM(str(path), device="cpu", model_impl="transformers")
