"""Native T5 encoders (sentence-t5 / GTR layout) vs sentence-transformers, float32 on CPU.

Each tiny model is a sentence-transformers folder as sentence-t5 ships it: Transformer
(T5EncoderModel / MT5EncoderModel) → Pooling mean → Dense (no bias, identity) → Normalize, built
and saved by sentence-transformers itself. Two variants: T5 with a plain ReLU FFN, mT5 with the
gated-gelu FFN. 8 buckets out to max_distance 16, prompts of 1 to 40 tokens: every exact and
log bucket and the clamp beyond max_distance are crossed. Heads are 32 wide (4 heads, inner 128 !=
d_model 64), so the CPU attention kernel runs where it is available; every comparison also runs on
the bucketed SDPA path. The tokenizer is transformers' T5Tokenizer (a tokenizers Unigram, no
sentencepiece needed) over a hand-made vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import TINY_TEXTS

from tidepool import LLM, PoolingParams
from tidepool.attention import cpu_kernels
from tidepool.attention.backend import BUCKETED_SDPA, CPU_KERNEL
from tidepool.attention.relative_bias import bidirectional_bucket

RAW = PoolingParams(normalize=False)
TEXTS = [*TINY_TEXTS, " ".join(["a long passage about relative positions"] * 8)]
SIZES = dict(
    d_model=64,
    d_kv=32,
    num_heads=4,
    num_layers=2,
    d_ff=128,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    dropout_rate=0.0,
)
MAX_SEQ_LENGTH = 40  # the longest test text is truncated (T5 has no position limit of its own)
VARIANTS = {
    "t5-relu": (transformers.T5Config, transformers.T5EncoderModel, "relu"),
    "mt5-gated-gelu": (transformers.MT5Config, transformers.MT5EncoderModel, "gated-gelu"),
}


def save_t5_tokenizer(folder: Path) -> int:
    """A T5Tokenizer (<pad>=0, </s>=1, <unk>=2) whose words are the test texts' words."""
    words = sorted({"▁" + w for text in TEXTS for w in text.split()})
    chars = sorted({c for text in TEXTS for c in text if not c.isspace()} | {"▁"})
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(w, -5.0) for w in words] + [(c, -10.0) for c in chars]
    tokenizer = transformers.T5Tokenizer(vocab=vocab, extra_ids=0)
    tokenizer.save_pretrained(str(folder))
    return len(tokenizer)


def _build(root: Path, variant: str, seed: int) -> Path:
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers >= 6 (its old `models` path warns)
        from sentence_transformers.sentence_transformer import modules as models
    except ImportError:
        from sentence_transformers import models

    config_cls, model_cls, ffn = VARIANTS[variant]
    hf_folder, st_folder = root / f"{variant}-hf", root / variant
    vocab_size = save_t5_tokenizer(hf_folder)
    torch.manual_seed(seed)
    config = config_cls(vocab_size=vocab_size, feed_forward_proj=ffn, **SIZES)
    model = model_cls(config).eval()
    with torch.no_grad():  # a bias table and norms far from their init, so mix-ups show
        for name, param in model.named_parameters():
            if "relative_attention_bias" in name:
                param.normal_(0.0, 1.0)
            elif "layer_norm" in name:
                param.normal_(1.0, 0.3)
    model.save_pretrained(str(hf_folder))
    dense = models.Dense(64, 64, bias=False, activation_function=torch.nn.Identity())
    # max_seq_length: sentence-transformers 6 keeps it as the tokenizer's model_max_length.
    body = models.Transformer(str(hf_folder), max_seq_length=MAX_SEQ_LENGTH)
    modules = [body, models.Pooling(64, "mean"), dense]
    SentenceTransformer(modules=[*modules, models.Normalize()], device="cpu").save(str(st_folder))
    return st_folder


@pytest.fixture(scope="module")
def t5_paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("t5")
    return {variant: _build(root, variant, 60 + i) for i, variant in enumerate(VARIANTS)}


@pytest.fixture(scope="module")
def t5_llms(t5_paths) -> dict[str, LLM]:
    return {v: LLM(str(path), device="cpu", dtype="float32") for v, path in t5_paths.items()}


def _backends() -> list:
    return [BUCKETED_SDPA] + ([CPU_KERNEL] if cpu_kernels.load() is not None else [])


def _embed(llm: LLM, texts: list[str], params: PoolingParams = RAW) -> torch.Tensor:
    # -1: truncate at max_model_len, as sentence-transformers does (tidepool refuses otherwise).
    outs = llm.embed(texts, truncate_prompt_tokens=-1, pooling_params=params, use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outs])


def test_bucket_function_equals_transformers():
    t5_bucket = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket
    distances = torch.arange(-300, 301)
    for num_buckets, max_distance in ((8, 16), (32, 128)):
        theirs = t5_bucket(distances, True, num_buckets, max_distance)
        assert torch.equal(bidirectional_bucket(distances, num_buckets, max_distance), theirs)
        assert len(set(theirs.tolist())) == num_buckets - 1  # all but "-0" (num_buckets / 2)


@pytest.mark.parametrize("variant", VARIANTS)
def test_embeddings_match_sentence_transformers(variant, t5_paths, t5_llms, report_tolerance):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(t5_paths[variant]), device="cpu")
    assert type(st[0].auto_model).__name__ == VARIANTS[variant][1].__name__
    expected = torch.from_numpy(st.encode(TEXTS))  # Dense and Normalize applied
    # The longest text fills max_seq_length, past max_distance 16; both sides truncate there.
    assert st.tokenize(TEXTS)["input_ids"].shape[1] == MAX_SEQ_LENGTH
    llm = t5_llms[variant]
    assert llm.model_config.model_impl == "native"
    assert llm.model_config.max_model_len == MAX_SEQ_LENGTH
    model = llm.engine.model_runner.model
    assert type(model).__name__ == VARIANTS[variant][1].__name__
    for backend in _backends():
        model.set_attention_backend(backend)
        got = _embed(llm, TEXTS, PoolingParams())
        measured = report_tolerance(f"tiny {variant} MEAN+Dense ({backend.name})", got, expected)
        assert measured.worst_cosine >= 0.99999, backend.name
        assert measured.max_abs_diff <= 1e-5, backend.name
    # Guard: without the bias table the outputs move far, so the bias is exercised.
    table = model.encoder.relative_attention_bias.weight
    saved = table.clone()
    try:
        table.zero_()
        no_bias = _embed(llm, TEXTS[-1:], PoolingParams())
    finally:
        table.copy_(saved)
    assert (no_bias[0] - expected[-1]).abs().max() > 1e-2


@pytest.mark.parametrize("variant", VARIANTS)
def test_batch_invariance(variant, t5_llms):
    llm = t5_llms[variant]
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
@pytest.mark.parametrize("variant", VARIANTS)
def test_int8_close_to_float32(variant, t5_paths, t5_llms):
    """quantization="int8" on T5 / mT5 (issue 14: each new native model in int8): every linear
    int8, vectors within the int8 suite's bound of float32 (cos >= 0.99)."""
    from tidepool.quantization.int8_linear import Int8Linear

    int8 = LLM(str(t5_paths[variant]), device="cpu", quantization="int8")
    model = int8.engine.model_runner.model
    assert any(isinstance(m, Int8Linear) for m in model.modules())
    cos = F.cosine_similarity(_embed(int8, TEXTS), _embed(t5_llms[variant], TEXTS))
    assert cos.min() >= 0.99, cos
