"""ColBERT checkpoints (late interaction): how a folder says it is one, and what it says.

Two layouts, one `MultiVectorMeta`:

    colbert-ir (Stanford)   config.json architectures ["HF_ColBERT"]: a BERT body ("bert.*") and
                            `linear.weight` (the projection, no bias) in the same weights file;
                            artifact.metadata: query_token_id "[unused0]", doc_token_id
                            "[unused1]", query_maxlen, doc_maxlen, mask_punctuation,
                            attend_to_mask_tokens
    PyLate                  a sentence-transformers folder (modules.json: Transformer, Dense);
                            config_sentence_transformers.json: query_prefix "[Q] ",
                            document_prefix "[D] ", query_length, document_length,
                            do_query_expansion, attend_to_expansion_tokens, skiplist_words

Defaults are PyLate's where a file says nothing (its ColBERT.__init__): [unused0] / [unused1] for
colbert-ir, [Q] / [D] for PyLate, 32 / 180 tokens, query expansion on, punctuation skipped.
Both normalize every token vector (PyLate's encode, colbert-ir's `normalize`).
"""

from __future__ import annotations

import json
import string
from dataclasses import replace
from pathlib import Path
from typing import Any

from tidepool.checkpoint.loader import iter_weights
from tidepool.config import DenseModule, MultiVectorMeta, SentenceTransformersMeta

COLBERT_IR_ARCHITECTURES = {"HF_ColBERT": "BertModel"}
"""colbert-ir's architecture name → the body tidepool builds (the projection runs in the pooler,
as a Dense module)."""

_PYLATE_KEYS = ("query_prefix", "document_prefix")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}


def _is_pylate(path: Path) -> bool:
    modules_file = path / "modules.json"
    modules = json.loads(modules_file.read_text(encoding="utf-8")) if modules_file.is_file() else []
    if any(str(m.get("type", "")).startswith("pylate") for m in modules):
        return True
    st_cfg = _read_json(path / "config_sentence_transformers.json")
    return any(key in st_cfg for key in _PYLATE_KEYS)


def _prefix(value: Any, default: str) -> str | None:
    """A marker setting: None → the layout's default; "" → no marker."""
    if value is None:
        return default
    return str(value) or None


# Query expansion tokens that are not attended to run as per-sequence key counts (the attention
# backends' key_lens). DeBERTa's reference also zeroes those tokens' embeddings (its embedding
# mask), which key counts do not; the transformers backend / fallback pass no key counts.
_KEY_LENS_BODIES = ("Bert", "Roberta", "XLMRoberta", "MPNet", "HF_ColBERT")


def check_multi_vector_body(meta: MultiVectorMeta, architecture: str, model_impl: str) -> None:
    """Refuse a ColBERT body whose [MASK] expansion, not attended to, tidepool cannot run as the
    reference does (PyLate / colbert-ir give those keys attention mask 0)."""
    if not meta.do_query_expansion or meta.attend_to_expansion_tokens:
        return
    if model_impl == "native" and architecture.startswith(_KEY_LENS_BODIES):
        return
    raise ValueError(
        f"a ColBERT model on {architecture} ({model_impl}) with query "
        "expansion that is not attended to (attend_to_expansion_tokens / attend_to_mask_tokens "
        "false) is not supported: only the native BERT / RoBERTa / XLM-R / MPNet bodies run "
        "it as PyLate does; set attend_to_expansion_tokens true in "
        "config_sentence_transformers.json if the checkpoint was trained that way"
    )


def load_multi_vector(
    path: Path, architecture: str, st: SentenceTransformersMeta
) -> tuple[MultiVectorMeta, SentenceTransformersMeta] | None:
    """(what the ColBERT files say, the sentence-transformers metadata the pooler runs with: the
    projection as a Dense module, normalization on, no pooling cap on lengths), or None when the
    folder is not a ColBERT model."""
    if architecture in COLBERT_IR_ARCHITECTURES:
        meta = _colbert_ir_meta(_read_json(path / "artifact.metadata"))
        dense = (_stanford_projection(path),)
    elif _is_pylate(path):
        meta = _pylate_meta(_read_json(path / "config_sentence_transformers.json"))
        dense = st.dense
    else:
        return None
    # sentence_bert_config.json's max_seq_length is what PyLate used last (query or document
    # length minus one): the lengths here rule instead.
    return meta, replace(st, dense=dense, normalize=True, max_seq_length=None)


def _colbert_ir_meta(cfg: dict[str, Any]) -> MultiVectorMeta:
    punctuation = bool(cfg.get("mask_punctuation", True))
    return MultiVectorMeta(
        query_prefix=_prefix(cfg.get("query_token_id"), "[unused0]"),
        document_prefix=_prefix(cfg.get("doc_token_id"), "[unused1]"),
        query_length=int(cfg.get("query_maxlen") or 32),
        document_length=int(cfg.get("doc_maxlen") or 180),
        do_query_expansion=True,
        attend_to_expansion_tokens=bool(cfg.get("attend_to_mask_tokens", False)),
        skiplist_words=tuple(string.punctuation) if punctuation else (),
    )


def _pylate_meta(cfg: dict[str, Any]) -> MultiVectorMeta:
    expansion = bool(cfg.get("do_query_expansion", True))
    skiplist = cfg.get("skiplist_words")
    return MultiVectorMeta(
        query_prefix=_prefix(cfg.get("query_prefix"), "[Q] "),
        document_prefix=_prefix(cfg.get("document_prefix"), "[D] "),
        query_length=int(cfg.get("query_length") or 32),
        document_length=int(cfg.get("document_length") or 180),
        do_query_expansion=expansion,
        attend_to_expansion_tokens=expansion and bool(cfg.get("attend_to_expansion_tokens")),
        skiplist_words=tuple(string.punctuation if skiplist is None else skiplist),
    )


def _stanford_projection(path: Path) -> DenseModule:
    """colbert-ir's `linear.weight` ([dim, hidden], no bias), read from the body's weights."""
    for name, tensor in iter_weights(path):
        if name == "linear.weight":
            return DenseModule(tensor.float(), None, "identity")
    raise ValueError(f"{path}: a HF_ColBERT checkpoint without linear.weight (its projection)")
