"""Embeddings as the client asked for them: JSON floats or base64, in an embed dtype
(tidepool/quantize.py), and the per-dimension ranges int8 / uint8 need (`--embedding-calibration`).

The ranges come from one file named at start: a `.npy` of shape [2, dim] (lowest, highest value
of each dimension, as sentence-transformers' `ranges`), or any other file read as texts, one per
line, embedded once per model with its defaults on the first request that needs them (each model
of a server has its own ranges; a .npy's fit the models of its width). They describe
the model's default output (full size, its own normalization): a request whose embeddings have
another size (`dimensions`, `output_dimension`) is refused. sentence-transformers stores no ranges
with a model, so without the flag int8 / uint8 answer 400.
"""

from __future__ import annotations

import asyncio
import base64
import sys
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tidepool.engine.async_engine import AsyncEngine
from tidepool.entrypoints.openai.errors import ApiError
from tidepool.params import PoolingParams
from tidepool.quantize import (
    ENCODINGS,
    as_json_values,
    calibration_ranges,
    check_ranges,
    encode_bytes,
    load_ranges,
    quantize_embeddings,
)

NO_RANGES_HINT = (
    "start the server with --embedding-calibration FILE (texts, one per line, or a .npy of "
    "per-dimension ranges [2, dim]); sentence-transformers models store no ranges of their own"
)


class EmbeddingCalibration:
    """The int8 / uint8 ranges of one server, per model: a .npy's ranges (one width: the models
    whose embeddings have it), or from a file of texts, each model's own, computed once per
    model (keyed by its engine) on its first request that needs them."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = None if path is None else Path(path)
        self._file_ranges: np.ndarray | None = None
        self._texts: list[str] = []
        self._ranges: weakref.WeakKeyDictionary[AsyncEngine, np.ndarray] = (
            weakref.WeakKeyDictionary()
        )
        self._locks: weakref.WeakKeyDictionary[AsyncEngine, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )
        if self.path is None:
            return
        if self.path.suffix == ".npy":
            self._file_ranges = load_ranges(self.path)
            return
        self._texts = [line.strip() for line in self.path.read_text("utf-8").splitlines()]
        self._texts = [t for t in self._texts if t]
        if len(self._texts) < 2:
            raise ValueError(f"{self.path}: a calibration set needs at least 2 texts (one a line)")

    async def ranges(self, engine: AsyncEngine, param: str) -> np.ndarray:
        """[2, dim] float32 for the model of `engine`; 400 naming `param` when the server has
        no calibration set."""
        if self._file_ranges is not None:
            return self._file_ranges
        if self.path is None:
            raise ApiError(
                400, f"{param} int8 and uint8 need per-dimension ranges: " + NO_RANGES_HINT, param
            )
        ranges = self._ranges.get(engine)
        if ranges is not None:
            return ranges
        lock = self._locks.setdefault(engine, asyncio.Lock())
        async with lock:
            if engine not in self._ranges:
                # A long line is cut to the model's length rather than failing every request.
                params = [PoolingParams(task="embed", truncate_prompt_tokens=-1)] * len(self._texts)
                outputs = await engine.encode(self._texts, params)
                stacked = torch.stack([o.outputs.data for o in outputs])
                self._ranges[engine] = calibration_ranges(stacked)
        return self._ranges[engine]


FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
"""vLLM's fp8 embed dtypes: each value rounded to that float8 format, one byte on the wire."""

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    **FP8_DTYPES,
}


def needs_ranges(embed_dtype: str) -> bool:
    return embed_dtype in ENCODINGS and ENCODINGS[embed_dtype].needs_ranges


def binary_values(
    values: torch.Tensor,
    embed_dtype: str,
    ranges: np.ndarray | None = None,
    endianness: str = "native",
    param: str = "embed_dtype",
) -> bytes:
    """One output's values as raw bytes (vLLM's "bytes" encoding and base64's payload): the
    float dtypes as vLLM writes them (fp8 one byte a value), the quantized ones as stored."""
    if embed_dtype in _TORCH_DTYPES:
        t = values.detach().to("cpu", torch.float32).reshape(-1).to(_TORCH_DTYPES[embed_dtype])
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
        array = t.contiguous().view(view).numpy()
    else:
        array = quantize(values, embed_dtype, ranges, param).reshape(-1)
    order = sys.byteorder if endianness == "native" else endianness
    if order != sys.byteorder and array.dtype.itemsize > 1:
        array = array.byteswap()
    return array.tobytes()


def quantize(
    values: torch.Tensor, embed_dtype: str, ranges: np.ndarray | None, param: str
) -> np.ndarray:
    """One output ([dim] or [tokens, dim]) in `embed_dtype`; 400 when the ranges do not fit it."""
    array = values.detach().to("cpu", torch.float32).numpy()
    if ranges is not None:
        try:
            check_ranges(ranges, array.shape[-1])
        except ValueError as e:
            message = (
                f"{param}: {e}; int8 and uint8 quantize a model's full-size embeddings (no "
                "dimensions / output_dimension) with the ranges of --embedding-calibration: a "
                ".npy of ranges fits the models of its width only, a file of texts gives each "
                "model its own"
            )
            raise ApiError(400, message, param) from e
    return quantize_embeddings(array, embed_dtype, ranges=ranges)  # type: ignore[arg-type]


def encode_values(
    values: torch.Tensor,
    encoding_format: str,
    embed_dtype: str = "float32",
    ranges: np.ndarray | None = None,
    endianness: str = "native",
    param: str = "embed_dtype",
) -> list[Any] | str:
    """float → nested JSON numbers; base64 → the values' bytes (float32 little-endian by default,
    as OpenAI encodes them)."""
    if (
        embed_dtype == "float32"
        and endianness in ("native", "little")
        and sys.byteorder == "little"
    ):
        # The default, on the hot path: no copy through numpy's quantizer.
        if encoding_format == "base64":
            raw = values.detach().to(torch.float32).contiguous().numpy().astype("<f4", copy=False)
            return base64.b64encode(raw.tobytes()).decode("ascii")
        listed = values.tolist()
        return listed if isinstance(listed, list) else [listed]
    if embed_dtype in FP8_DTYPES:
        if encoding_format == "base64":
            return base64.b64encode(binary_values(values, embed_dtype)).decode("ascii")
        rounded = values.detach().to("cpu", torch.float32).to(FP8_DTYPES[embed_dtype])
        listed = rounded.to(torch.float32).tolist()
        return listed if isinstance(listed, list) else [listed]
    stored = quantize(values, embed_dtype, ranges, param)
    if encoding_format == "base64":
        order = sys.byteorder if endianness == "native" else endianness
        if order == "big":
            stored = stored.astype(stored.dtype.newbyteorder(">"))
            return base64.b64encode(stored.tobytes()).decode("ascii")
        return base64.b64encode(encode_bytes(stored)).decode("ascii")
    return as_json_values(stored, embed_dtype)  # type: ignore[arg-type]
