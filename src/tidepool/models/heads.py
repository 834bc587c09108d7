"""Encoder heads beyond sequence classification: the MLM head SPLADE pools, BGE-M3's sparse and
ColBERT projections, and per-token classifiers, each over a BERT-family body (models/bert.py).

    body ──hidden [num_tokens, hidden]──▶ pooler ──one text's rows──▶ head
        BertForMaskedLM           compute_vocab_logits   → [num_tokens, vocab]      (SPLADE)
        BgeM3EmbeddingModel       compute_token_weights  → [num_tokens]             (lexical)
                                  compute_token_vectors  → [num_tokens, hidden]     (ColBERT)
        *ForTokenClassification   compute_token_logits   → [num_tokens, num_labels]

The heads run in the pooler (each through its kind's OutputHead: output_heads/), per text, on
the rows it needs: the body's forward is the same for every task, so one BGE-M3 forward pass
serves dense, sparse and multi-vector requests of the same step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tidepool.models.bert import (
    EncoderWithHead,
    RobertaModel,
    XLMRobertaModel,
)

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


# ----------------------------------------------------------------------------- masked LM


class BertForMaskedLM(EncoderWithHead):
    """BERT's MLM head: dense → activation → LayerNorm → decoder (tied to the word embeddings
    unless the config unties them) + bias. A SPLADE model (a VocabLogitsHead)."""

    head_names = {
        "cls.predictions.transform.dense.weight": "transform_dense.weight",
        "cls.predictions.transform.dense.bias": "transform_dense.bias",
        "cls.predictions.transform.LayerNorm.weight": "transform_norm.weight",
        "cls.predictions.transform.LayerNorm.bias": "transform_norm.bias",
        "cls.predictions.transform.LayerNorm.gamma": "transform_norm.weight",
        "cls.predictions.transform.LayerNorm.beta": "transform_norm.bias",
        "cls.predictions.bias": "decoder_bias",
        "cls.predictions.decoder.weight": "decoder_weight",
    }
    fixed_activation: ClassVar[str | None] = None
    """RoBERTa's LM head always uses GELU; BERT's uses config.hidden_act."""

    def __init__(self, config) -> None:
        super().__init__(config)
        hidden, vocab = config.hidden_size, config.vocab_size
        self.transform_dense = nn.Linear(hidden, hidden)
        self.transform_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.decoder_bias = nn.Parameter(torch.zeros(vocab))
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        self.decoder_weight = None if self.tied else nn.Parameter(torch.empty(vocab, hidden))
        activation = self.fixed_activation or config.hidden_act
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"MLM head activation {activation!r} is not supported; "
                f"supported: {', '.join(_ACTIVATIONS)}"
            )
        self.activation = _ACTIVATIONS[activation]

    def map_weight_name(self, name: str) -> str | None:
        if name in self.head_names:
            mapped = self.head_names[name]
            # A tied decoder's saved copy equals the word embeddings: read those instead.
            return None if mapped == "decoder_weight" and self.tied else mapped
        return super().map_weight_name(name)

    def compute_vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_tokens, hidden] → [num_tokens, vocab]; the bias add runs in the GEMM."""
        x = self.transform_norm(self.activation(self.transform_dense(hidden)))
        weight = self.body.embeddings.word_embeddings.weight if self.tied else self.decoder_weight
        return F.linear(x, weight, self.decoder_bias)


class RobertaForMaskedLM(BertForMaskedLM):
    body_cls = RobertaModel
    fixed_activation = "gelu"
    head_names = {
        "lm_head.dense.weight": "transform_dense.weight",
        "lm_head.dense.bias": "transform_dense.bias",
        "lm_head.layer_norm.weight": "transform_norm.weight",
        "lm_head.layer_norm.bias": "transform_norm.bias",
        "lm_head.bias": "decoder_bias",
        "lm_head.decoder.weight": "decoder_weight",
    }


class XLMRobertaForMaskedLM(RobertaForMaskedLM):
    body_cls = XLMRobertaModel


# ----------------------------------------------------------------------------- BGE-M3


class BgeM3EmbeddingModel(EncoderWithHead):
    """BGE-M3 (vLLM's name): an XLM-R body, dense = its CLS state; `sparse_linear` (hidden → 1)
    and `colbert_linear` (hidden → hidden) from FlagEmbedding's files beside the checkpoint."""

    body_cls = XLMRobertaModel
    extra_weight_files: ClassVar[dict[str, str]] = {
        "sparse_linear.pt": "sparse_linear.",
        "colbert_linear.pt": "colbert_linear.",
    }
    head_names = {
        "sparse_linear.weight": "sparse_linear.weight",
        "sparse_linear.bias": "sparse_linear.bias",
        "colbert_linear.weight": "colbert_linear.weight",
        "colbert_linear.bias": "colbert_linear.bias",
    }

    def __init__(self, config) -> None:
        super().__init__(config)
        self.sparse_linear = nn.Linear(config.hidden_size, 1)
        # FlagEmbedding's colbert_dim default (-1): the hidden size.
        self.colbert_linear = nn.Linear(config.hidden_size, config.hidden_size)

    def compute_token_weights(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.sparse_linear(hidden)).squeeze(-1)

    def compute_token_vectors(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.colbert_linear(hidden)


# ----------------------------------------------------------------------------- token classifiers


class BertForTokenClassification(EncoderWithHead):
    """A per-token classifier: token state → classifier (dropout is identity at inference)."""

    head_names = {"classifier.weight": "classifier.weight", "classifier.bias": "classifier.bias"}

    def __init__(self, config) -> None:
        super().__init__(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def compute_token_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(hidden)


class RobertaForTokenClassification(BertForTokenClassification):
    body_cls = RobertaModel


class XLMRobertaForTokenClassification(BertForTokenClassification):
    body_cls = XLMRobertaModel
