"""sentence-transformers metadata for the tiny test models (modules.json, 1_Pooling/config.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_st_metadata(folder: Path, pooling: dict[str, Any], normalize: bool = False) -> None:
    """Transformer → Pooling [→ Normalize]; `pooling` is the Pooling module's config.json (the
    legacy `pooling_mode_*_tokens` keys or the new `pooling_mode`)."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
