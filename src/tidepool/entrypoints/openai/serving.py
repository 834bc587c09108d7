"""The pooling routes (embeddings, pooling, classify, score, rerank) and the checks every route
shares (model name, input count, task): parse and check the request, run it on the AsyncEngine,
build the response.

Every client mistake becomes an `ApiError` with the HTTP status and the reason; the routes in
server.py only call these methods and serialize the result.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from pydantic import BaseModel

try:
    import orjson
except ImportError:  # the server then writes responses with pydantic alone
    orjson = None  # type: ignore[assignment]

from tidepool.engine.async_engine import AsyncEngine
from tidepool.engine.pooling import (
    cosine_scores,
    cross_encoder_score,
    default_pooling_task,
    expand_score_pairs,
    plan_embedding_scores,
)
from tidepool.entrypoints.openai import protocol as p
from tidepool.entrypoints.openai.errors import ApiError
from tidepool.entrypoints.openai.inputs import (
    check_text,
    format_batch_error,
    parse_prompts,
    parse_texts,
)
from tidepool.outputs import BatchInputError, PoolingRequestOutput
from tidepool.params import PoolingParams

T = TypeVar("T")
ModelT = TypeVar("ModelT", bound=BaseModel)


@dataclass(frozen=True)
class ServingLimits:
    max_inputs_per_request: int = 2048
    """More inputs (or documents, or pairs) in one request → 413."""


# ---------------------------------------------------------------------- output helpers


def encode_floats(values: torch.Tensor, encoding_format: str) -> list[Any] | str:
    """float → nested lists; base64 → little-endian float32 bytes, as OpenAI encodes them."""
    if encoding_format == "base64":
        raw = values.detach().to(torch.float32).contiguous().numpy().astype("<f4", copy=False)
        return base64.b64encode(raw.tobytes()).decode("ascii")
    listed = values.tolist()
    return listed if isinstance(listed, list) else [listed]


# The float lists of a response are most of its work: `tolist()` makes a Python float per value,
# pydantic checks each, then writes each. With orjson installed (the `server` extras) the vectors
# stay arrays until the response is written, in one call from the array's buffer: ~3x less CPU
# per response (32 vectors of 384: 2.3 ms → 0.8 ms). float64 arrays, so that every number is
# written exactly as `tolist()` + pydantic write it (the float32 value, in full).
def _vectors(outputs: list[PoolingRequestOutput], encoding_format: str) -> list[Any]:
    """Each output's vector as the response will hold it (see above)."""
    tensors = [o.outputs.data for o in outputs]
    if orjson is None or encoding_format != "float":
        return [encode_floats(t, encoding_format) for t in tensors]
    # A 0-d tensor is written as a one-value list, as encode_floats does.
    tensors = [t.reshape(1) if t.dim() == 0 else t for t in tensors]
    if len({t.shape for t in tensors}) == 1:  # one conversion for all: rows of one array
        return list(torch.stack(tensors).detach().to(torch.float64).numpy())
    return [t.detach().to(torch.float64).numpy() for t in tensors]


def _response(response_type: type[ModelT], item_type: type[BaseModel], **fields: Any) -> ModelT:
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


def _usage(outputs: list[PoolingRequestOutput]) -> p.UsageInfo:
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return p.UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens)


# ---------------------------------------------------------------------- serving


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        served_model_names: list[str],
        limits: ServingLimits | None = None,
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.limits = limits or ServingLimits()
        self.model_config = engine.model_config

    # ------------------------------------------------------------------ checks

    def model_name(self, requested: str | None) -> str:
        """The served name to answer with; 404 for a name this server does not serve."""
        if requested is None or requested == "":
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise ApiError(404, f"The model `{requested}` does not exist.", "model")
        return requested

    def check_count(self, num_inputs: int, param: str) -> None:
        limit = self.limits.max_inputs_per_request
        if num_inputs > limit:
            raise ApiError(
                413,
                f"{param} has {num_inputs} items, more than this server's limit of {limit} per "
                "request (--max-inputs-per-request); split the request",
                param,
            )

    def _model_kind(self) -> str:
        kinds = {"classify": "a cross-encoder / classifier", "generate": "a generating model"}
        return kinds.get(self.model_config.task, "an embedding model")

    def _check_task(self, task: str, api: str) -> None:
        if task not in self.engine.supported_tasks:
            supported = ", ".join(self.engine.supported_tasks) or "none"
            raise ApiError(
                400,
                f"The model does not support the {api} API: it is {self._model_kind()} "
                f"(supported pooling tasks: {supported})",
            )

    def _default_task(self) -> str:
        """The pooling task of a request that names none: the model's own."""
        return default_pooling_task(self.model_config.task)

    def _params(self, param: str = "input", **fields: Any) -> PoolingParams:
        try:
            return PoolingParams(**fields)
        except ValueError as e:
            raise ApiError(400, str(e), _field_of(str(e), param)) from e

    async def _run(self, work: Awaitable[T], param: str) -> T:
        try:
            return await work
        except BatchInputError as e:
            raise ApiError(400, format_batch_error(e, param), param) from e

    async def _encode_input(self, value: Any, **param_fields: Any) -> list[PoolingRequestOutput]:
        """Every prompt of a request's `input` through the engine with the same PoolingParams
        (checked in this order: the prompts, their count, the parameters; 400 / 413 on a fault)."""
        prompts = parse_prompts(value)
        self.check_count(len(prompts), "input")
        params = self._params(**param_fields)
        return await self._run(self.engine.encode(prompts, [params] * len(prompts)), "input")

    # ------------------------------------------------------------------ embeddings / pooling

    async def embed(self, req: p.EmbeddingRequest) -> p.EmbeddingResponse:
        model = self.model_name(req.model)
        self._check_task("embed", "Embeddings")
        outputs = await self._encode_input(
            req.input,
            task="embed",
            dimensions=req.dimensions,
            normalize=req.normalize,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
        data = [
            {"index": i, "embedding": vector}
            for i, vector in enumerate(_vectors(outputs, req.encoding_format))
        ]
        return _response(
            EmbeddingResponse,
            p.EmbeddingResponseData,
            model=model,
            data=data,
            usage=_usage(outputs),
        )

    async def pool(self, req: p.PoolingRequest) -> p.PoolingResponse:
        model = self.model_name(req.model)
        task = req.task or self._default_task()
        self._check_task(task, f"Pooling (task={task})")
        outputs = await self._encode_input(
            req.input,
            task=task,
            dimensions=req.dimensions,
            normalize=req.normalize,
            activation=req.activation,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
        data = [
            {"index": i, "data": vector}
            for i, vector in enumerate(_vectors(outputs, req.encoding_format))
        ]
        return _response(
            PoolingResponse, p.PoolingResponseData, model=model, data=data, usage=_usage(outputs)
        )

    # ------------------------------------------------------------------ classify

    async def classify(self, req: p.ClassificationRequest) -> p.ClassificationResponse:
        model = self.model_name(req.model)
        self._check_task("classify", "Classification")
        outputs = await self._encode_input(
            req.input,
            task="classify",
            activation=req.activation,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
        id2label = getattr(self.model_config.hf_config, "id2label", None) or {}
        data = []
        for i, o in enumerate(outputs):
            probs = o.outputs.data.reshape(-1).tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            label = id2label.get(best, id2label.get(str(best), f"LABEL_{best}"))
            data.append(
                p.ClassificationData(index=i, label=label, probs=probs, num_classes=len(probs))
            )
        return p.ClassificationResponse(model=model, data=data, usage=_usage(outputs))

    # ------------------------------------------------------------------ score / rerank

    async def score(self, req: p.ScoreRequest) -> p.ScoreResponse:
        model = self.model_name(req.model)
        first = parse_texts(req.text_1, "text_1")
        second = parse_texts(req.text_2, "text_2")
        try:
            pairs = expand_score_pairs(first, second, ("text_1", "text_2"))
        except ValueError as e:
            raise ApiError(400, str(e), "text_1") from e
        self.check_count(len(second), "text_2")
        scores, num_tokens = await self._score_pairs(
            pairs, req.truncate_prompt_tokens, req.activation
        )
        data = [p.ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)]
        usage = p.UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens)
        return p.ScoreResponse(model=model, data=data, usage=usage)

    async def rerank(self, req: p.RerankRequest) -> p.RerankResponse:
        model = self.model_name(req.model)
        if not isinstance(req.query, str) or not req.query:
            raise ApiError(400, f"query must be a non-empty string, got {req.query!r:.40}", "query")
        check_text(req.query, "query", "query")
        documents = parse_texts(req.documents, "documents", allow_single=False)
        self.check_count(len(documents), "documents")
        if req.top_n is not None and req.top_n < 0:
            raise ApiError(400, f"top_n must be >= 0 (0 = all), got {req.top_n}", "top_n")
        pairs = [(req.query, doc) for doc in documents]
        scores, num_tokens = await self._score_pairs(
            pairs, req.truncate_prompt_tokens, req.activation, param="documents"
        )
        order = sorted(range(len(documents)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[: req.top_n]
        results = [
            p.RerankResult(
                index=i,
                document=p.RerankDocument(text=documents[i]) if req.return_documents else None,
                relevance_score=scores[i],
            )
            for i in order
        ]
        return p.RerankResponse(
            model=model, usage=p.RerankUsage(total_tokens=num_tokens), results=results
        )

    # Scoring rules (pairs, cross-encoder scores, cosine of each distinct text once) are the
    # engine's (engine/pooling.py), shared with the offline LLM; here only the HTTP errors.

    async def _score_pairs(
        self,
        pairs: list[tuple[str, str]],
        truncate_prompt_tokens: int | None,
        activation: bool | None,
        param: str = "text_2",
    ) -> tuple[list[float], int]:
        """A cross-encoder reads each pair; an embedding model scores the cosine (as vLLM)."""
        if "score" in self.engine.supported_tasks:
            params = self._params(
                param,
                task="score",
                truncate_prompt_tokens=truncate_prompt_tokens,
                activation=activation,
            )
            outputs = await self._run(self.engine.encode_pairs(pairs, [params] * len(pairs)), param)
            scores = [cross_encoder_score(o.outputs.data) for o in outputs]
            return scores, sum(len(o.prompt_token_ids) for o in outputs)
        if "embed" not in self.engine.supported_tasks:
            labels = f" with {self.model_config.num_labels} labels"
            raise ApiError(
                400,
                f"The model cannot score: it is {self._model_kind()}"
                f"{labels if self.model_config.task == 'classify' else ''} (scoring needs a "
                "cross-encoder with one label or an embedding model)",
            )
        return await self._score_by_embedding(pairs, truncate_prompt_tokens, param)

    async def _score_by_embedding(
        self, pairs: list[tuple[str, str]], truncate_prompt_tokens: int | None, param: str
    ) -> tuple[list[float], int]:
        plan = plan_embedding_scores(pairs)
        params = self._params(param, task="embed", truncate_prompt_tokens=truncate_prompt_tokens)
        try:
            outputs = await self.engine.encode(plan.texts, [params] * len(plan.texts))
        except BatchInputError as e:
            first = e.errors[0]
            raise ApiError(400, f"{plan.texts[first.index]!r:.60}: {first.message}", param) from e
        scores = cosine_scores([o.outputs.data for o in outputs], plan.pair_slots)
        return scores, sum(len(o.prompt_token_ids) for o in outputs)  # type: ignore[return-value]

    # ------------------------------------------------------------------ models

    def models(self) -> p.ModelList:
        return p.ModelList(
            data=[
                p.ModelCard(
                    id=name,
                    root=self.model_config.model,
                    max_model_len=self.model_config.max_model_len,
                )
                for name in self.served_model_names
            ]
        )

    def check_generates(self, requested: str | None, api: str) -> str:
        """The served name to answer with; 404 for an unknown name, 400 on a pooling model."""
        name = self.model_name(requested)
        if not self.engine.can_generate:
            raise ApiError(
                400,
                f"The model does not support the {api} API: `{name}` does not generate text "
                f"(it is {self._model_kind()}); use /v1/embeddings, /pooling, /classify, /score "
                "or /rerank",
                "model",
            )
        return name


def _field_of(message: str, default: str) -> str:
    for name in ("dimensions", "truncate_prompt_tokens", "task"):
        if name in message:
            return name
    return default
