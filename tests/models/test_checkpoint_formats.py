"""Checkpoint formats: pytorch_model.bin, and sentence-transformers pipelines saved by
sentence-transformers itself (Pooling → Dense → Normalize, prompts), compared with its `encode`.

Tolerance: max abs diff <= 1e-5 in float32 (same math, different kernel order; see
test_encoders.py).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from tidepool import LLM, PoolingParams

ATOL = 1e-5


def _embed(llm, texts, params=None) -> torch.Tensor:
    outs = llm.embed(texts, pooling_params=params, use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outs])


def test_pytorch_model_bin(tiny_model_path, tiny_llm, hf_reference, tiny_texts, report_tolerance):
    folder = tiny_model_path("bert-bin")
    assert (folder / "pytorch_model.bin").is_file()
    assert not list(folder.glob("*.safetensors"))
    model, tokenizer = hf_reference("bert-bin")
    with torch.inference_mode():
        expected = torch.stack(
            [model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0, 0] for t in tiny_texts]
        )
    ours = _embed(tiny_llm("bert-bin"), tiny_texts, PoolingParams(normalize=False))
    measured = report_tolerance("tiny bert from pytorch_model.bin", ours, expected)
    assert measured.max_abs_diff <= ATOL


def test_legacy_weight_names(tiny_model_path, tiny_llm, tmp_path, tiny_texts):
    """Old BERT checkpoints: a "bert." prefix and LayerNorm gamma / beta instead of weight / bias."""
    folder = tmp_path / "legacy"
    shutil.copytree(tiny_model_path("bert-bin"), folder)
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    legacy = {
        "bert."
        + name.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        ): tensor
        for name, tensor in state.items()
    }
    assert any(name.endswith("LayerNorm.gamma") for name in legacy)
    torch.save(legacy, folder / "pytorch_model.bin")
    params = PoolingParams(normalize=False)
    expected = _embed(tiny_llm("bert-bin"), tiny_texts, params)
    assert torch.equal(_embed(LLM(str(folder)), tiny_texts, params), expected)
    # A checkpoint that misses weights is refused, naming them.
    del legacy["bert.encoder.layer.1.output.dense.weight"]
    torch.save(legacy, folder / "pytorch_model.bin")
    with pytest.raises(
        ValueError, match="no weights for 1 parameters.*layer.1.output.dense.weight"
    ):
        LLM(str(folder))


def _save_st(tiny_path, folder, pooling_mode, dense=None, normalize=False, **st_kwargs):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Normalize,
        Pooling,
        Transformer,
    )

    torch.manual_seed(5)
    modules = [Transformer(str(tiny_path)), Pooling(32, pooling_mode)]
    if dense is not None:
        modules.append(dense)
    if normalize:
        modules.append(Normalize())
    st = SentenceTransformer(modules=modules, device="cpu", **st_kwargs)
    st.save(str(folder))
    return SentenceTransformer(str(folder), device="cpu")  # the reference, as reloaded


@pytest.fixture(scope="module")
def dense_tanh_normalize(tiny_model_path, tmp_path_factory):
    from sentence_transformers.sentence_transformer.modules import Dense

    folder = tmp_path_factory.mktemp("st_dense_tanh_normalize")
    dense = Dense(32, 16, activation_function=torch.nn.Tanh())
    st = _save_st(tiny_model_path("bert"), folder, "mean", dense=dense, normalize=True)
    return folder, st


def test_dense_and_normalize_pipeline(dense_tanh_normalize, tiny_texts, report_tolerance):
    folder, st = dense_tanh_normalize
    llm = LLM(str(folder))
    meta = llm.model_config.st
    assert meta.pooling_mode == "MEAN" and meta.normalize and len(meta.dense) == 1
    ours = _embed(llm, tiny_texts)
    expected = st.encode(tiny_texts, convert_to_tensor=True)
    assert ours.shape == expected.shape == (len(tiny_texts), 16)
    measured = report_tolerance("tiny ST mean+Dense(tanh)+Normalize", ours, expected)
    assert measured.max_abs_diff <= ATOL
    # Matryoshka applies to the Dense output (16 wide), not the hidden size (32).
    short = _embed(llm, tiny_texts, PoolingParams(dimensions=8))
    assert (short - F.normalize(expected[:, :8], dim=-1)).abs().max() <= ATOL
    with pytest.raises(
        ValueError, match="dimensions=17 is larger than the model's embedding size 16"
    ):
        llm.embed("x", pooling_params=PoolingParams(dimensions=17), use_tqdm=False)
    # normalize=False gives the Dense output itself.
    raw = _embed(llm, tiny_texts, PoolingParams(normalize=False))
    assert (F.normalize(raw, dim=-1) - expected).abs().max() <= ATOL
    assert not torch.allclose(raw.norm(dim=-1), torch.ones(len(tiny_texts)), atol=1e-3)


@pytest.mark.parametrize("pooling_mode", ["cls", "max", "lasttoken"])
def test_pooling_modes_with_identity_dense_no_normalize(
    pooling_mode, tiny_model_path, tmp_path, tiny_texts, report_tolerance
):
    from sentence_transformers.sentence_transformer.modules import Dense

    dense = Dense(32, 48, activation_function=torch.nn.Identity())
    st = _save_st(tiny_model_path("bert"), tmp_path / "st", pooling_mode, dense=dense)
    llm = LLM(str(tmp_path / "st"))
    # No Normalize module: the pipeline's output is not normalized, and neither is ours.
    ours = _embed(llm, tiny_texts)
    expected = st.encode(tiny_texts, convert_to_tensor=True)
    assert ours.shape == (len(tiny_texts), 48)
    measured = report_tolerance(f"tiny ST {pooling_mode}+Dense(identity)", ours, expected)
    assert measured.max_abs_diff <= ATOL


def test_default_prompt_is_prepended(tiny_model_path, tmp_path, tiny_texts, report_tolerance):
    prompts = {"query": "query: ", "document": "passage: "}
    st = _save_st(
        tiny_model_path("bert"),
        tmp_path / "st",
        "mean",
        normalize=True,
        prompts=prompts,
        default_prompt_name="query",
    )
    llm = LLM(str(tmp_path / "st"))
    ours = _embed(llm, tiny_texts)
    expected = st.encode(tiny_texts, convert_to_tensor=True)  # uses the default prompt
    without_prompt = st.encode(tiny_texts, prompt="", convert_to_tensor=True)
    assert (expected - without_prompt).abs().max() > 1e-2  # the prompt matters
    measured = report_tolerance("tiny ST mean with default prompt", ours, expected)
    assert measured.max_abs_diff <= ATOL
