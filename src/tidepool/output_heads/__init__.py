"""Output heads: one `OutputHead` per kind, in one registry (base.py, registry.py).

The built-in heads are registered here, on import, in detection order: "task" (the model's task's
own), "token_classifier", "splade", "bge_m3", "colvision". A new built-in kind is one module here (its
`OutputHead`) and its entry in BUILTIN_HEADS; a plugin's own module calls `register_head`
(docs/architecture.md, "Where new code goes")."""

from __future__ import annotations

from tidepool.output_heads import bge_m3, colvision, splade, task, token_classifier
from tidepool.output_heads.base import (
    Checkpoint,
    HeadChoice,
    OutputHead,
    PoolerContext,
    TokenPooler,
    to_sparse,
)
from tidepool.output_heads.registry import (
    detect_head,
    get_head,
    register_head,
    registered_heads,
    task_needs,
    unregister_head,
)

BUILTIN_HEADS = (
    task.TASK_HEAD,
    token_classifier.TOKEN_CLASSIFIER,
    splade.SPLADE,
    bge_m3.BGE_M3,
    colvision.COLVISION,
)
"""The built-ins, in registration (= detection and message) order."""
for _head in BUILTIN_HEADS:
    register_head(_head)

__all__ = [
    "BUILTIN_HEADS",
    "Checkpoint",
    "HeadChoice",
    "OutputHead",
    "PoolerContext",
    "TokenPooler",
    "detect_head",
    "get_head",
    "register_head",
    "registered_heads",
    "task_needs",
    "to_sparse",
    "unregister_head",
]
