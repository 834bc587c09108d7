"""sentence-transformers' older CLIP layout: the model in a module folder, nothing at the top.

    modules.json          [{"path": "0_CLIPModel", "type": "sentence_transformers.models.CLIPModel"}]
    0_CLIPModel/          a transformers CLIPModel folder (config.json, weights, tokenizer,
                          preprocessor_config.json)

The Hub's `sentence-transformers/clip-ViT-*` repos are written so (sentence-transformers 6 still
loads them, its CLIPModel module being a Transformer on that folder). tidepool loads the module
folder as the model (`module_folder`) and reads the top's modules.json for what follows it
(`modules_around`: a Normalize; sentence-transformers' CLIP vectors are raw without one).
Anything else after the CLIPModel module is refused by name, as for any sentence-transformers
folder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

CLIP_MODULE_TYPES = frozenset(
    {
        "sentence_transformers.models.CLIPModel",
        "sentence_transformers.models.CLIPModel.CLIPModel",
        "sentence_transformers.sentence_transformer.modules.CLIPModel",
    }
)
_LISTED_CONFIG = re.compile(r"^\d+_CLIPModel/config\.json$")


def _modules(folder: Path) -> list[dict[str, Any]] | None:
    try:
        value = json.loads((folder / "modules.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        return None
    return value


def _clip_path(modules: list[dict[str, Any]]) -> str | None:
    first = modules[0] if modules else {}
    path = str(first.get("path") or "")
    if first.get("type") not in CLIP_MODULE_TYPES or not path or "/" in path or path == "..":
        return None
    return path


def module_folder(folder: Path) -> Path | None:
    """The CLIPModel module's folder when `folder` has this layout (modules.json's first module
    is sentence-transformers' CLIPModel, its folder has a config.json); else None."""
    modules = _modules(folder)
    path = None if modules is None else _clip_path(modules)
    if path is None or not (folder / path / "config.json").is_file():
        return None
    return folder / path


def modules_around(model_folder: Path) -> list[dict[str, Any]] | None:
    """When `model_folder` is the CLIPModel module of its parent's modules.json: the parent's
    modules after it (paths relative to the parent), else None."""
    modules = _modules(model_folder.parent)
    if modules is None or _clip_path(modules) != model_folder.name:
        return None
    return modules[1:]


def listed_module_config(files: list[str]) -> str | None:
    """A Hub repo's file list of this layout (modules.json and one `<n>_CLIPModel/config.json`,
    no config.json at the top): that config's path, else None."""
    if "config.json" in files or "modules.json" not in files:
        return None
    configs = [f for f in files if _LISTED_CONFIG.match(f)]
    return configs[0] if len(configs) == 1 else None
