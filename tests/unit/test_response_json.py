"""The embedding and pooling responses written with orjson from arrays (responses.py) hold the same
JSON as pydantic writes from float lists: same fields in the same order, the same numbers."""

from __future__ import annotations

import json

import pytest
import torch

from tidepool.entrypoints.openai import protocol as p
from tidepool.entrypoints.openai import responses, serving
from tidepool.outputs import PoolingOutput, PoolingRequestOutput


def _outputs(shapes: list[tuple[int, ...]]) -> list[PoolingRequestOutput]:
    torch.manual_seed(0)
    return [
        PoolingRequestOutput(f"r{i}", [1, 2, 3], PoolingOutput(torch.randn(shape)))
        for i, shape in enumerate(shapes)
    ]


def _write(outputs: list[PoolingRequestOutput], kind: str) -> dict:
    response_type, item_type, field = {
        "embedding": (responses.EmbeddingResponse, p.EmbeddingResponseData, "embedding"),
        "pooling": (responses.PoolingResponse, p.PoolingResponseData, "data"),
    }[kind]
    vectors = responses.vectors_of(outputs, "float", "float32", None, "native")
    data = [{"index": i, field: v} for i, v in enumerate(vectors)]
    response = responses.response_of(
        response_type, item_type, model="m", data=data, usage=serving._usage(outputs)
    )
    body = json.loads(response.model_dump_json())
    body.pop("id"), body.pop("created", None)
    return body


@pytest.mark.parametrize(
    ("kind", "shapes"),
    [("embedding", [(384,)] * 3), ("pooling", [(4, 8), (2, 8)]), ("pooling", [()])],
)
def test_orjson_writes_what_pydantic_writes(kind: str, shapes, monkeypatch) -> None:
    pytest.importorskip("orjson")
    outputs = _outputs(shapes)
    fast = _write(outputs, kind)
    monkeypatch.setattr(responses, "orjson", None)
    plain = _write(outputs, kind)
    assert json.dumps(fast) == json.dumps(plain)  # also the order of the fields
    first = plain["data"][0]["embedding" if kind == "embedding" else "data"]
    assert first == (
        outputs[0].outputs.data.reshape(-1).tolist()
        if not shapes[0]
        else outputs[0].outputs.data.tolist()
    )
