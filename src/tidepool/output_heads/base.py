"""One object per output head: what it serves, what the model must provide, how its outputs are
pooled, how a checkpoint calls for it, and what its refusals say.

    OutputHead
      name          the key (ModelConfig.output_head): "task", "splade", "bge_m3", ...
      tasks         the pooling tasks it serves (ModelConfig.head_tasks); () for "task", whose
                    tasks follow from the model's own task (ModelConfig.pooling_tasks)
      protocol      what the model must provide (models/interfaces.py), checked at load
      token_poolers task → the pooler of one text's token rows (worker/pooler.py calls it)
      detect        checkpoint → HeadChoice or None (model_loader/resolve.py asks each head)
      kind, label, task_needs   the words of its refusals (engine/tasks.py, the routes)

A head's token pooler is called with the model (already checked against `protocol`, so typed as
it), the pooler's finishing steps (`PoolerContext`), one text's rows [len, hidden], its token ids
[len] (None on a chunked causal prompt) and the request's parameters; it returns a CPU float32
tensor. The registry (registry.py) holds the heads; adding one is one module that builds its
`OutputHead` and registers it (tests/models/test_output_head_plugin.py does from a test module).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, Protocol, TypeVar, cast

import torch

from tidepool.config import ModelConfig, SparseHeadConfig
from tidepool.params import POOLING_TASKS, PoolingParams

M = TypeVar("M")
"""The model as the head's protocol types it."""


class PoolerContext(Protocol):
    """What a head's token pooler may use of the pooler (worker/pooler.py's Pooler)."""

    model_config: ModelConfig

    def apply_dense(self, x: torch.Tensor) -> torch.Tensor:
        """The sentence-transformers Dense modules, in order."""
        ...

    def finish_embedding(self, x: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """Normalize and truncate (Matryoshka) per the request."""
        ...

    def finish_logits(self, logits: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """Softmax (sigmoid for one label) unless the request turns the activation off."""
        ...


TokenPooler = Callable[
    [M, PoolerContext, torch.Tensor, torch.Tensor | None, PoolingParams], torch.Tensor
]
"""(model, pooler, rows [len, hidden] of one text, its token ids [len] or None, params) → output
(a CPU float32 tensor)."""


@dataclass(frozen=True)
class Checkpoint:
    """What detection reads: the checkpoint and the choices made before the head."""

    architecture: str
    """config.json's architecture (before `convert`)."""
    task: str
    """The task resolved so far: "embed", "classify" or "generate"."""
    resolved_architecture: str
    """The architecture resolved so far (after `convert`)."""
    path: Path
    """The model's folder."""
    convert: str
    """ "auto", "embed" or "classify" as asked."""
    model_impl: str
    """ "auto", "native", "transformers" or "fallback" as asked."""

    @property
    def may_take_a_head(self) -> bool:
        """A pooling model not asked to stay a plain embedder (`convert="embed"`)."""
        return self.task != "generate" and self.convert != "embed"


@dataclass(frozen=True)
class HeadChoice:
    """A head a checkpoint calls for: the task and architecture it runs as, and its settings."""

    task: str
    architecture: str
    head: str
    """The head's name."""
    sparse: SparseHeadConfig | None = None
    """Sparse pooling settings (SPLADE's pooling, BGE-M3's skipped ids)."""


@dataclass(frozen=True)
class OutputHead(Generic[M]):
    """One kind of output head (see the module docstring)."""

    name: str
    tasks: tuple[str, ...]
    """The pooling tasks it serves, in order (the first is the default); () for "task". A name
    beyond the built-in POOLING_TASKS is a task of its own (a plugin's "reward", say): requests
    may carry it once the head is registered, and its token pooler computes it."""
    protocol: type
    """What the model must provide (a runtime-checkable Protocol, the `M` its token poolers
    take); `object` for none."""
    provides: str
    """The protocol's members in words, for the load-time refusal ("MLM head
    (compute_vocab_logits)")."""
    token_poolers: Mapping[str, TokenPooler[M]] = field(default_factory=dict)
    """Task → the pooler of one text's rows, for its tasks that read every token."""
    detect: Callable[[Checkpoint], HeadChoice | None] | None = None
    """Whether a checkpoint calls for this head; None: never detected (the "task" head)."""
    kind: str | None = None
    """What a model with this head is, for refusals ("a SPLADE sparse embedding model"); None:
    what its task says."""
    label: str | None = None
    """Its name in a task's list of the models that serve it ("SPLADE")."""
    task_needs: Mapping[str, str] = field(default_factory=dict)
    """Task → what a call of it needs ("a sparse embedding model"), for tasks this head names."""

    def __post_init__(self) -> None:
        if not self.tasks and self.name != "task":
            raise ValueError(f"output head {self.name!r} serves no pooling task")
        for task in (*self.token_poolers, *self.task_needs):
            if task not in POOLING_TASKS and task not in self.tasks:
                raise ValueError(
                    f"output head {self.name!r}: unknown pooling task {task!r}; expected one of "
                    f"{POOLING_TASKS} or a task of its own (`tasks`)"
                )
        for task in self.new_tasks:
            if task not in self.token_poolers:
                raise ValueError(
                    f"output head {self.name!r}: its own task {task!r} needs a token pooler "
                    "(only the built-in tasks have sequence poolers)"
                )

    @property
    def new_tasks(self) -> tuple[str, ...]:
        """Its tasks beyond the built-in ones (declared when the head is registered)."""
        return tuple(t for t in self.tasks if t not in POOLING_TASKS)

    def bind(self, model: object) -> M:
        """`model` as this head's protocol types it; TypeError (at load) when it lacks it."""
        if not isinstance(model, self.protocol):
            raise TypeError(
                f"{type(model).__name__} has no {self.provides}: it cannot serve {self.name}"
            )
        return cast(M, model)


def to_sparse(weights: torch.Tensor, max_active_dims: int | None) -> torch.Tensor:
    """weights [vocab] (>= 0) → a coalesced sparse [vocab] of its non-zero entries, keeping the
    largest `max_active_dims` (sentence-transformers' select_max_active_dims) when given.
    `.indices()[0]` are the token ids (ascending), `.values()` their weights (> 0)."""
    weights = weights.float().cpu()
    if max_active_dims is not None and max_active_dims < weights.numel():
        top = torch.topk(weights, max_active_dims).indices
        kept = torch.zeros_like(weights)
        kept[top] = weights[top]
        weights = kept
    ids = torch.nonzero(weights, as_tuple=True)[0]
    # The ids are unique and ascending by construction: no invariant checks needed.
    return torch.sparse_coo_tensor(
        ids[None], weights[ids], weights.shape, is_coalesced=True, check_invariants=False
    )
