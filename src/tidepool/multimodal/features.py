"""One multi-modal item of a request, as the processor made it: the engine's contract.

    MultiModalFeature(modality="image",
                      data={"pixel_values": ..., ["image_grid_thw": ...]},   one item's tensors
                      identifier="<sha256 hex>",   decoded pixels + processor settings
                      offset=5, length=64)         prompt_token_ids[5:69] are its placeholders

The input processor (engine/input_processor.py, through multimodal/processing.py) makes them; a
Request carries them (`Request.mm_features`, in offset order, ranges disjoint); the runner
(worker/multimodal.py) encodes each once, when a step first schedules one of its placeholders,
and scatters the encoder's rows into the step's input embeddings at those positions. The
identifier keys the encoder cache and enters the prefix cache's block hashes (kv_cache/hashing.py),
so equal placeholders of different images never share KV blocks.

A leaf: no torch import at run time (the scheduler, which sees requests, imports no torch).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MODALITIES = ("image",)
"""The modalities tidepool takes (vLLM's multi_modal_data keys); the others are refused."""


@dataclass(frozen=True, eq=False)
class MultiModalFeature:
    modality: str
    """ "image"."""
    data: Mapping[str, torch.Tensor]
    """The model's processor's tensors for this one item, without the batch dimension (CLIP /
    SigLIP: pixel_values [3, H, W]; Qwen2-VL: pixel_values [patches, C * T * P * P] and
    image_grid_thw [3]). Read by the model's `embed_multimodal` only; never changed."""
    identifier: str
    """A content hash (hex) of the decoded pixels and the processor's settings: two items with
    the same identifier encode to the same rows (encoder cache, prefix cache)."""
    offset: int
    """Index of the first placeholder token in the request's prompt_token_ids."""
    length: int
    """Number of placeholder tokens: the rows `embed_multimodal` returns for this item."""

    def __post_init__(self) -> None:
        if self.modality not in MODALITIES:
            raise ValueError(f"modality {self.modality!r} is not one of {MODALITIES}")
        if self.offset < 0 or self.length < 1:
            raise ValueError(f"bad placeholder range: offset {self.offset}, length {self.length}")

    @property
    def end(self) -> int:
        """One past the last placeholder."""
        return self.offset + self.length

    def overlap(self, start: int, end: int) -> tuple[int, int] | None:
        """The part [lo, hi) of prompt positions [start, end) that are this item's placeholders,
        or None when they share none."""
        lo, hi = max(start, self.offset), min(end, self.end)
        return (lo, hi) if lo < hi else None


def content_hash(modality: str, parts: Iterable[bytes | str], settings: str) -> str:
    """SHA-256 (hex) over the modality, the item's bytes (for an image: mode, size, pixels) and
    the processor's settings (its JSON), each length-prefixed so that no two inputs collide by
    concatenation."""
    hasher = hashlib.sha256(b"tidepool/mm/" + modality.encode())
    for part in (*parts, settings):
        raw = part.encode() if isinstance(part, str) else part
        hasher.update(len(raw).to_bytes(8, "little"))
        hasher.update(raw)
    return hasher.hexdigest()


def image_hash(image: Any, settings: str) -> str:
    """The identifier of a decoded PIL image under a processor's settings."""
    return content_hash("image", (image.mode, repr(image.size), image.tobytes()), settings)


def check_features(features: tuple[MultiModalFeature, ...], num_prompt_tokens: int) -> None:
    """Offset order, disjoint ranges, inside the prompt (raises ValueError)."""
    end = 0
    for f in features:
        if f.offset < end or f.end > num_prompt_tokens:
            raise ValueError(
                f"multi-modal placeholder [{f.offset}, {f.end}) overlaps another or lies outside "
                f"the prompt's {num_prompt_tokens} tokens"
            )
        end = f.end
