"""Writing the pooling routes' responses: each output's values as the request asks
(encodings.py), and the float path's vectors kept as numpy arrays until orjson writes the
response in one call from their buffers."""

from __future__ import annotations

from types import ModuleType
from typing import Any, TypeVar

import numpy as np
import torch
from pydantic import BaseModel

from tidepool.entrypoints.openai import protocol as p
from tidepool.entrypoints.openai.encodings import encode_values
from tidepool.entrypoints.openai.token_outputs import sparse_pooling_data
from tidepool.outputs import PoolingRequestOutput


def _orjson() -> ModuleType | None:
    try:
        import orjson
    except ImportError:  # the server then writes responses with pydantic alone
        return None
    return orjson


orjson = _orjson()


ModelT = TypeVar("ModelT", bound=BaseModel)


def pooling_data(
    values: torch.Tensor,
    encoding_format: str,
    embed_dtype: str,
    ranges: np.ndarray | None,
    endianness: str,
) -> list[Any] | str:
    """A /pooling `data` item: the encoded values, or a sparse output's index / value pairs."""
    if values.is_sparse:
        return sparse_pooling_data(values, encoding_format)
    return encode_values(values, encoding_format, embed_dtype, ranges, endianness)


# The float lists of a response are most of its work: `tolist()` makes a Python float per value,
# pydantic checks each, then writes each. With orjson installed (the `server` extras) the vectors
# stay arrays until the response is written, in one call from the array's buffer: a fraction of
# the CPU per response (docs/performance.md, 'Choices elsewhere in the code'). float64 arrays, so that every number is
# written exactly as `tolist()` + pydantic write it (the float32 value, in full).
def vectors_of(
    outputs: list[PoolingRequestOutput],
    encoding_format: str,
    embed_dtype: str,
    ranges: np.ndarray | None,
    endianness: str,
) -> list[Any]:
    """Each output's vector as the response will hold it (see above): numpy rows for orjson on
    the default float32 / float path, else each encoded as the request asks (pooling_data)."""
    tensors = [o.outputs.data for o in outputs]
    if (
        orjson is None
        or encoding_format != "float"
        or embed_dtype != "float32"
        or any(t.is_sparse for t in tensors)
    ):
        return [pooling_data(t, encoding_format, embed_dtype, ranges, endianness) for t in tensors]
    # A 0-d tensor is written as a one-value list, as encode_values does.
    tensors = [t.reshape(1) if t.dim() == 0 else t for t in tensors]
    if len({t.shape for t in tensors}) == 1:  # one conversion for all: rows of one array
        return list(torch.stack(tensors).detach().to(torch.float64).numpy())
    return [t.detach().to(torch.float64).numpy() for t in tensors]


def response_of(response_type: type[ModelT], item_type: type[BaseModel], **fields: Any) -> ModelT:
    """The response; its items built without validation when their vectors are arrays."""
    if orjson is None:
        fields["data"] = [item_type(**item) for item in fields["data"]]
    else:
        fields["data"] = [item_type.model_construct(**item) for item in fields["data"]]
    return response_type(**fields)


class _ArrayJson:
    """Writes the response with orjson when its `data` items hold numpy arrays (`_vector`)."""

    def model_dump_json(self, *, exclude_none: bool = False, **kwargs: Any) -> str:
        if orjson is None or kwargs:
            return super().model_dump_json(exclude_none=exclude_none, **kwargs)  # type: ignore[misc]
        model: BaseModel = self  # type: ignore[assignment]
        head = model.model_dump(exclude={"data"}, exclude_none=exclude_none)
        items = [_item_dict(item, exclude_none) for item in model.data]  # type: ignore[attr-defined]
        body = {name: items if name == "data" else head[name] for name in _names(model, head)}
        return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY).decode()


def _names(model: BaseModel, head: dict[str, Any]) -> list[str]:
    return [name for name in type(model).model_fields if name == "data" or name in head]


def _item_dict(item: BaseModel, exclude_none: bool) -> dict[str, Any]:
    values = {name: getattr(item, name) for name in type(item).model_fields}
    return {k: v for k, v in values.items() if v is not None} if exclude_none else values


class EmbeddingResponse(_ArrayJson, p.EmbeddingResponse):
    pass


class PoolingResponse(_ArrayJson, p.PoolingResponse):
    pass
