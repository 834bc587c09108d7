"""Cohere's v2 embed API, `POST /v2/embed`, over the same engine as /v1/embeddings: texts,
images (data URLs) or inputs (text and image parts) in, one list of embeddings per requested
`embedding_types` out."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from tidepool.engine.prompts import prompt_name_for_input_type
from tidepool.entrypoints.openai import protocol_cohere as pc
from tidepool.entrypoints.openai.encodings import encode_values, needs_ranges
from tidepool.entrypoints.openai.errors import ApiError
from tidepool.entrypoints.openai.inputs import parse_texts
from tidepool.entrypoints.openai.media_inputs import cohere_image_prompts
from tidepool.entrypoints.openai.serving import OpenAIServing
from tidepool.multimodal.media import source_description
from tidepool.quantize import ENCODINGS

# Cohere's `truncate` → (cut a long text to the budget, PoolingParams.truncation_side).
_TRUNCATION = {"END": (True, "right"), "START": (True, "left"), "NONE": (False, "right")}


def input_type_prompt(
    serving: OpenAIServing, input_type: str | None, images: bool = False
) -> str | None:
    """The model's prompt name for Cohere's `input_type` (engine/prompts.py's one rule, as the
    offline API); None runs the texts with the model's default prompt, if any. "image" goes
    with `images` only (Cohere's rule) and names no prompt."""
    if input_type == "image":
        if not images:
            raise ApiError(400, "input_type image goes with images, not texts", "input_type")
        return None
    return prompt_name_for_input_type(serving.model_config, input_type)


_PUBLIC_NAMES = (("truncate_prompt_tokens", "max_tokens"), ("dimensions", "output_dimension"))
"""The engine's parameter names in its messages → the fields of Cohere's body that set them."""


@contextlib.contextmanager
def cohere_names() -> Iterator[None]:
    """An error about an engine parameter names the Cohere field the client sent instead."""
    try:
        yield
    except ApiError as e:
        message, param = e.message, e.param
        for internal, public in _PUBLIC_NAMES:
            message = re.sub(rf"\b{internal}\b", public, message)
            param = public if param == internal else param
        if (message, param) == (e.message, e.param):
            raise
        raise ApiError(e.status, message, param, e.headers) from e


class CohereServing:
    request_type = pc.CohereEmbedRequest

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def _truncation(self, req: pc.CohereEmbedRequest) -> tuple[int | None, str]:
        """(truncate_prompt_tokens, truncation_side) of `truncate` and `max_tokens`."""
        cuts, side = _TRUNCATION[req.truncate]
        if not cuts:
            if req.max_tokens is not None:
                raise ApiError(400, "max_tokens needs truncate START or END, not NONE")
            return None, side
        return (-1 if req.max_tokens is None else req.max_tokens), side

    async def embed(self, req: pc.CohereEmbedRequest) -> pc.CohereEmbedResponse:
        serving = self.serving
        serving.model_name(req.model)
        given = [name for name in ("texts", "images", "inputs") if getattr(req, name) is not None]
        if len(given) != 1:
            what = " and ".join(given) or "none"
            raise ApiError(400, f"give one of texts, images or inputs; got {what}")
        serving.check_task("embed", "Embed")
        images = None
        if req.texts is not None:
            texts: list[Any] = parse_texts(req.texts, "texts", allow_single=False)
            param = "texts"
        else:
            texts, param = await cohere_image_prompts(serving, req.images, req.inputs, req.model)
            images = [t["multi_modal_data"]["image"] for t in texts] if req.images else None
        serving.check_count(len(texts), param)
        types = list(dict.fromkeys(req.embedding_types or ["float"]))
        ranges = None
        if any(t in ENCODINGS and needs_ranges(t) for t in types):
            ranges = await serving.ranges_for("int8", "embedding_types")
        truncate_prompt_tokens, side = self._truncation(req)
        prompt_name = input_type_prompt(serving, req.input_type, images is not None)
        with cohere_names():
            params = serving.pooling_params(
                param,
                task="embed",
                dimensions=req.output_dimension,
                truncate_prompt_tokens=truncate_prompt_tokens,
                truncation_side=side,
                prompt_name=prompt_name,
            )
            work = serving.engine.encode(texts, [params] * len(texts))
            outputs = await serving.run_batch(work, param)
        vectors = [o.outputs.data for o in outputs]
        embeddings = {t: [_encode(v, t, ranges) for v in vectors] for t in types}
        num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        meta = pc.CohereMeta(billed_units=pc.CohereBilledUnits(input_tokens=num_tokens))
        return pc.CohereEmbedResponse(
            embeddings=embeddings,
            texts=texts if req.texts is not None else None,
            images=[pc.CohereImage(**source_description(i)) for i in images] if images else None,
            meta=meta,
        )


def _encode(vector: Any, embedding_type: str, ranges: np.ndarray | None) -> Any:
    if embedding_type == "base64":
        return encode_values(vector, "base64", endianness="little")
    embed_dtype = "float32" if embedding_type == "float" else embedding_type
    return encode_values(vector, "float", embed_dtype, ranges, param="embedding_types")
