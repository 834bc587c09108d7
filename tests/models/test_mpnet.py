"""Native MPNet (relative position bias) vs sentence-transformers / transformers, float32 on CPU.

The tiny model has 32-wide heads, so the embedder runs on tidepool's CPU attention kernel where
it is available (the bias read inside the kernel); every comparison also runs on the bucketed
SDPA path (the bias as an additive mask). Prompts run from 3 to ~300 tokens: past the exact
buckets (distance < 8), through the logarithmic ones and past max_distance 128.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import TINY_TEXTS, save_roberta_tokenizer, write_st_pooling

from tidepool import LLM, PoolingParams
from tidepool.attention import cpu_kernels
from tidepool.attention.backend import BUCKETED_SDPA, CPU_KERNEL
from tidepool.models.mpnet import relative_position_bucket

RAW = PoolingParams(normalize=False)
TEXTS = [*TINY_TEXTS, " ".join(["a long passage about relative positions"] * 6)]
SIZES = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    max_position_embeddings=514,
    initializer_range=0.2,
)


def _build(folder: Path, head: bool) -> None:
    folder.mkdir()
    vocab_size = save_roberta_tokenizer(folder, "bpe")
    torch.manual_seed(40 + head)
    config = transformers.MPNetConfig(vocab_size=vocab_size, num_labels=1, **SIZES)
    cls = transformers.MPNetForSequenceClassification if head else transformers.MPNetModel
    model = cls(config).eval()
    with torch.no_grad():  # a table far from zero, so a bucket mix-up shows
        model.base_model.encoder.relative_attention_bias.weight.normal_(0, 1.0)
    model.save_pretrained(str(folder))
    if not head:
        write_st_pooling(folder, "mean")


@pytest.fixture(scope="module")
def mpnet_paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mpnet")
    paths = {"embed": root / "embed", "score": root / "score"}
    _build(paths["embed"], head=False)
    _build(paths["score"], head=True)
    return paths


@pytest.fixture(scope="module")
def mpnet_llm(mpnet_paths) -> LLM:
    return LLM(str(mpnet_paths["embed"]), device="cpu", dtype="float32")


def _backends() -> list:
    return [BUCKETED_SDPA] + ([CPU_KERNEL] if cpu_kernels.load() is not None else [])


def _embed(llm: LLM, texts: list[str]) -> torch.Tensor:
    outs = llm.embed(texts, pooling_params=RAW, use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outs])


def test_bucket_function_equals_transformers():
    distances = torch.arange(-300, 301)
    theirs = transformers.models.mpnet.modeling_mpnet.MPNetEncoder.relative_position_bucket(
        distances
    )
    assert torch.equal(relative_position_bucket(distances), theirs)
    # Every bucket but 16 (distance "-0") is reached by the test distances.
    assert len(set(theirs.tolist())) == 31


def test_embeddings_match_sentence_transformers(mpnet_paths, mpnet_llm, report_tolerance):
    from sentence_transformers import SentenceTransformer

    path = mpnet_paths["embed"]
    expected = torch.from_numpy(SentenceTransformer(str(path), device="cpu").encode(TEXTS))
    llm = mpnet_llm
    assert llm.model_config.model_impl == "native"
    model = llm.engine.model_runner.model
    assert type(model).__name__ == "MPNetModel"
    for backend in _backends():
        model.set_attention_backend(backend)
        got = _embed(llm, TEXTS)
        measured = report_tolerance(f"tiny MPNet MEAN ({backend.name})", got, expected)
        assert measured.worst_cosine >= 0.99999, backend.name
        assert measured.max_abs_diff <= 1e-5, backend.name
    # Guard: a model without the bias is far away, so the bias is exercised.
    hf = transformers.MPNetModel.from_pretrained(str(path)).eval()
    with torch.no_grad():
        hf.encoder.relative_attention_bias.weight.zero_()
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    with torch.inference_mode():
        no_bias = hf(**tok(TEXTS[-1], return_tensors="pt")).last_hidden_state[0].mean(0)
    assert (no_bias - expected[-1]).abs().max() > 1e-2


def test_cross_encoder_scores_match_sentence_transformers(mpnet_paths):
    from sentence_transformers import CrossEncoder

    path = mpnet_paths["score"]
    queries = [TEXTS[i % len(TEXTS)] for i in range(8)]
    docs = [TEXTS[(3 * i + 1) % len(TEXTS)] for i in range(8)]
    pairs = list(zip(queries, docs, strict=True))
    expected = torch.tensor(CrossEncoder(str(path), device="cpu").predict(pairs))
    llm = LLM(str(path), device="cpu", dtype="float32")
    assert llm.model_config.task == "classify"
    model = llm.engine.model_runner.model
    for backend in _backends():
        model.set_attention_backend(backend)
        got = torch.tensor([o.outputs.score for o in llm.score(queries, docs, use_tqdm=False)])
        assert (got - expected).abs().max() <= 1e-5, backend.name
    assert len({round(float(s), 4) for s in expected}) > 4  # distinct scores


def test_batch_invariance(mpnet_llm):
    llm = mpnet_llm
    model = llm.engine.model_runner.model
    for backend in _backends():
        model.set_attention_backend(backend)
        batched = _embed(llm, TEXTS)
        alone = torch.cat([_embed(llm, [t]) for t in TEXTS])
        assert F.cosine_similarity(batched[:1], batched[1:]).max() < 0.999  # distinct outputs
        assert (batched - alone).abs().max() <= 1e-5, backend.name


@pytest.mark.skipif(
    not __import__("tidepool.quantization.int8_linear", fromlist=["x"]).int8_gemm_available(),
    reason="this torch build has no oneDNN int8 linear",
)
def test_int8_close_to_float32(mpnet_paths, mpnet_llm):
    """quantization="int8" on MPNet (issue 14: each new native model in int8): vectors within the
    int8 suite's bound of float32 (cos >= 0.99); cross-encoder scores (sigmoid) within 0.05: the
    tiny random MPNet measured 0.027 (BERT's 0.02 bound is too tight for its relative-bias logits),
    well inside the spread of the scores themselves (0.47-0.85)."""
    int8 = LLM(str(mpnet_paths["embed"]), device="cpu", quantization="int8")
    cos = F.cosine_similarity(_embed(int8, TEXTS), _embed(mpnet_llm, TEXTS))
    assert cos.min() >= 0.99, cos
    docs = TEXTS[1:]
    scores = {
        q: torch.tensor(
            [
                o.outputs.score
                for o in LLM(str(mpnet_paths["score"]), quantization=q).score(
                    TEXTS[0], docs, use_tqdm=False
                )
            ]
        )
        for q in (None, "int8")
    }
    assert (scores["int8"] - scores[None]).abs().max() < 0.05
