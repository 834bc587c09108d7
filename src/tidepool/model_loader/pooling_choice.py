"""Which pooling an embedder gets, and the one log line that says why.

vLLM 0.32's rules, which tidepool follows:
- A folder whose modules.json names sentence-transformers' Pooling module is a pooling model
  whatever config.json's architecture says (vLLM's `_get_default_runner_type`: "Some Sentence
  Transformers models use *ForCausalLM archs"), e.g. Qwen3-Embedding (`Qwen3ForCausalLM`): it is
  loaded as sentence-transformers loads it, with its Pooling mode and Normalize module.
- Without sentence-transformers files the model's own default pooling runs, normalized (CLS for
  BERT-style encoders, LAST for decoders), where sentence-transformers would build MEAN pooling
  without normalization for the same folder: the log line says so.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tidepool.config import SentenceTransformersMeta
from tidepool.model_loader.registry import get_model_class

logger = logging.getLogger("tidepool")


def declares_st_pooling(path: Path) -> bool:
    """modules.json names sentence-transformers' Pooling module (vLLM's get_pooling_config)."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return False
    modules = json.loads(modules_file.read_text(encoding="utf-8"))
    return any(str(m.get("type", "")).split(".")[-1] == "Pooling" for m in modules)


def log_st_embedder(path: Path, architecture: str) -> None:
    logger.info(
        "%s: modules.json declares a sentence-transformers Pooling module, so this %s folder "
        'loads as an embedding model (runner="pooling"); pass runner="generate" to generate',
        path.name,
        architecture,
    )


def log_pooling(
    architecture: str, model_impl: str, is_causal: bool, st: SentenceTransformersMeta
) -> None:
    """One INFO line: the pooling an embedder gets, and why (its sentence-transformers files, or
    without them vLLM's rule: the model's own default, normalized)."""
    if st.pooling_mode is not None:
        norm = " + normalize" if st.normalize else " (no Normalize module: not normalized)"
        why = "from the sentence-transformers Pooling module in modules.json"
        logger.info("%s: pooling %s%s, %s", architecture, st.pooling_mode, norm, why)
        return
    if model_impl == "native":
        default = str(get_model_class(architecture).default_pooling_type).upper()
    else:
        default = "LAST" if is_causal else "CLS"  # the transformers backend and the fallback
    # The pooler normalizes unless a sentence-transformers pipeline without Normalize says not to.
    normalized = " + normalize" if st.normalize or not st.is_sentence_transformer else ""
    if st.is_sentence_transformer:
        where = "its sentence-transformers files declare no Pooling module"
    else:
        where = "the folder has no sentence-transformers files (modules.json)"
    differs = "" if default == "MEAN" else "; sentence-transformers would pool MEAN"
    logger.info(
        "%s: pooling %s%s, the model's default as in vLLM: %s%s",
        architecture,
        default,
        normalized,
        where,
        differs,
    )
