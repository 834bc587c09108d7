"""The one registry of output heads: name → OutputHead, in detection order.

Everything keyed by a head's name reads it here: the tasks a model serves (resolve fills
ModelConfig.head_tasks), the load-time protocol check and the token poolers (worker/pooler.py),
detection from a checkpoint (model_loader/resolve.py) and the refusals' words (engine/tasks.py,
the server's routes).
"""

from __future__ import annotations

from typing import Any

from tidepool.output_heads.base import Checkpoint, HeadChoice, OutputHead
from tidepool.params import declare_pooling_task, withdraw_pooling_task

_HEADS: dict[str, OutputHead[Any]] = {}


def register_head(head: OutputHead[Any]) -> OutputHead[Any]:
    """Add `head` (detected after the ones registered before it) and declare its own tasks;
    ValueError on a taken head or task name."""
    if head.name in _HEADS:
        raise ValueError(f"an output head named {head.name!r} is already registered")
    declared: list[str] = []
    try:
        for task in head.new_tasks:
            declare_pooling_task(task, head.name)
            declared.append(task)
    except ValueError:
        for task in declared:
            withdraw_pooling_task(task, head.name)
        raise
    _HEADS[head.name] = head
    return head


def unregister_head(name: str) -> None:
    """Remove a head registered by `register_head` (a plugin unloading, a test's teardown)."""
    head = get_head(name)
    for task in head.new_tasks:
        withdraw_pooling_task(task, name)
    del _HEADS[name]


def get_head(name: str) -> OutputHead[Any]:
    """The head named `name`; ValueError naming the registered ones."""
    head = _HEADS.get(name)
    if head is None:
        raise ValueError(f"output_head must be one of {', '.join(_HEADS)}, got {name!r}")
    return head


def registered_heads() -> tuple[OutputHead[Any], ...]:
    return tuple(_HEADS.values())


def detect_head(checkpoint: Checkpoint) -> HeadChoice | None:
    """The first head (in registration order) the checkpoint calls for; None: the task's own."""
    for head in _HEADS.values():
        choice = None if head.detect is None else head.detect(checkpoint)
        if choice is not None:
            return choice
    return None


def task_needs(task: str) -> str:
    """What a call of `task` needs, for refusals: the "task" head's words for its tasks, else
    the first words a head declares, followed by the heads that serve it ("a sparse embedding
    model (SPLADE, BGE-M3)")."""
    own = _HEADS["task"].task_needs.get(task)
    if own is not None:
        return own
    words = next((h.task_needs[task] for h in _HEADS.values() if task in h.task_needs), None)
    if words is None:
        return f"a model that supports {task!r}"
    labels = [h.label for h in _HEADS.values() if task in h.tasks and h.label]
    return f"{words} ({', '.join(labels)})" if labels else words
