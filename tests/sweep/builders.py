"""Tiny random checkpoints for the sweep, built from a grid entry (grid.Model) with a fixed seed.

Each checkpoint is a transformers `<Arch>(<Config>(**sizes, **options))` saved with
`save_pretrained`, a tokenizer from the project's tiny-tokenizer helpers (tests/conftest.py,
tests/tiny_decoders.py) and, for sentence-transformers entries, the pipeline saved by
sentence-transformers itself (Transformer → Pooling → Dense... → Normalize), so the folder is
read the way users' folders are. Norm weights and bias tables are spread away from their init
(1 / 0), where a mix-up between them would test nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from conftest import copy_bert_tokenizer, save_roberta_tokenizer
from tiny_decoders import save_tokenizer as save_decoder_tokenizer

from sweep import images
from sweep.grid import Model

QWEN3_YES_NO_CORPUS = ["yes\nno\n"] * 50
WORDS = (
    "paris capital france city river blue green house query answer model token engine batch "
    "score rank search passage document relevant water stone light music table garden"
).split()


def _save_t5_tokenizer(folder: Path) -> int:
    """T5Tokenizer (<pad>=0, </s>=1, <unk>=2) over a hand-made Unigram vocabulary."""
    words = [f"▁w{i}" for i in range(200)]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(w, -5.0) for w in words]
    vocab += [(c, -10.0) for c in "▁abcdefghijklmnopqrstuvwxyz0123456789"]
    tokenizer = transformers.T5Tokenizer(vocab=vocab, extra_ids=0)
    tokenizer.save_pretrained(str(folder))
    return len(tokenizer)


def _save_reranker_tokenizer(folder: Path) -> int:
    """Qwen-like byte-level BPE (no BOS) whose vocabulary has "yes" and "no" as tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tidepool.engine.score_template import QWEN3_RERANKER_INSTRUCTION, QWEN3_RERANKER_TEMPLATE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [QWEN3_RERANKER_TEMPLATE, QWEN3_RERANKER_INSTRUCTION, *QWEN3_YES_NO_CORPUS]
    tok.train_from_iterator(corpus + [" " + " ".join(WORDS)] * 50, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.save_pretrained(str(folder))
    return len(fast)


def save_tokenizer(kind: str, folder: Path, minilm_path: Path) -> int:
    """Writes the tokenizer of `kind` into `folder`; returns the vocabulary size to build with."""
    if kind == "bert":
        copy_bert_tokenizer(minilm_path, folder)
        return 30522
    if kind in ("bpe", "unigram"):
        return save_roberta_tokenizer(folder, kind)
    if kind == "decoder":
        return save_decoder_tokenizer(folder)
    if kind == "t5":
        return _save_t5_tokenizer(folder)
    if kind == "reranker":
        return _save_reranker_tokenizer(folder)
    raise ValueError(f"unknown tokenizer kind {kind!r}")


def _spread(model: torch.nn.Module) -> None:
    """Norm weights ~N(1, 0.3) (Gemma's (1 + w): ~N(0, 0.3)) and bias tables ~N(0, 1)."""
    gemma = "gemma" in type(model).__name__.lower()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "relative_attention_bias" in name or "rel_embeddings" in name:
                param.normal_(0.0, 1.0)
            elif ("norm" in name.lower()) and name.endswith("weight"):
                param.normal_(0.0 if gemma else 1.0, 0.3)


def build_hf(spec: Model, folder: Path, minilm_path: Path) -> torch.nn.Module:
    """The transformers checkpoint of `spec` in `folder` (tokenizer included); returns the model."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = save_tokenizer(spec.tokenizer, folder, minilm_path)
    options: dict[str, Any] = {"vocab_size": vocab_size, **spec.config}
    config = getattr(transformers, spec.config_class)(**options)
    torch.manual_seed(spec.seed)
    model = getattr(transformers, spec.hf_class)(config).eval()
    _spread(model)
    model.save_pretrained(str(folder))
    return model


def build(spec: Model, root: Path, minilm_path: Path) -> Path:
    """The folder tidepool and the reference load for `spec` (under `root`)."""
    if spec.layout == "hf":
        build_hf(spec, root / "hf", minilm_path)
        return root / "hf"
    if spec.layout == "st":
        return _build_st(spec, root, minilm_path)
    if spec.layout == "splade":
        return _build_splade(spec, root, minilm_path)
    if spec.layout == "bge_m3":
        folder = root / "hf"
        build_hf(spec, folder, minilm_path)
        hidden = spec.config["hidden_size"]
        torch.manual_seed(spec.seed + 1)
        sparse = torch.nn.Linear(hidden, 1)
        with torch.no_grad():  # relu(w . h + b) positive for some tokens, zero for others
            sparse.weight.normal_(0.0, 1.0)
            sparse.bias.fill_(0.5)
        torch.save(sparse.state_dict(), folder / "sparse_linear.pt")
        torch.save(torch.nn.Linear(hidden, hidden).state_dict(), folder / "colbert_linear.pt")
        return folder
    if spec.layout == "colbert_ir":
        return _build_colbert_ir(spec, root / "hf", minilm_path)
    if spec.layout in images.LAYOUTS:
        return images.build(spec, root)
    raise ValueError(f"unknown layout {spec.layout!r}")


COLBERT_DIM = 16


def _build_colbert_ir(spec: Model, folder: Path, minilm_path: Path) -> Path:
    """colbert-ir's layout: architectures ["HF_ColBERT"], the body under "bert.", the projection
    `linear.weight` (no bias) in the same weights file."""
    from safetensors.torch import save_file

    body = build_hf(spec, folder, minilm_path)
    torch.manual_seed(spec.seed + 3)
    state = {f"bert.{k}": v.contiguous() for k, v in body.state_dict().items()}
    state["linear.weight"] = torch.randn(COLBERT_DIM, spec.config["hidden_size"]) * 0.2
    for old in folder.glob("*.safetensors"):
        old.unlink()
    save_file(state, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["HF_ColBERT"]}))
    return folder


def _st_modules():
    try:  # sentence-transformers >= 6 (its old `models` path warns)
        from sentence_transformers.sentence_transformer import modules
    except ImportError:
        from sentence_transformers import models as modules
    return modules


def _build_st(spec: Model, root: Path, minilm_path: Path) -> Path:
    """Transformer → Pooling(mode) → Dense(in, out, bias, act)... [→ LayerNorm] [→ Normalize],
    saved by sentence-transformers."""
    from sentence_transformers import SentenceTransformer

    modules = _st_modules()
    hf_folder = root / "hf"
    build_hf(spec, hf_folder, minilm_path)
    _drop_chat_template(hf_folder)
    st = dict(spec.st or {})
    body = modules.Transformer(
        str(hf_folder),
        **({"max_seq_length": st["max_seq_length"]} if "max_seq_length" in st else {}),
    )
    dim = int(spec.config.get("hidden_size", spec.config.get("d_model", 0)))
    pipeline = [body, modules.Pooling(dim, st.get("pooling", "mean"))]
    torch.manual_seed(spec.seed + 2)
    for out, bias, act in st.get("dense", ()):
        activation = torch.nn.Tanh() if act == "tanh" else torch.nn.Identity()
        pipeline.append(modules.Dense(dim, out, bias=bias, activation_function=activation))
        dim = out
    if st.get("layer_norm"):
        pipeline.append(modules.LayerNorm(dim))
    if st.get("normalize"):
        pipeline.append(modules.Normalize())
    folder = root / "st"
    SentenceTransformer(modules=pipeline, device="cpu").save(str(folder))
    return folder


def _drop_chat_template(folder: Path) -> None:
    """sentence-transformers 6 renders texts through a tokenizer's chat template; the sweep's
    decoder tokenizer has one (for generation tests), which an embedder must not apply."""
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if config.pop("chat_template", None) is not None:
        config_file.write_text(json.dumps(config))


def _build_splade(spec: Model, root: Path, minilm_path: Path) -> Path:
    from sentence_transformers import SparseEncoder

    try:  # sentence-transformers >= 6: the generic Transformer with a fill-mask task
        from sentence_transformers.base.modules import Transformer
        from sentence_transformers.sparse_encoder.modules import SpladePooling

        def mlm(folder: str):
            return Transformer(folder, transformer_task="fill-mask")
    except ImportError:  # 5.x
        from sentence_transformers.sparse_encoder.models import MLMTransformer as mlm
        from sentence_transformers.sparse_encoder.models import SpladePooling

    hf_folder = root / "hf"
    build_hf(spec, hf_folder, minilm_path)
    strategy = (spec.st or {}).get("pooling", "max")
    folder = root / "st"
    SparseEncoder(modules=[mlm(str(hf_folder)), SpladePooling(strategy)], device="cpu").save(
        str(folder)
    )
    return folder
