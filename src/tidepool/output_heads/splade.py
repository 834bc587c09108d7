"""The "splade" head: a masked-LM checkpoint whose sentence-transformers pipeline ends in
SpladePooling (a SparseEncoder folder).

    embed_sparse   MLM logits [len, vocab] → max (or sum) over tokens → log(1 + relu(·))
                   → sparse [vocab] (top-k when asked)

Worked example (max pooling): log(1 + relu(x)) never decreases in x, so the maximum over the
tokens of the transformed logits is the transform of the maximum logit: the pooler takes `amax`
over the [len, vocab] logits first and transforms [vocab] values, not [len, vocab].
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tidepool.config import SparseHeadConfig
from tidepool.models.interfaces import VocabLogitsHead
from tidepool.output_heads.base import (
    Checkpoint,
    HeadChoice,
    OutputHead,
    PoolerContext,
    to_sparse,
)
from tidepool.params import PoolingParams


def _activation(x: torch.Tensor, cfg: SparseHeadConfig) -> torch.Tensor:
    x = torch.log1p(torch.relu(x))
    return torch.log1p(x) if cfg.activation_function == "log1p_relu" else x


def splade_sparse(
    model: VocabLogitsHead,
    pooler: PoolerContext,
    rows: torch.Tensor,
    ids: torch.Tensor | None,
    params: PoolingParams,
) -> torch.Tensor:
    cfg = pooler.model_config.sparse or SparseHeadConfig()
    logits = model.compute_vocab_logits(rows).float()
    if cfg.pooling_strategy == "max":
        weights = _activation(logits.amax(dim=0), cfg)  # monotone: see the module docstring
    else:
        weights = _activation(logits, cfg).sum(dim=0)
    return to_sparse(weights, params.max_active_dims)


_SETTINGS = ("pooling_strategy", "activation_function")


def splade_pooling(path: Path) -> SparseHeadConfig | None:
    """sentence-transformers' SpladePooling module of a SparseEncoder folder, else None."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    for module in json.loads(modules_file.read_text(encoding="utf-8")):
        if str(module.get("type", "")).endswith("SpladePooling"):
            cfg_file = path / module.get("path", "") / "config.json"
            cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
            settings = {k: cfg[k] for k in _SETTINGS if cfg.get(k) is not None}
            if settings.get("pooling_strategy", "max") not in ("max", "sum"):
                raise ValueError(f"{cfg_file}: pooling_strategy must be max or sum")
            if settings.get("activation_function", "relu") not in ("relu", "log1p_relu"):
                raise ValueError(f"{cfg_file}: activation_function must be relu or log1p_relu")
            return SparseHeadConfig(**settings)
    return None


def detect(checkpoint: Checkpoint) -> HeadChoice | None:
    """A *ForMaskedLM whose modules.json ends in SpladePooling (native models only: the
    transformers backend runs the checkpoint's own head)."""
    if not checkpoint.may_take_a_head or checkpoint.model_impl == "transformers":
        return None
    settings = splade_pooling(checkpoint.path)
    if checkpoint.architecture.endswith("ForMaskedLM") and settings is not None:
        return HeadChoice("embed", checkpoint.architecture, "splade", settings)
    return None


SPLADE = OutputHead(
    name="splade",
    tasks=("embed_sparse",),
    protocol=VocabLogitsHead,
    provides="MLM head (compute_vocab_logits)",
    token_poolers={"embed_sparse": splade_sparse},
    detect=detect,
    kind="a SPLADE sparse embedding model",
    label="SPLADE",
    task_needs={"embed_sparse": "a sparse embedding model"},
)
