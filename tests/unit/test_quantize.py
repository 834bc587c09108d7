"""tidepool.quantize against sentence-transformers' quantize_embeddings (exact), and every base64
encoding decoded back to the values it encodes."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from tidepool.quantize import (
    EMBED_DTYPES,
    as_json_values,
    calibration_ranges,
    decode_base64,
    encode_base64,
    load_ranges,
    quantize_embeddings,
)

st_quantization = pytest.importorskip("sentence_transformers.util.quantization")

ST_PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")


@pytest.fixture(scope="module")
def vectors() -> np.ndarray:
    rng = np.random.default_rng(0)
    # 37 dimensions: the last packed byte is partial.
    return rng.standard_normal((20, 37)).astype(np.float32)


@pytest.fixture(scope="module")
def calibration() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((200, 37)).astype(np.float32)


@pytest.mark.parametrize("precision", ST_PRECISIONS)
def test_equal_to_sentence_transformers(precision, vectors, calibration) -> None:
    ours = quantize_embeddings(vectors, precision, calibration_embeddings=calibration)
    theirs = st_quantization.quantize_embeddings(
        vectors, precision, calibration_embeddings=calibration
    )
    assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)
    ranges = calibration_ranges(calibration)
    with_ranges = quantize_embeddings(torch.from_numpy(vectors), precision, ranges=ranges)
    assert np.array_equal(
        with_ranges, st_quantization.quantize_embeddings(vectors, precision, ranges)
    )
    # One row at a time (the server's way) gives the same rows.
    rows = [quantize_embeddings(v, precision, ranges=ranges) for v in vectors]
    assert np.array_equal(np.stack(rows), theirs)


def test_quantized_values_are_not_constant(vectors, calibration) -> None:
    ranges = calibration_ranges(calibration)
    for precision in ("int8", "uint8", "binary", "ubinary"):
        values = quantize_embeddings(vectors, precision, ranges=ranges)
        assert len(np.unique(values)) > 10, precision


def test_binary_layout(vectors) -> None:
    ubinary = quantize_embeddings(vectors, "ubinary")
    assert ubinary.shape == (20, 5)
    bits = np.unpackbits(ubinary, axis=-1)[:, :37]
    assert np.array_equal(bits.astype(bool), vectors > 0)
    assert not np.unpackbits(ubinary, axis=-1)[:, 37:].any()  # zero padding
    binary = quantize_embeddings(vectors, "binary")
    assert np.array_equal(binary.astype(np.int16) + 128, ubinary.astype(np.int16))


@pytest.mark.parametrize("embed_dtype", EMBED_DTYPES)
def test_base64_round_trip(embed_dtype, vectors, calibration) -> None:
    ranges = calibration_ranges(calibration)
    values = quantize_embeddings(vectors[0], embed_dtype, ranges=ranges)
    text = encode_base64(values)
    decoded = decode_base64(text, embed_dtype)
    expected = as_json_values(values, embed_dtype)
    assert decoded.tolist() == expected
    if embed_dtype in ("float32", "float16", "bfloat16"):
        torch_dtype = getattr(torch, embed_dtype)
        reference = torch.from_numpy(vectors[0]).to(torch_dtype).to(torch.float32).tolist()
        assert decoded.tolist() == reference


def test_bytes_are_little_endian() -> None:
    values = quantize_embeddings(np.array([1.0, -2.0], dtype=np.float32), "float32")
    assert base64.b64decode(encode_base64(values)) == np.array([1.0, -2.0], "<f4").tobytes()
    bf16 = quantize_embeddings(np.array([1.0], dtype=np.float32), "bfloat16")
    assert base64.b64decode(encode_base64(bf16)) == b"\x80\x3f"  # 1.0f = 0x3F800000
    half = quantize_embeddings(np.array([1.0], dtype=np.float32), "float16")
    assert base64.b64decode(encode_base64(half)) == b"\x00\x3c"  # 1.0h = 0x3C00


def test_scalar_quantization_needs_ranges(tmp_path) -> None:
    with pytest.raises(ValueError, match="ranges"):
        quantize_embeddings(np.ones(8, dtype=np.float32), "int8")
    with pytest.raises(ValueError, match="4 dimensions"):
        quantize_embeddings(np.ones(8, dtype=np.float32), "uint8", ranges=np.zeros((2, 4)))
    with pytest.raises(ValueError, match="unknown precision"):
        quantize_embeddings(np.ones(8, dtype=np.float32), "int4")  # type: ignore[arg-type]
    path = tmp_path / "ranges.npy"
    np.save(path, np.zeros((3, 8)))
    with pytest.raises(ValueError, match="shape"):
        load_ranges(path)
    np.save(path, np.stack([-np.ones(8), np.ones(8)]))
    assert load_ranges(path).shape == (2, 8)


def test_protocol_names_the_same_dtypes() -> None:
    from typing import get_args

    from tidepool.entrypoints.openai import protocol
    from tidepool.entrypoints.openai.encodings import FP8_DTYPES

    # quantize_embeddings' precisions, and vLLM's fp8 embed_dtypes (an encoding, not a quantizer).
    assert set(get_args(protocol.EmbedDType)) == set(EMBED_DTYPES) | set(FP8_DTYPES)
