"""What a model declares for `quantization="int8"` (tidepool/quantization/ reads it, the model
never imports it): each linear's role, the hand-off chains between its int8 layers, the output
buffers its layers may reuse, and its own recipe settings where the default's do not fit.

A model has the int8 path when its class defines `int8_layout()` (`QuantizableModel`); the
table sits in the model's own file, next to the layers it names (bert.py's `BertLayer` and
`post_ln_stack_layout`, t5.py's `T5Block`). Module names are the model's own
(`model.named_modules()`), so a head's body prefix ("body.") is part of them.

Roles (the recipe chooses by role: smoothing, two-part weights; docs/performance.md, "int8"):

    QKV            the fused query / key / value projection (its input: a LayerNorm output)
    ATTENTION_OUT  the attention's output projection (its input: the attention's rows)
    FFN_UP         the feed-forward's up (and gate) projections (a LayerNorm output)
    FFN_DOWN       the feed-forward's down projection (a GELU / ReLU output)
    POSITION       a projection of position embeddings (DeBERTa's relative positions)
    PROJECTION     any other projection (DeBERTa's embedding projection)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

QKV = "qkv"
ATTENTION_OUT = "attention_out"
FFN_UP = "ffn_up"
FFN_DOWN = "ffn_down"
POSITION = "position"
PROJECTION = "projection"
LINEAR_ROLES = (QKV, ATTENTION_OUT, FFN_UP, FFN_DOWN, POSITION, PROJECTION)


@dataclass(frozen=True)
class Handoff:
    """`producer`'s output is, unchanged, `consumer`'s input: its int8 epilogue may quantize
    each row for `consumer` (quantization/chains.py)."""

    producer: str
    consumer: str
    exclusive: bool = False
    """Nothing but `consumer` reads the producer's output (its float32 form need not be
    written)."""


@dataclass(frozen=True)
class Int8Layout:
    """A model's int8 declaration (module names from the model's root)."""

    roles: Mapping[str, str]
    """Every tidepool `Linear` of the model → its role (LINEAR_ROLES); the quantizer refuses a
    model with a `Linear` the table leaves out."""
    handoffs: tuple[Handoff, ...] = ()
    shared_outputs: tuple[tuple[str, ...], ...] = ()
    """Groups of linears whose outputs take turns in one reused buffer: each output is dead
    before the next linear of its group writes (none of them is the model's output)."""
    recipe: Mapping[str, Any] = field(default_factory=dict)
    """This model's changes to the default recipe (`Int8Recipe` field → value)."""

    def prefixed(self, prefix: str) -> Int8Layout:
        """The same layout with every name under `prefix` (e.g. "body." for a head's body)."""
        return Int8Layout(
            {prefix + name: role for name, role in self.roles.items()},
            tuple(
                Handoff(prefix + h.producer, prefix + h.consumer, h.exclusive)
                for h in self.handoffs
            ),
            tuple(tuple(prefix + name for name in group) for group in self.shared_outputs),
            self.recipe,
        )


@runtime_checkable
class QuantizableModel(Protocol):
    """A native model with the int8 path."""

    def int8_layout(self) -> Int8Layout:
        """This model's linear roles, hand-offs, reused outputs and recipe changes."""
        ...


def has_int8_path(model_cls: type) -> bool:
    """Whether the class declares an int8 layout (checked before a model is built)."""
    return callable(getattr(model_cls, "int8_layout", None))
