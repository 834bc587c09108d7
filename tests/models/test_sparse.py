"""SPLADE sparse embeddings against sentence-transformers' SparseEncoder, on a tiny random
BertForMaskedLM saved by SparseEncoder (Transformer(fill-mask) → SpladePooling)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_TEXTS
from sparse_models import save_splade

from tidepool import LLM, PoolingParams
from tidepool.outputs import BatchInputError, sparse_pairs

TEXTS = [t for t in TINY_TEXTS if t.strip()]


@pytest.fixture(scope="module")
def splade_path(tmp_path_factory, minilm_path) -> Path:
    return save_splade(tmp_path_factory.mktemp("splade"), minilm_path, 150, "max")


@pytest.fixture(scope="module")
def splade_llm(splade_path) -> LLM:
    return LLM(str(splade_path), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def sparse_encoder(splade_path):
    from sentence_transformers import SparseEncoder

    return SparseEncoder(str(splade_path), device="cpu")


def _reference(encoder, texts, **kwargs) -> torch.Tensor:
    return encoder.encode(texts, convert_to_tensor=True, convert_to_sparse_tensor=False, **kwargs)


def test_layout_resolves_as_splade(splade_path, splade_llm):
    modules = json.loads((splade_path / "modules.json").read_text())
    assert modules[1]["type"].endswith("SpladePooling")
    config = splade_llm.model_config
    assert (config.architecture, config.output_head) == ("BertForMaskedLM", "splade")
    assert config.pooling_tasks == ("embed_sparse",)
    assert config.default_pooling_task == "embed_sparse"


def test_matches_sparse_encoder(splade_llm, sparse_encoder, report_tolerance):
    expected = _reference(sparse_encoder, TEXTS)
    outputs = splade_llm.encode(TEXTS, pooling_task="embed_sparse", use_tqdm=False)
    ours = torch.stack([o.outputs.data.to_dense() for o in outputs])
    measured = report_tolerance("splade vs SparseEncoder", ours, expected)
    assert measured.max_abs_diff <= 1e-5
    for out, ref in zip(outputs, expected, strict=True):
        ids, values = sparse_pairs(out.outputs.data)
        # The same (id, weight) pairs: every id with a weight above the tolerance is in both.
        assert set(torch.nonzero(ref > 1e-5)[:, 0].tolist()) <= set(ids)
        assert all(v > 0 for v in values)
    assert not torch.equal(ours[0], ours[1])  # the guard: texts differ


def test_top_k_matches_max_active_dims(splade_llm, sparse_encoder):
    expected = _reference(sparse_encoder, TEXTS[:4], max_active_dims=8)
    outputs = splade_llm.embed_sparse(TEXTS[:4], max_active_dims=8, use_tqdm=False)
    for out, ref in zip(outputs, expected, strict=True):
        ids = torch.nonzero(ref)[:, 0].tolist()
        assert out.outputs.indices == ids
        torch.testing.assert_close(torch.tensor(out.outputs.values), ref[ids], atol=1e-5, rtol=0)


def test_tokens_as_strings(splade_llm, sparse_encoder):
    out = splade_llm.embed_sparse([TEXTS[1]], max_active_dims=5, return_tokens=True)[0].outputs
    decoded = sparse_encoder.decode(_reference(sparse_encoder, [TEXTS[1]], max_active_dims=5))[0]
    assert dict(zip(out.tokens, out.values, strict=True)) == pytest.approx(dict(decoded), abs=1e-5)


def test_sum_pooling(tmp_path, minilm_path):
    from sentence_transformers import SparseEncoder

    path = save_splade(tmp_path, minilm_path, 151, "sum")
    llm = LLM(str(path), device="cpu", dtype="float32")
    assert llm.model_config.sparse.pooling_strategy == "sum"
    expected = _reference(SparseEncoder(str(path), device="cpu"), TEXTS[:3])
    ours = torch.stack([o.outputs.data.to_dense() for o in llm.encode(TEXTS[:3], use_tqdm=False)])
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-5)


def test_batch_invariance(splade_llm):
    together = splade_llm.encode(TEXTS, use_tqdm=False)
    for text, out in zip(TEXTS, together, strict=True):
        alone = splade_llm.encode([text], use_tqdm=False)[0]
        assert sparse_pairs(out.outputs.data)[0] == sparse_pairs(alone.outputs.data)[0]
        torch.testing.assert_close(
            out.outputs.data.to_dense(), alone.outputs.data.to_dense(), atol=1e-5, rtol=1e-5
        )


def test_other_tasks_and_bad_input_are_clear_errors(splade_llm):
    with pytest.raises(ValueError, match="embed\\(\\) needs an embedding model"):
        splade_llm.embed(["x"], use_tqdm=False)
    params = [PoolingParams(task="embed_sparse"), PoolingParams(task="token_embed")]
    with pytest.raises(BatchInputError, match="'token_embed' is not supported") as e:
        splade_llm.encode(["a", "b"], params, use_tqdm=False)
    assert e.value.outputs[0] is not None and e.value.outputs[1] is None
    with pytest.raises(ValueError, match="max_active_dims must be a positive integer"):
        PoolingParams(task="embed_sparse", max_active_dims=0)


def test_max_active_dims_on_a_dense_task_is_refused(tiny_llm):
    with pytest.raises(BatchInputError, match="max_active_dims applies to the embed_sparse"):
        tiny_llm("bert").encode(
            ["x"], PoolingParams(max_active_dims=3), pooling_task="embed", use_tqdm=False
        )


def test_a_model_without_the_head_its_config_names_is_refused_at_load():
    from tidepool.output_heads import get_head

    for head in ("splade", "bge_m3", "token_classifier"):
        with pytest.raises(TypeError, match=f"object has no .* it cannot serve {head}"):
            get_head(head).bind(object())
    get_head("task").bind(object())  # the task's own head: checked elsewhere
