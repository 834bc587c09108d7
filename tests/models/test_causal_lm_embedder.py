"""A Qwen3-Embedding-style folder (config.json: Qwen3ForCausalLM; modules.json: Transformer →
Pooling(lasttoken) → Normalize) is an embedder, as sentence-transformers and vLLM load it; a folder
without sentence-transformers files gets the model's default pooling, and one INFO line says which
pooling was chosen and why."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from st_metadata import write_st_metadata
from tiny_decoders import SIZES

from tidepool import LLM

TEXTS = [
    "Instruct: retrieve passages that answer the question. Query: what is a KV cache?",
    "Paged attention stores keys and values in fixed-size blocks.",
    "the fox",
]


@pytest.fixture(scope="module")
def st_qwen3_lm(tiny_decoder_path, tmp_path_factory):
    """The tiny Qwen3ForCausalLM with sentence-transformers files (lasttoken, normalized)."""
    folder = tmp_path_factory.mktemp("qwen3_embedding") / "qwen3-lm-st"
    shutil.copytree(tiny_decoder_path("qwen3"), folder)
    pooling = {"word_embedding_dimension": SIZES["hidden_size"], "pooling_mode": "lasttoken"}
    write_st_metadata(folder, pooling, normalize=True)
    return folder


def test_st_folder_of_a_causal_lm_embeds_like_sentence_transformers(st_qwen3_lm, caplog):
    from sentence_transformers import SentenceTransformer

    with caplog.at_level(logging.INFO, logger="tidepool"):
        llm = LLM(str(st_qwen3_lm), device="cpu", dtype="float32")  # runner="auto"
    assert llm.model_config.task == "embed"
    assert llm.model_config.architecture == "Qwen3Model"
    messages = [r.getMessage() for r in caplog.records]
    assert any('loads as an embedding model (runner="pooling")' in m for m in messages), messages
    assert any(
        "Qwen3Model: pooling LAST + normalize, from the sentence-transformers Pooling module" in m
        for m in messages
    ), messages
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    reference = SentenceTransformer(str(st_qwen3_lm), device="cpu")
    expected = reference.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS)).float()
    assert got.shape == expected.shape
    # Unit vectors of a 2-layer float32 model: rounding differences are ~1e-7.
    assert (got - expected).abs().max() <= 1e-5
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-6)


def test_runner_generate_still_generates(st_qwen3_lm):
    llm = LLM(str(st_qwen3_lm), runner="generate", device="cpu", dtype="float32")
    assert llm.model_config.task == "generate"


def test_folder_without_st_files_says_which_pooling(tiny_model_path, caplog):
    """vLLM's rule (CLS + normalize for BERT) where sentence-transformers would pool MEAN: said."""
    from tidepool.model_loader.resolve import build_model_config

    folder = tiny_model_path("bert")
    assert not (folder / "modules.json").exists()
    with caplog.at_level(logging.INFO, logger="tidepool"):
        build_model_config(str(folder), device="cpu")
    lines = [r.getMessage() for r in caplog.records if "pooling" in r.getMessage()]
    assert lines == [
        "BertModel: pooling CLS + normalize, the model's default as in vLLM: the folder has no "
        "sentence-transformers files (modules.json); sentence-transformers would pool MEAN"
    ]
