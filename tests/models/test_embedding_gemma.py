"""EmbeddingGemma (Gemma3TextModel with use_bidirectional_attention=True) vs sentence-transformers.

The tiny model has EmbeddingGemma's shape in small: 3 query heads sharing one KV head, head_dim 32
(so the full layers can run on tidepool's CPU kernel; the real 256-wide heads take SDPA),
query_pre_attn_scalar 24 != head_dim, layers S F S F (sliding / full), a local RoPE base of 100
against a global 10,000, random RMSNorm weights (transformers initialises them to 0, where
Gemma's (1 + weight) would test nothing). config.json's sliding_window 16 becomes 9 in memory
(transformers' w // 2 + 1 for bidirectional configs): keys within 8 tokens each side, so every
prompt of 12-70 tokens crosses the window. The folder is a sentence-transformers pipeline saved by
sentence-transformers itself, as google/embeddinggemma-300m is: Transformer → Pooling (mean) →
Dense (no bias, identity) → Dense → Normalize, with task prompts and no default_prompt_name.

Tolerance: cos >= 0.99999 and max abs diff <= 1e-5 (float32; summation order differs between
the packed path and transformers' padded SDPA).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_decoders import BOS, CORPUS, EOS, save_tokenizer

from tidepool import LLM, PoolingParams
from tidepool.attention import cpu_kernels
from tidepool.attention.backend import BUCKETED_SDPA, CPU_KERNEL

WINDOW_IN_CONFIG = 16
WINDOW = WINDOW_IN_CONFIG // 2 + 1
HIDDEN = 96
PROMPTS = {
    "query": "task: search result | query: ",
    "document": "title: none | text: ",
    "Clustering": "task: clustering | query: ",
    "STS": "task: sentence similarity | query: ",
}
TEXTS = [CORPUS[3] + " " + CORPUS[4] + " " + CORPUS[5], "Hello world!", *CORPUS[:3], CORPUS[7]]
CONFIG = dict(
    hidden_size=HIDDEN,
    intermediate_size=192,
    num_hidden_layers=4,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=32,
    query_pre_attn_scalar=24,
    sliding_window=WINDOW_IN_CONFIG,
    sliding_window_pattern=2,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rope_local_base_freq=100.0,
    initializer_range=0.05,
    rms_norm_eps=1e-6,
    use_bidirectional_attention=True,
    pad_token_id=0,
    bos_token_id=BOS,
    eos_token_id=EOS,
)
ATOL = 1e-5
RAW = PoolingParams(normalize=False)


def _save_tokenizer(folder: Path) -> int:
    """tiny_decoders' BPE as EmbeddingGemma's tokenizer behaves: <bos> text <eos>, and no chat
    template (sentence-transformers 6 renders texts through a tokenizer's chat template)."""
    from tokenizers import Tokenizer, processors

    vocab_size = save_tokenizer(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A <|eos|>", special_tokens=[("<|bos|>", BOS), ("<|eos|>", EOS)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    return vocab_size


def _save_hf_body(folder: Path, seed: int) -> None:
    import transformers

    folder.mkdir(parents=True)
    vocab_size = _save_tokenizer(folder)
    config = transformers.Gemma3TextConfig(vocab_size=vocab_size, **CONFIG)
    assert config.sliding_window == WINDOW
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    torch.manual_seed(seed)
    model = transformers.Gemma3TextModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(str(folder))


@pytest.fixture(scope="module")
def gemma_st(tmp_path_factory) -> tuple[Path, object]:
    """(folder, SentenceTransformer reloaded from it): the reference."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Transformer,
    )

    root = tmp_path_factory.mktemp("embedding_gemma")
    body, folder = root / "body", root / "st"
    _save_hf_body(body, seed=61)
    torch.manual_seed(62)
    identity = torch.nn.Identity()
    modules = [
        Transformer(str(body)),
        Pooling(HIDDEN, "mean"),
        Dense(HIDDEN, 4 * HIDDEN, bias=False, activation_function=identity),
        Dense(4 * HIDDEN, HIDDEN, bias=False, activation_function=identity),
        Normalize(),
    ]
    st = SentenceTransformer(modules=modules, device="cpu", prompts=PROMPTS)
    st.save(str(folder))
    return folder, SentenceTransformer(str(folder), device="cpu")


@pytest.fixture(scope="module")
def gemma_llm(gemma_st) -> LLM:
    return LLM(str(gemma_st[0]), device="cpu", dtype="float32")


def _backends() -> list:
    return [BUCKETED_SDPA] + ([CPU_KERNEL] if cpu_kernels.load() is not None else [])


def _embed(llm: LLM, texts: list[str], **kwargs) -> torch.Tensor:
    outs = llm.embed(texts, use_tqdm=False, **kwargs)
    return torch.tensor([o.outputs.embedding for o in outs])


def test_reference_is_the_embedding_gemma_layout(gemma_st, gemma_llm):
    """sentence-transformers reads the folder as EmbeddingGemma's pipeline, and so do we."""
    folder, st = gemma_st
    kinds = [type(m).__name__ for m in st]
    assert kinds == ["Transformer", "Pooling", "Dense", "Dense", "Normalize"]
    assert type(st[0].auto_model).__name__ == "Gemma3TextModel"
    assert st[0].auto_model.config.use_bidirectional_attention
    assert json.loads((folder / "config.json").read_text())["sliding_window"] == WINDOW_IN_CONFIG
    assert st.prompts == PROMPTS and st.default_prompt_name is None
    assert "message" not in st[0].modality_config  # texts tokenized as they are
    ids = gemma_llm.get_tokenizer()(TEXTS[1])["input_ids"]
    assert ids[0] == BOS and ids[-1] == EOS
    assert st.tokenize([TEXTS[1]])["input_ids"][0].tolist() == ids
    config = gemma_llm.model_config
    assert config.architecture == "Gemma3TextEncoderModel" and config.model_impl == "native"
    assert not config.is_causal and config.st.pooling_mode == "MEAN" and config.st.normalize
    assert [d.weight.shape for d in config.st.dense] == [(4 * HIDDEN, HIDDEN), (HIDDEN, 4 * HIDDEN)]
    assert all(d.bias is None and d.activation == "identity" for d in config.st.dense)
    model = gemma_llm.engine.model_runner.model
    windows = [layer.self_attn.sliding_window for layer in model.layers]
    assert windows == [WINDOW, None, WINDOW, None]
    lengths = [len(ids) for ids in gemma_llm.get_tokenizer()(TEXTS)["input_ids"]]
    assert min(lengths) < WINDOW < 2 * WINDOW < max(lengths)  # short ones and far past it


@pytest.mark.parametrize("prompt_name", [None, "query", "document", "STS"])
def test_embeddings_match_sentence_transformers(prompt_name, gemma_st, gemma_llm, report_tolerance):
    st = gemma_st[1]
    expected = torch.from_numpy(st.encode(TEXTS, prompt_name=prompt_name))
    model = gemma_llm.engine.model_runner.model
    for backend in _backends():
        model.set_attention_backend(backend)
        got = _embed(gemma_llm, TEXTS, prompt_name=prompt_name)
        name = f"tiny EmbeddingGemma prompt={prompt_name} ({backend.name})"
        measured = report_tolerance(name, got, expected)
        assert measured.worst_cosine >= 0.99999, backend.name
        assert measured.max_abs_diff <= ATOL, backend.name
    assert got.shape == (len(TEXTS), HIDDEN)


def test_prompt_and_window_are_exercised(gemma_st, gemma_llm):
    """Guards: a prompt changes the embedding, and so does the window (the sliding layers
    attending to everything would be far from the reference)."""
    st = gemma_st[1]
    plain = _embed(gemma_llm, TEXTS)
    query = _embed(gemma_llm, TEXTS, prompt_name="query")
    assert F.cosine_similarity(plain, query).max() < 0.999
    model = gemma_llm.engine.model_runner.model
    sliding = [layer.self_attn for layer in model.layers if layer.self_attn.sliding_window]
    try:
        for attention in sliding:
            attention.sliding_window = None
        no_window = _embed(gemma_llm, TEXTS[:1])
    finally:
        for attention in sliding:
            attention.sliding_window = WINDOW
    expected = torch.from_numpy(st.encode(TEXTS[:1]))
    assert (no_window - expected).abs().max() > 100 * ATOL


def test_batch_invariance(gemma_llm):
    model = gemma_llm.engine.model_runner.model
    for backend in _backends():
        model.set_attention_backend(backend)
        batched = _embed(gemma_llm, TEXTS, pooling_params=RAW)
        alone = torch.cat([_embed(gemma_llm, [t], pooling_params=RAW) for t in TEXTS])
        assert F.cosine_similarity(batched[:1], batched[1:]).max() < 0.999  # distinct outputs
        assert (batched - alone).abs().max() <= ATOL, backend.name


def test_transformers_backend_matches_too(gemma_st):
    """model_impl="transformers" runs the HF modules with tidepool's attention, bidirectionally."""
    llm = LLM(str(gemma_st[0]), device="cpu", dtype="float32", model_impl="transformers")
    assert llm.model_config.architecture == "Gemma3TextModel" and not llm.model_config.is_causal
    expected = torch.from_numpy(gemma_st[1].encode(TEXTS, prompt_name="query"))
    got = _embed(llm, TEXTS, prompt_name="query")
    assert F.cosine_similarity(got, expected).min() >= 0.99999


def test_generate_runner_is_refused(gemma_st):
    with pytest.raises(ValueError, match="use_bidirectional_attention=True.*as an encoder"):
        LLM(str(gemma_st[0]), device="cpu", runner="generate")


def test_causal_gemma3_checkpoint_stays_a_decoder(gemma_st, tmp_path):
    """The same weights without the flag: gemma.py's causal Gemma3TextModel, LAST pooling."""
    body = gemma_st[0].parent / "body"
    folder = tmp_path / "causal"
    folder.mkdir()
    for file in body.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["use_bidirectional_attention"] = False
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder), device="cpu", dtype="float32")
    assert llm.model_config.architecture == "Gemma3TextModel" and llm.model_config.is_causal
    assert llm.engine.model_runner.pooler.pooling_type == "LAST"


def test_server_prompt_name(gemma_st, gemma_llm):
    """/v1/embeddings with TEI's prompt_name field gives sentence-transformers' embedding."""
    from fastapi.testclient import TestClient

    from tidepool.engine.async_engine import AsyncEngine
    from tidepool.entrypoints.openai.server import build_app

    expected = gemma_st[1].encode(TEXTS[:2], prompt_name="document")
    engine = AsyncEngine.from_args(str(gemma_st[0]), device="cpu", dtype="float32")
    with TestClient(build_app(engine)) as client:
        answer = client.post("/v1/embeddings", json={"input": TEXTS[:2], "prompt_name": "document"})
        assert answer.status_code == 200, answer.text
        got = np.asarray([row["embedding"] for row in answer.json()["data"]])
        assert (got * expected).sum(axis=1).min() >= 0.99999
        answer = client.post("/v1/embeddings", json={"input": "x", "prompt_name": "Retrieval"})
        assert answer.status_code == 400 and "Clustering" in answer.json()["error"]["message"]
