"""Causal decoders as sequence classifiers / cross-encoders: the decoder body, LAST pooling, and a
`score` head [num_labels, hidden] on the last token (Hugging Face's *ForSequenceClassification).

The head comes from one of two places:

    checkpoint's score.weight                 (Qwen2ForSequenceClassification, a converted
                                               Qwen3-Reranker "seq-cls" checkpoint, ...)
    rows of the LM head, chosen by token      (hf_overrides `classifier_from_token`, as vLLM):
        from_2_way_softmax   ["no", "yes"]  →  score = lm_head[yes] - lm_head[no], one label:
                             sigmoid(h·(w_yes - w_no)) = softmax(h·w_no, h·w_yes)[yes]
        no_post_processing   [t1, ..., tn]  →  score = lm_head[[t1..tn]], n labels

model_loader/resolve.py turns the token strings into ids (`hf_config.classifier_from_token_ids`) and
sets `num_labels`; the LM head itself is never built, so a reranker step costs a [n, hidden] x
[hidden, 1] product instead of the vocabulary's logits.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from tidepool.models.layers.linear import Linear
from tidepool.models.llama import (
    _STACKED,
    DecoderWithHead,
    LlamaModel,
    MistralModel,
    Qwen2Model,
    Qwen3Model,
)
from tidepool.models.llama import _shard_sizes as shard_sizes
from tidepool.models.weights import load_fused_weights

SEQ_CLS_METHODS = ("from_2_way_softmax", "no_post_processing")
"""How `classifier_from_token` rows become the head (vLLM's names)."""


def head_from_token_rows(rows: torch.Tensor, method: str) -> torch.Tensor:
    """rows [num_tokens, hidden] of the LM head (in classifier_from_token order) → score.weight."""
    if method == "from_2_way_softmax":
        return (rows[1] - rows[0])[None]  # [1, hidden]: the "true" row minus the "false" row
    return rows


class CausalForSequenceClassification(DecoderWithHead):
    """A DecoderModel with a ClassifierHead (models/interfaces.py)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.score = Linear(config.hidden_size, int(config.num_labels), bias=False)
        self.from_token_ids: tuple[int, ...] = tuple(
            getattr(config, "classifier_from_token_ids", None) or ()
        )
        """LM-head rows the head is built from; empty: the checkpoint has score.weight."""
        self.from_token_method = str(getattr(config, "classifier_method", "no_post_processing"))

    def compute_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """pooled [num_seqs, hidden] (the last tokens) → float32 logits [num_seqs, num_labels]."""
        return self.score(pooled).float()

    def map_weight_name(self, name: str) -> str | None:
        if name.startswith("score."):
            return name  # with classifier_from_token, the one built last wins
        mapped = self.model.map_weight_name(name)
        return None if mapped is None else "model." + mapped

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.from_token_ids:
            weights = self._with_head_from_tokens(weights)
        try:
            return load_fused_weights(self, weights, self.map_weight_name, _STACKED, shard_sizes)
        except ValueError as e:
            if "'score.weight'" not in str(e):
                raise
            raise ValueError(
                f"{type(self).__name__}: the checkpoint ships no sequence-classification head "
                "(score.weight); for a reranker that answers with tokens give hf_overrides="
                '{"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'
            ) from None

    def _with_head_from_tokens(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors, then score.weight built from the LM head's rows (the
        embeddings' rows when the checkpoint ties them and ships no lm_head.weight)."""
        ids = list(self.from_token_ids)
        rows: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if name == "lm_head.weight" or name.endswith("embed_tokens.weight"):
                rows["lm_head" if name == "lm_head.weight" else "embed"] = tensor[ids].float()
            yield name, tensor
        source = rows.get("lm_head", rows.get("embed"))
        if source is None:
            raise ValueError("classifier_from_token: the checkpoint has no lm_head.weight")
        yield "score.weight", head_from_token_rows(source, self.from_token_method)


class LlamaForSequenceClassification(CausalForSequenceClassification):
    body_cls = LlamaModel


class MistralForSequenceClassification(CausalForSequenceClassification):
    body_cls = MistralModel


class Qwen2ForSequenceClassification(CausalForSequenceClassification):
    body_cls = Qwen2Model


class Qwen3ForSequenceClassification(CausalForSequenceClassification):
    body_cls = Qwen3Model
