"""Tiny random checkpoints for sparse / multi-vector / per-token heads (fixed seeds, saved in
their reference layouts): a SPLADE SparseEncoder, a BGE-M3 in FlagEmbedding's layout, and
*ForTokenClassification models. Shared by tests/models and tests/e2e."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import TINY_SIZES, copy_bert_tokenizer, save_roberta_tokenizer

NER_LABELS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}
NER_KINDS = ("bert", "roberta", "xlm-roberta")


def save_splade(folder: Path, minilm_path: Path, seed: int, pooling_strategy: str) -> Path:
    """A BertForMaskedLM saved by sentence-transformers' SparseEncoder (Transformer(fill-mask)
    → SpladePooling); returns the SparseEncoder's folder."""
    from sentence_transformers import SparseEncoder
    from transformers import BertConfig, BertForMaskedLM

    try:  # sentence-transformers >= 6: the generic Transformer with a fill-mask task
        from sentence_transformers.base.modules import Transformer
        from sentence_transformers.sparse_encoder.modules import SpladePooling

        def mlm(folder: str):
            return Transformer(folder, transformer_task="fill-mask")
    except ImportError:  # 5.x: MLMTransformer
        from sentence_transformers.sparse_encoder.models import MLMTransformer as mlm
        from sentence_transformers.sparse_encoder.models import SpladePooling

    hf_folder = folder / "hf"
    hf_folder.mkdir(parents=True)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=30522, type_vocab_size=2, **TINY_SIZES)
    BertForMaskedLM(config).save_pretrained(str(hf_folder))
    copy_bert_tokenizer(minilm_path, hf_folder)
    body = mlm(str(hf_folder))
    SparseEncoder(modules=[body, SpladePooling(pooling_strategy)], device="cpu").save(
        str(folder / "st")
    )
    return folder / "st"


def save_bge_m3(folder: Path) -> Path:
    """A tiny XLM-R with FlagEmbedding's sparse_linear.pt and colbert_linear.pt beside it."""
    from transformers import XLMRobertaConfig, XLMRobertaModel

    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = save_roberta_tokenizer(folder, "unigram")
    torch.manual_seed(15)
    config = XLMRobertaConfig(
        vocab_size=vocab_size,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        type_vocab_size=1,
        **TINY_SIZES,
    )
    XLMRobertaModel(config).save_pretrained(str(folder))
    hidden = TINY_SIZES["hidden_size"]
    sparse_linear = torch.nn.Linear(hidden, 1)
    with torch.no_grad():
        # Spread the weights so relu(w · h + b) is positive for some tokens, zero for others.
        sparse_linear.weight.normal_(0.0, 1.0)
        sparse_linear.bias.fill_(0.5)
    torch.save(sparse_linear.state_dict(), folder / "sparse_linear.pt")
    torch.save(torch.nn.Linear(hidden, hidden).state_dict(), folder / "colbert_linear.pt")
    return folder


def save_token_classifier(kind: str, folder: Path, minilm_path: Path) -> Path:
    """A *ForTokenClassification of `kind` (NER_KINDS) with NER_LABELS."""
    import transformers as tf

    folder.mkdir(parents=True)
    torch.manual_seed(40 + NER_KINDS.index(kind))
    labels = dict(num_labels=len(NER_LABELS), id2label=NER_LABELS)
    if kind == "bert":
        copy_bert_tokenizer(minilm_path, folder)
        config = tf.BertConfig(vocab_size=30522, type_vocab_size=2, **labels, **TINY_SIZES)
        model = tf.BertForTokenClassification(config)
    else:
        vocab_size = save_roberta_tokenizer(folder, "unigram" if kind == "xlm-roberta" else "bpe")
        common = dict(
            vocab_size=vocab_size, pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1
        )
        if kind == "roberta":
            config = tf.RobertaConfig(**common, **labels, **TINY_SIZES)
            model = tf.RobertaForTokenClassification(config)
        else:
            config = tf.XLMRobertaConfig(**common, **labels, **TINY_SIZES)
            model = tf.XLMRobertaForTokenClassification(config)
    model.save_pretrained(str(folder))
    return folder
