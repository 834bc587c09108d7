"""SigLIP 1's SentencePiece-only tokenizer, converted at load (checkpoint/siglip_tokenizer.py).

The reference is transformers' own SiglipTokenizer (the slow SentencePiece backend) on the same
folder: a small Unigram spiece.model trained here with sentencepiece (fixed seed and options,
vocabulary 300) and saved with SiglipTokenizer.save_pretrained, as the Hub's google/siglip-*
folders are (spiece.model and tokenizer_config.json, no tokenizer.json). Token ids must be equal,
with and without special tokens and padded to max_length as SiglipProcessor does, on a fixed
corpus of odd Unicode and on hypothesis-generated texts; then a tiny SiglipModel whose tokenizer
is such a folder loads in tidepool.LLM and its text embeddings equal transformers'
get_text_features on SiglipTokenizer's ids (the float32 bound of tests/models/test_siglip.py).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from multimodal_models import (
    CLIP_VISION,
    SIGLIP_TEXT,
    SIGLIP_TEXT_LEN,
    build_siglip,
)
from tolerances import assert_close

from tidepool import LLM, PoolingParams
from tidepool.checkpoint.siglip_tokenizer import convert, load_tokenizer, needs_conversion

VOCAB = 300
MAX_LENGTH = 64  # SiglipTokenizer's default model_max_length, what SiglipProcessor pads to
SYLLABLES = "ka ri to na me su lo pe di gu ba ne shi cha tho qu ve zo xi wy".split()
EXTRA_WORDS = "café naïve über Ünïcode ñandú 東京 北京 😀 ΑΣΤΡΟ σοφία".split()
SPECIAL = ("</s>", "<unk>")

CORPUS = [
    "",
    " ",
    "\t\n",
    "!!",
    "kari tona",
    "Kari, TONA!!  ",
    "  leading and trailing spaces  ",
    "café naïve über",
    "cafe\u0301 nai\u0308ve",  # combining accents
    "東京 北京 東京北京",
    "😀😀 kari 😀",
    "a\tb\nc\r\nd\x0be\x0cf",
    "ＫＡＲＩ！ ｔｏｎａ",  # full-width: NFKC after the punctuation removal keeps the "!"
    "¨kari ´to",  # NFKC gives a space
    "Ünïcode ñandú ẞ İstanbul",
    "ΑΣ ΑΣΑ Α'Σ ΣΑ σοφίαΣ.",  # final sigma
    "kari▁tona ▁ ▁▁",
    "kari...tona---me;;su",
    "ka\u3000ri\u00a0to\u2028na\x1cme\x85su",
    "\x00kari\x01 \x7fto",  # control characters the charsmap drops
    "ﬁ ﬂ ① ② ㎏",
    "x<unk>y",
    "<pad> pad",
    "жжж kari жж",  # unknown characters, fused
    "a" * 200,
    " ".join(SYLLABLES * 3),
]


def _train_spiece(folder: Path, model_type: str = "unigram", **options) -> Path:
    """A small spiece.model trained on a few hundred lines of fixed random text."""
    import sentencepiece as spm

    rng = random.Random(0)

    def word() -> str:
        if rng.random() < 0.1:
            return rng.choice(EXTRA_WORDS)
        return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))

    lines = [" ".join(word() for _ in range(rng.randint(3, 12))) for _ in range(400)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.txt").write_text("\n".join(lines), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"),
        model_prefix=str(folder / "m"),
        vocab_size=options.pop("vocab_size", VOCAB),
        model_type=model_type,
        character_coverage=1.0,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        num_threads=1,
        seed_sentencepiece_size=10000,
        minloglevel=2,
        **options,
    )
    return folder / "m.model"


def _save_siglip_tokenizer(folder: Path, spiece: Path, **kwargs):
    from transformers import SiglipTokenizer

    tokenizer = SiglipTokenizer(vocab_file=str(spiece), **kwargs)
    tokenizer.save_pretrained(str(folder))
    assert not (folder / "tokenizer.json").exists()
    return tokenizer


@pytest.fixture(scope="module")
def spiece(tmp_path_factory) -> Path:
    return _train_spiece(tmp_path_factory.mktemp("spiece"))


@pytest.fixture(scope="module")
def tokenizers(spiece, tmp_path_factory):
    """(SiglipTokenizer loaded from the folder, the converted fast tokenizer)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("siglip_tok")
    _save_siglip_tokenizer(folder, spiece)
    slow = AutoTokenizer.from_pretrained(str(folder))
    assert type(slow).__name__ == "SiglipTokenizer"
    assert needs_conversion(folder)
    fast = load_tokenizer(str(folder))
    assert fast.backend_tokenizer is not None
    return slow, fast


def _assert_same_ids(slow, fast, texts: list[str]) -> None:
    for text in texts:
        for special in (True, False):
            expected = slow(text, add_special_tokens=special)["input_ids"]
            got = fast(text, add_special_tokens=special)["input_ids"]
            assert got == expected, (text, special, slow.tokenize(text), fast.tokenize(text))
    expected = slow(texts, padding="max_length", max_length=MAX_LENGTH, truncation=True)
    got = fast(texts, padding="max_length", max_length=MAX_LENGTH, truncation=True)
    assert dict(got) == dict(expected)  # input_ids, and attention_mask where the names have it


def test_converted_ids_equal_siglip_tokenizer_on_a_fixed_corpus(tokenizers):
    slow, fast = tokenizers
    _assert_same_ids(slow, fast, CORPUS)
    # The corpus exercises what it means to: unknown pieces, the "▁" piece, EOS, truncation.
    ids = [fast(t)["input_ids"] for t in CORPUS]
    assert any(slow.unk_token_id in i[:-1] for i in ids)
    assert all(i[-1] == slow.eos_token_id for i in ids)
    assert max(map(len, ids)) > MAX_LENGTH


def test_lower_case_is_pythons_where_rust_differs(tokenizers):
    """Characters whose lower case tokenizers' (Rust's, newer Unicode) Lowercase writes otherwise
    than str.lower keep Python's, and Σ follows Python's final-sigma rule; the private-use
    escape character passes through. Checked on the normalizer steps themselves: the tiny
    vocabulary has none of these letters, so token ids alone could not tell."""
    from tokenizers import normalizers

    from tidepool.checkpoint.siglip_tokenizer import _MARK, _lowercase_steps, lowercase_fixes

    slow, fast = tokenizers
    chars = "".join(c for c, _ in lowercase_fixes())
    texts = [
        chars,
        f"ka{chars[:3]}ri {_MARK}01 {_MARK}{_MARK}0 ΑΣ{chars[:1]} {_MARK}00",
        "ΑΣ ΑΣΑ Α'Σ Α'Σ'Α Σ 1Σ ΑΣ. ΑΣ\u0301 Α\u0301Σ ΣΣ İ ẞ ǅ",
    ]
    lower = normalizers.Sequence(_lowercase_steps())
    for text in texts:
        assert lower.normalize_str(text) == text.lower()
    _assert_same_ids(slow, fast, texts)


def test_converted_tokenizer_keeps_the_special_tokens_and_settings(tokenizers):
    slow, fast = tokenizers
    for name in ("eos_token", "pad_token", "unk_token"):
        assert getattr(fast, name) == getattr(slow, name)
        assert getattr(fast, name + "_id") == getattr(slow, name + "_id")
    assert fast.model_max_length == slow.model_max_length == MAX_LENGTH
    assert fast.padding_side == slow.padding_side
    assert fast.model_input_names == slow.model_input_names
    assert len(fast) == len(slow) == VOCAB


_TOKEN = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


@pytest.mark.parametrize("with_decoder", [True, False])
def test_hub_layout_with_special_tokens_map(spiece, tmp_path, with_decoder):
    """The layout of the Hub's google/siglip-* folders (saved by transformers 4): a
    tokenizer_config.json with processor_class, additional_special_tokens [], model_input_names
    ["input_ids"], beside a special_tokens_map.json, which transformers reads only when the
    config has no added_tokens_decoder."""
    from transformers import AutoTokenizer

    folder = tmp_path / "hub"
    folder.mkdir()
    shutil.copy(spiece, folder / "spiece.model")
    config = {
        "additional_special_tokens": [],
        "clean_up_tokenization_spaces": True,
        "do_lower_case": True,
        "eos_token": "</s>",
        "model_input_names": ["input_ids"],
        "model_max_length": 64,
        "pad_token": "</s>",
        "processor_class": "SiglipProcessor",
        "sp_model_kwargs": {},
        "tokenizer_class": "SiglipTokenizer",
        "unk_token": "<unk>",
    }
    if with_decoder:
        config["added_tokens_decoder"] = {
            "1": {"content": "</s>", "special": True, **_TOKEN},
            "2": {"content": "<unk>", "special": True, **_TOKEN},
        }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    special = {k: {"content": config[k], **_TOKEN} for k in ("eos_token", "pad_token", "unk_token")}
    (folder / "special_tokens_map.json").write_text(json.dumps(special))
    slow = AutoTokenizer.from_pretrained(str(folder))
    fast = load_tokenizer(str(folder))
    assert fast.backend_tokenizer is not None
    assert fast.model_input_names == slow.model_input_names == ["input_ids"]
    _assert_same_ids(slow, fast, CORPUS[:12])


def test_do_lower_case_false_keeps_the_case(spiece, tmp_path):
    from transformers import AutoTokenizer

    folder = _folder_with(tmp_path, spiece, do_lower_case=False)
    slow = AutoTokenizer.from_pretrained(str(folder))
    fast = convert(folder)
    _assert_same_ids(slow, fast, CORPUS)
    assert fast("KARI")["input_ids"] != fast("kari")["input_ids"]


def test_model_input_names_pass_through(spiece, tmp_path):
    """A tokenizer_config.json with model_input_names ["input_ids"] (no attention_mask: the
    pads are attended, as get_text_features does then) keeps it."""
    folder = _folder_with(tmp_path, spiece, model_input_names=["input_ids"])
    fast = convert(folder)
    assert fast.model_input_names == ["input_ids"]
    assert "attention_mask" not in fast(["ka ri"], padding="max_length")


_ALPHABET = st.one_of(
    st.sampled_from(list("kariton mesu lopedi AKRTNΣΑσ'.,!?-_()[]\"\t\n\r ")),
    st.sampled_from(["\u3000", "\u00a0", "\x1c", "\x85", "\u2581", "\x00", "\x7f", "\u200b"]),
    st.sampled_from(list("éèüñÜÑßẞİıΣσςΑΩ東京北😀¨´ＫＡ！ﬁ①\u0301\u0308ж")),
    st.characters(exclude_categories=("Cs",)),
)
_WORDS = st.sampled_from([*SYLLABLES, *EXTRA_WORDS])
_TEXT = st.lists(st.one_of(st.text(_ALPHABET, max_size=6), _WORDS), max_size=12).map("".join)


@settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(texts=st.lists(_TEXT.filter(lambda t: not any(s in t for s in SPECIAL)), max_size=4))
def test_converted_ids_equal_siglip_tokenizer_on_generated_text(tokenizers, texts):
    """Texts that do not spell a special token (see the next test for those)."""
    slow, fast = tokenizers
    if texts:
        _assert_same_ids(slow, fast, texts)


def test_known_differences_on_texts_that_spell_special_tokens(tokenizers):
    """The differences the module's docstring names, kept visible: SiglipTokenizer adds no EOS
    after a text ending in a literal "</s>" (the same ids once padded with "</s>"), and after a
    literal special token a part starting with punctuation or a control character gets a "▁"
    here (SiglipTokenizer strips it away before the part is encoded as a word's continuation);
    and a control piece spelled in full-width forms gets that piece."""
    slow, fast = tokenizers
    assert fast("kari </s>")["input_ids"] == slow("kari </s>")["input_ids"] + [slow.eos_token_id]
    padded = {"padding": "max_length", "max_length": MAX_LENGTH}
    assert fast("kari </s>", **padded)["input_ids"] == slow("kari </s>", **padded)["input_ids"]
    # Literal special tokens elsewhere agree.
    _assert_same_ids(slow, fast, ["</s> kari", "ka </s> ri", "<unk>", "x <unk> y", "  </s> ka"])
    for text in ("x </s>\x1cy", "x <unk>, y"):
        assert fast(text)["input_ids"] != slow(text)["input_ids"]
    # NFKC spelling a control piece: the Unigram model matches it, sentencepiece never does.
    assert fast("＜／ｓ＞")["input_ids"].count(slow.eos_token_id) == 2
    assert slow("＜／ｓ＞")["input_ids"].count(slow.eos_token_id) == 1


# ----------------------------------------------------------------------------- end to end


def _build_siglip_with_spiece(folder: Path, spiece: Path, seed: int = 7) -> torch.nn.Module:
    """A tiny SiglipModel (tests/multimodal_models.py's) whose tokenizer is a SiglipTokenizer
    folder (spiece.model, no tokenizer.json), padded to SIGLIP_TEXT_LEN."""
    import transformers

    tokenizer = transformers.SiglipTokenizer(
        vocab_file=str(spiece), model_max_length=SIGLIP_TEXT_LEN
    )
    model = build_siglip(folder, seed=seed, tokenizer=tokenizer)
    assert not (folder / "tokenizer.json").exists()
    return model


E2E_TEXTS = ["a photo of a kari", "hi!", "ΑΣ café 東京", "  Tona, me-su  ", "😀", "!!"]
DEPTH = SIGLIP_TEXT["num_hidden_layers"] + 2
REDUCTION = 3 * CLIP_VISION["patch_size"] ** 2  # as tests/models/test_siglip.py


@pytest.fixture(scope="module")
def siglip(spiece, tmp_path_factory):
    folder = tmp_path_factory.mktemp("siglip_spm") / "model"
    return folder, _build_siglip_with_spiece(folder, spiece)


def test_siglip_with_sentencepiece_only_tokenizer_matches_transformers(siglip, report_tolerance):
    """LLM loads the folder (the tokenizer converted) and its text embeddings equal
    get_text_features on SiglipTokenizer(padding="max_length") ids, within the bound of
    tests/models/test_siglip.py (rtol ~3.2e-4 of the magnitude: tests/tolerances.py, depth 4,
    the patch GEMM's 192-term reduction)."""
    from transformers import AutoTokenizer

    folder, model = siglip
    slow = AutoTokenizer.from_pretrained(str(folder))
    assert type(slow).__name__ == "SiglipTokenizer"
    inputs = slow(E2E_TEXTS, padding="max_length", return_tensors="pt")
    assert inputs["input_ids"].shape == (len(E2E_TEXTS), SIGLIP_TEXT_LEN)
    with torch.inference_mode():
        expected = model.get_text_features(**inputs).pooler_output

    llm = LLM(str(folder), device="cpu", dtype="float32")
    outs = llm.embed(E2E_TEXTS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    assert [list(o.prompt_token_ids) for o in outs] == inputs["input_ids"].tolist()
    got = torch.tensor([o.outputs.embedding for o in outs])
    report_tolerance("native tiny siglip, sentencepiece-only tokenizer", got, expected)
    assert F.cosine_similarity(got, expected, dim=-1).min() >= 0.9999
    assert_close(got, expected, depth=DEPTH, reduction=REDUCTION)
    # Guard: the texts' embeddings differ far more than the tolerance.
    error = (got - expected).abs().max()
    assert (expected[0] - expected[1]).abs().max() > 100 * error


def test_texts_spelling_a_special_piece_are_refused(siglip):
    """The known differences are all on texts that spell a special or control piece: LLM refuses
    those texts alone (directly and in NFKC's full-width forms), naming the piece; the other
    texts of the call run."""
    from tidepool.outputs import BatchInputError

    folder, _ = siglip
    llm = LLM(str(folder), device="cpu", dtype="float32")
    texts = ["x </s>\x1cy", "a photo of a kari", "x <unk>, y", "＜／ｓ＞"]
    with pytest.raises(BatchInputError) as caught:
        llm.embed(texts, use_tqdm=False)
    errors = {e.index: e.message for e in caught.value.errors}
    assert sorted(errors) == [0, 2, 3]
    assert "'</s>'" in errors[0] and "'<unk>'" in errors[2] and "'</s>'" in errors[3]
    assert all("special piece" in m for m in errors.values())
    assert caught.value.outputs[1] is not None and caught.value.outputs[0] is None


def test_truncated_texts_equal_siglip_tokenizer(siglip):
    """truncate_prompt_tokens on texts short, long and longer than the prefix tokenizer's first
    read (4096 characters): the ids SiglipTokenizer(truncation=True) keeps, then the pads."""
    from transformers import AutoTokenizer

    folder, _ = siglip
    slow = AutoTokenizer.from_pretrained(str(folder))
    rng = random.Random(1)
    words = [*SYLLABLES, *EXTRA_WORDS, "!!", "Σ", ","]
    texts = [" ".join(rng.choice(words) for _ in range(n)) for n in (5, 40, 1500)]
    assert len(texts[-1]) > 4096
    llm = LLM(str(folder), device="cpu", dtype="float32")
    for keep in (SIGLIP_TEXT_LEN, 10):
        params = PoolingParams(truncate_prompt_tokens=keep)
        outs = llm.embed(texts, pooling_params=params, use_tqdm=False)
        expected = slow(texts, truncation=True, max_length=keep, padding="max_length")["input_ids"]
        pads = [slow.pad_token_id] * (SIGLIP_TEXT_LEN - keep)
        assert [list(o.prompt_token_ids) for o in outs] == [e + pads for e in expected]


# ----------------------------------------------------------------------------- refusals


def _folder_with(tmp_path: Path, spiece: Path, edit=None, **kwargs) -> Path:
    folder = tmp_path / "tok"
    _save_siglip_tokenizer(folder, spiece, **kwargs)
    if edit is not None:
        path = folder / "tokenizer_config.json"
        config = json.loads(path.read_text())
        edit(config)
        path.write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c.update(sp_model_kwargs={"enable_sampling": True}), "sp_model_kwargs"),
        (lambda c: c.update(legacy=False), "legacy=False"),
        (lambda c: c.update(additional_special_tokens=["<x>"]), "additional_special_tokens"),
        (lambda c: c.update(split_special_tokens=True), "split_special_tokens"),
        (lambda c: c.update(add_prefix_space=True), "add_prefix_space not reproduced"),
        (lambda c: c.update(eos_token="<eos>"), "eos_token '<eos>' is not a piece"),
        (lambda c: c["added_tokens_decoder"].update({"7": {"content": "ka"}}), "added token 'ka'"),
    ],
)
def test_config_options_not_reproduced_are_refused(spiece, tmp_path, edit, match):
    folder = _folder_with(tmp_path, spiece, edit)
    assert needs_conversion(folder)
    with pytest.raises(ValueError, match=match):
        convert(folder)


def test_sentencepiece_models_not_reproduced_are_refused(tmp_path):
    bpe = _train_spiece(tmp_path / "bpe", model_type="bpe")
    with pytest.raises(ValueError, match="model_type 2 \\(not UNIGRAM\\)"):
        convert(_folder_with(tmp_path / "a", bpe))
    byte = _train_spiece(tmp_path / "byte", byte_fallback=True, vocab_size=VOCAB + 256)
    with pytest.raises(ValueError, match="byte_fallback"):
        convert(_folder_with(tmp_path / "b", byte))
    user = _train_spiece(tmp_path / "user", user_defined_symbols=["kari"])
    with pytest.raises(ValueError, match="a USER_DEFINED piece 'kari'"):
        convert(_folder_with(tmp_path / "c", user))
    identity = _train_spiece(tmp_path / "id", normalization_rule_name="identity")
    with pytest.raises(ValueError, match="empty precompiled_charsmap"):
        convert(_folder_with(tmp_path / "d", identity))


def test_llm_refuses_an_unreproduced_tokenizer_by_name(spiece, tmp_path):
    """The refusal reaches LLM(): a SiglipModel folder whose tokenizer_config asks for
    sp_model_kwargs fails at load naming it (never a guessed tokenizer)."""
    folder = tmp_path / "siglip"
    _build_siglip_with_spiece(folder, spiece, seed=3)
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["sp_model_kwargs"] = {"enable_sampling": True}
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sp_model_kwargs"):
        LLM(str(folder), device="cpu", dtype="float32")


def test_folders_with_tokenizer_json_are_not_converted(tokenizers, tmp_path):
    """A tokenizer.json wins (AutoTokenizer loads it), and other tokenizer classes are left to
    AutoTokenizer."""
    _, fast = tokenizers
    folder = tmp_path / "fast"
    fast.save_pretrained(str(folder))
    assert (folder / "tokenizer.json").exists()
    assert not needs_conversion(folder)
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    (other / "tokenizer.json").unlink()
    config = json.loads((other / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] != "SiglipTokenizer"
    assert not needs_conversion(other)
