"""Compact embedding encodings, for the server and for offline use: float16 / bfloat16 and
sentence-transformers' quantized precisions (int8, uint8, binary, ubinary). numpy and torch only.

`quantize_embeddings` has sentence-transformers' signature and semantics and gives the same
arrays bit for bit on the precisions they share:

    int8 / uint8   per dimension d, with ranges[0, d] = lowest and ranges[1, d] = highest value of
                   a calibration set: q = clip(floor((x - low) / ((high - low) / 255)), 0, 255)
                   (a step of 0 counts as 1); uint8 = q, int8 = q - 128
    ubinary        the sign bits (x > 0), packed 8 per byte, most significant bit first
                   (np.packbits): 384 dimensions -> 48 bytes; a last partial byte is zero-padded
    binary         the ubinary bytes minus 128, as int8
    float16        IEEE half, round to nearest even
    bfloat16       the upper 16 bits of each float32 after round-to-nearest-even (torch's
                   conversion), held as uint16: float32 bits = uint16 << 16

`encode_bytes` gives the bytes a base64 answer carries: little-endian (the byte order of x86 and
ARM, and of OpenAI's and vLLM's base64 float32), one value after the other, no header.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

EmbedDType = Literal["float32", "float16", "bfloat16", "int8", "uint8", "binary", "ubinary"]


@dataclass(frozen=True)
class EncodingSpec:
    """How one embed dtype stores an embedding."""

    wire_dtype: np.dtype
    """The numpy dtype of the stored values (bfloat16: uint16 bit patterns)."""
    needs_ranges: bool
    """Scalar quantization: per-dimension ranges from a calibration set are needed."""
    packs_bits: bool
    """One bit per dimension, 8 to a byte: the output has ceil(dim / 8) values."""
    convert: Callable[[np.ndarray, np.ndarray | None], np.ndarray]
    """float32 embeddings [..., dim] (and ranges [2, dim] or None) -> stored values."""


def _scalar(embeddings: np.ndarray, ranges: np.ndarray | None) -> np.ndarray:
    # The same float32 operations in the same order as sentence-transformers: equal bits.
    assert ranges is not None
    ranges = ranges.astype(np.float32, copy=False)
    starts = ranges[0, :]
    steps = (ranges[1, :] - starts) / 255
    steps = np.where(steps == 0, 1, steps)
    return np.clip(np.floor((embeddings - starts) / steps), 0, 255)


def _bfloat16_bits(embeddings: np.ndarray, _: np.ndarray | None) -> np.ndarray:
    as_bf16 = torch.from_numpy(np.ascontiguousarray(embeddings)).to(torch.bfloat16)
    return as_bf16.view(torch.int16).numpy().view(np.uint16)


ENCODINGS: dict[str, EncodingSpec] = {
    "float32": EncodingSpec(np.dtype(np.float32), False, False, lambda e, _: e),
    "float16": EncodingSpec(np.dtype(np.float16), False, False, lambda e, _: e.astype(np.float16)),
    "bfloat16": EncodingSpec(np.dtype(np.uint16), False, False, _bfloat16_bits),
    "uint8": EncodingSpec(
        np.dtype(np.uint8), True, False, lambda e, r: _scalar(e, r).astype(np.uint8)
    ),
    "int8": EncodingSpec(
        np.dtype(np.int8), True, False, lambda e, r: (_scalar(e, r) - 128).astype(np.int8)
    ),
    "ubinary": EncodingSpec(
        np.dtype(np.uint8), False, True, lambda e, _: np.packbits(e > 0, axis=-1)
    ),
    "binary": EncodingSpec(
        np.dtype(np.int8),
        False,
        True,
        lambda e, _: (np.packbits(e > 0, axis=-1) - 128).astype(np.int8),
    ),
}
"""Every embed dtype, by the name requests use (vLLM's `embed_dtype`, Cohere's `embedding_types`,
sentence-transformers' `precision`)."""
EMBED_DTYPES: tuple[str, ...] = tuple(ENCODINGS)


def _as_float32(embeddings: Any) -> np.ndarray:
    if isinstance(embeddings, torch.Tensor):
        embeddings = embeddings.detach().to("cpu", torch.float32).numpy()
    elif isinstance(embeddings, list) and embeddings and isinstance(embeddings[0], torch.Tensor):
        embeddings = torch.stack(embeddings).detach().to("cpu", torch.float32).numpy()
    array = np.asarray(embeddings)
    if array.dtype in (np.int8, np.uint8):
        raise ValueError("embeddings to quantize must be floats, not int8 or uint8")
    return array.astype(np.float32, copy=False)


def calibration_ranges(calibration_embeddings: Any) -> np.ndarray:
    """[2, dim] float32: the lowest and highest value of each dimension over a calibration set."""
    array = _as_float32(calibration_embeddings)
    if array.ndim != 2 or array.shape[0] < 2:
        raise ValueError(
            f"a calibration set needs at least 2 embeddings of shape [num, dim], got "
            f"{list(array.shape)}"
        )
    return np.vstack((array.min(axis=0), array.max(axis=0)))


def quantize_embeddings(
    embeddings: Any,
    precision: EmbedDType,
    ranges: np.ndarray | None = None,
    calibration_embeddings: Any = None,
) -> np.ndarray:
    """Embeddings ([num, dim] or [dim]; numpy, torch or lists) in `precision`, as
    sentence-transformers' `quantize_embeddings`: int8 / uint8 take `ranges` ([2, dim]), else
    the ranges of `calibration_embeddings`, else those of `embeddings` themselves (at least 2)."""
    spec = ENCODINGS.get(precision)
    if spec is None:
        raise ValueError(f"unknown precision {precision!r}; expected one of {EMBED_DTYPES}")
    array = _as_float32(embeddings)
    if spec.needs_ranges and ranges is None:
        source = array if calibration_embeddings is None else calibration_embeddings
        try:
            ranges = calibration_ranges(source)
        except ValueError as e:
            raise ValueError(
                f"{precision} needs per-dimension ranges: pass `ranges` or "
                f"`calibration_embeddings` ({e})"
            ) from e
    if spec.needs_ranges:
        check_ranges(ranges, array.shape[-1])  # type: ignore[arg-type]
    return spec.convert(array, ranges)


def check_ranges(ranges: np.ndarray, dim: int) -> None:
    """ValueError unless `ranges` is [2, dim] with finite values."""
    if ranges.ndim != 2 or ranges.shape[0] != 2:
        raise ValueError(f"ranges must have shape [2, dim], got {list(ranges.shape)}")
    if ranges.shape[1] != dim:
        raise ValueError(
            f"the calibration ranges have {ranges.shape[1]} dimensions, the embedding has {dim}"
        )
    if not np.isfinite(ranges).all():
        raise ValueError("the calibration ranges hold NaN or infinite values")


def encode_bytes(values: np.ndarray) -> bytes:
    """The stored values (from `quantize_embeddings`) as little-endian bytes."""
    return values.astype(values.dtype.newbyteorder("<"), copy=False).tobytes()


def encode_base64(values: np.ndarray) -> str:
    return base64.b64encode(encode_bytes(values)).decode("ascii")


def decode_base64(text: str, embed_dtype: EmbedDType) -> np.ndarray:
    """A base64 embedding back to its values: floats (float32 for bfloat16) or integers."""
    spec = ENCODINGS[embed_dtype]
    values = np.frombuffer(base64.b64decode(text), dtype=spec.wire_dtype.newbyteorder("<"))
    if embed_dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(spec.wire_dtype)


def as_json_values(values: np.ndarray, embed_dtype: EmbedDType) -> list[Any]:
    """The stored values as JSON numbers: integers for the quantized dtypes, the exact float of
    each float16 / bfloat16 value for those."""
    if embed_dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32).tolist()
    return values.tolist()


def load_ranges(path: str | Path) -> np.ndarray:
    """A .npy file of per-dimension ranges ([2, dim]: lowest, highest), checked."""
    ranges = np.load(path, allow_pickle=False).astype(np.float32)
    check_ranges(ranges, ranges.shape[-1] if ranges.ndim == 2 else -1)
    return ranges
