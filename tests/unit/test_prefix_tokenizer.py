"""PrefixTokenizer: the tokens it keeps from a prefix are exactly the full text's first tokens.

Checked against tokenizing the whole text, on random texts built to hit every way a cut could
change a token (words cut in half, whitespace runs, added tokens such as "[SEP]" or "<|eos|>"
written in the text, combining marks, control characters, CJK, digits, words longer than
WordPiece's 100 characters), with four tokenizers: the bundled MiniLM's WordPiece, the tiny
byte-level BPE and Unigram (Metaspace, NFKC) of the tiny encoders, and the tiny decoders' BPE.
The read sizes are shrunk so that almost every text is cut, several times.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from unittest import mock

import pytest
from conftest import save_roberta_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_decoders import save_tokenizer
from tokenizers import Tokenizer

from tidepool.engine import prefix_tokenizer
from tidepool.engine.prefix_tokenizer import PrefixTokenizer

PIECES = [
    "the", "tide", "pool", "is", "deep", "er", "than", "it", "looks", "Ünïcödé", "naïve",
    " ", " ", " ", "  ", "   ", "\n", "\t", "\r\n", "\u3000", "\xa0",
    ".", ",", "!", "?", "'s", "'t", "-", "(", ")", "\"",
    "0", "12", "2024", "3.14",
    "[SEP]", "[CLS]", "[MASK]", "<s>", "</s>", "<mask>", "<|eos|>", "<|bos|>", "[SE", "P]",
    "中文", "日本語", "🙂", "👍🏽",
    "e\u0301", "\u0301", "\u0308\u0308", "\x00", "\x01", "\x7f", "\u200b", "\ufeff", "\ufffe",
    "שלום", "مرحبا", "\u202e", "\u202d",
    "a" * 120, "z" * 40,
]  # fmt: skip

TEXTS = st.lists(
    st.sampled_from(PIECES)
    | st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=4),
    min_size=1,
    max_size=120,
).map("".join)


@pytest.fixture(scope="module")
def backends(minilm_path: Path, tmp_path_factory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("prefix_tokenizers")
    for kind in ("bpe", "unigram", "decoder"):
        (root / kind).mkdir()
    save_roberta_tokenizer(root / "bpe", "bpe")
    save_roberta_tokenizer(root / "unigram", "unigram")
    save_tokenizer(root / "decoder")
    paths = {
        "wordpiece": minilm_path / "tokenizer.json",
        **{kind: root / kind / "tokenizer.json" for kind in ("bpe", "unigram", "decoder")},
    }
    out = {}
    for kind, path in paths.items():
        backend = Tokenizer.from_file(str(path))
        backend.no_truncation()
        backend.no_padding()
        out[kind] = backend
    return out


def _full_ids(backend: Tokenizer, text: str) -> list[int]:
    return backend.encode(text, add_special_tokens=False).ids


_PREFIX_TOKENIZERS: dict[int, PrefixTokenizer] = {}


def _prefix_tokenizer(backend: Tokenizer) -> PrefixTokenizer:
    # One per backend: building one copies the tokenizer (tens of milliseconds).
    if id(backend) not in _PREFIX_TOKENIZERS:
        _PREFIX_TOKENIZERS[id(backend)] = PrefixTokenizer(backend)
    return _PREFIX_TOKENIZERS[id(backend)]


def _check(backend: Tokenizer, texts: list[str], wanted: list[int]) -> list:
    firsts = _prefix_tokenizer(backend).first_tokens(texts, wanted)
    for text, num_wanted, first in zip(texts, wanted, firsts, strict=True):
        full = _full_ids(backend, text)
        assert first.token_ids == full[: first.num_tokens], (text, num_wanted)
        if first.complete:
            assert first.num_tokens == len(full) and first.num_chars_read == len(text)
        else:
            assert first.num_chars_read < len(text)
            limit = prefix_tokenizer.read_limit(num_wanted)
            assert first.num_tokens >= num_wanted or first.num_chars_read >= limit
    return firsts


@settings(
    max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)
@given(data=st.data())
def test_prefix_tokens_equal_the_full_texts_first_tokens(backends, data):
    texts = data.draw(st.lists(TEXTS, min_size=1, max_size=4))
    wanted = data.draw(st.lists(st.integers(1, 60), min_size=len(texts), max_size=len(texts)))
    # Tiny reads: the first prefix is 2 characters per wanted token, so most texts are cut.
    with (
        mock.patch.object(prefix_tokenizer, "MIN_CHARS", 4),
        mock.patch.object(prefix_tokenizer, "FIRST_CHARS_PER_TOKEN", 2),
        mock.patch.object(prefix_tokenizer, "CHARS_PER_TOKEN", 8),
    ):
        for backend in backends.values():
            _check(backend, texts, wanted)


def test_many_seeded_random_texts_at_real_sizes(backends):
    """Long texts at the real read sizes: the cut lands inside words, runs and added tokens."""
    rng = random.Random(18)
    texts = ["".join(rng.choices(PIECES, k=rng.randint(2_000, 6_000))) for _ in range(12)]
    wanted = [rng.choice([1, 7, 126, 300, 509]) for _ in texts]
    num_cut = 0
    for backend in backends.values():
        firsts = _check(backend, texts, wanted)
        num_cut += sum(not f.complete for f in firsts)
    assert num_cut > 20  # the cut path ran


def test_growth_when_the_first_prefix_is_short_of_tokens(backends):
    # Spaces first: the first prefix (4,096 characters) has no token, the next one has enough.
    text = " " * 5_000 + "the tide pool is deep " * 2_000
    [first] = _check(backends["wordpiece"], [text], [300])
    assert not first.complete and first.num_tokens >= 300
    assert 5_000 < first.num_chars_read <= prefix_tokenizer.read_limit(300)


def test_sparse_text_stops_at_the_read_limit(backends):
    # 30 MB of spaces: no token anywhere; reading stops at the limit, not at the end.
    text = " " * 30_000_000
    start = time.perf_counter()
    [first] = _prefix_tokenizer(backends["wordpiece"]).first_tokens([text], [127])
    assert time.perf_counter() - start < 2.0
    assert not first.complete and first.num_tokens == 0
    assert first.num_chars_read == prefix_tokenizer.read_limit(127)


def test_template_matches_the_post_processor(backends):
    for kind, backend in backends.items():
        tok = PrefixTokenizer(backend)
        a = _full_ids(backend, "the tide pool")
        b = _full_ids(backend, "is deep")
        ref = backend.encode("the tide pool")
        assert tok.with_special_tokens(a) == (ref.ids, ref.type_ids), kind
        assert tok.num_special_tokens(pair=False) == len(ref.ids) - len(a)
        if kind != "decoder":  # the decoder has no pair template
            ref = backend.encode("the tide pool", "is deep")
            assert tok.with_special_tokens(a, b) == (ref.ids, ref.type_ids), kind
