"""The pooling routes (embeddings, pooling, classify, score, rerank) and the checks every route
shares (model name, input count, task): parse and check the request, run it on the AsyncEngine,
build the response.

Every client mistake becomes an `ApiError` with the HTTP status and the reason; the routes in
server.py only call these methods and serialize the result.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from fastapi.responses import Response
from pydantic import BaseModel

from tidepool.engine.async_engine import AsyncEngine
from tidepool.engine.pooling import (
    cosine_scores,
    cross_encoder_score,
    expand_score_pairs,
    maxsim_scores,
    plan_embedding_scores,
    plan_late_interaction_scores,
    scoring_rule,
)
from tidepool.engine.prompts import check_prompt_name
from tidepool.entrypoints.openai import protocol as p
from tidepool.entrypoints.openai.encodings import (
    EmbeddingCalibration,
    needs_ranges,
)
from tidepool.entrypoints.openai.errors import ApiError
from tidepool.entrypoints.openai.inputs import format_batch_error, parse_prompts
from tidepool.entrypoints.openai.media_inputs import rerank_document, rerank_query, score_side
from tidepool.entrypoints.openai.responses import (
    EmbeddingResponse,
    PoolingResponse,
    response_of,
    vectors_of,
)
from tidepool.entrypoints.openai.serving_vllm import (
    bytes_response,
    check_vllm_fields,
    cut_pairs,
    prompts_value,
    response_id,
    use_activation_of,
)
from tidepool.entrypoints.openai.token_outputs import token_classification_data
from tidepool.output_heads import get_head
from tidepool.outputs import BatchInputError, PoolingRequestOutput
from tidepool.params import PoolingParams, check_pooling_task
from tidepool.utils.lists import filled

T = TypeVar("T")
ModelT = TypeVar("ModelT", bound=BaseModel)


@dataclass(frozen=True)
class ServingLimits:
    max_inputs_per_request: int = 2048
    """More inputs (or documents, or pairs) in one request → 413."""
    trust_request_chat_template: bool = False
    """--trust-request-chat-template: a request may bring its own `chat_template` (else 400
    naming the flag, as vLLM)."""
    enable_prompt_tokens_details: bool = False
    """--enable-prompt-tokens-details: generation usage reports prompt_tokens_details."""


# ---------------------------------------------------------------------- output helpers


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
        calibration: EmbeddingCalibration | None = None,
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.limits = limits or ServingLimits()
        self.model_config = engine.model_config
        self.calibration = calibration or EmbeddingCalibration(None)

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
        head_kind = get_head(self.model_config.output_head).kind  # a SPLADE, BGE-M3 ... model
        return head_kind or kinds.get(self.model_config.task, "an embedding model")

    # The public surface the other routes' services (serving_cohere.py, serving_tei.py,
    # serving_sparse.py) build on: check_task, pooling_params, run_batch, encode_input,
    # score_pairs (with model_name, check_count and ranges_for).

    def check_task(self, task: str, api: str) -> None:
        """400 naming `api` when the model does not serve `task`."""
        if task not in self.engine.supported_tasks:
            supported = ", ".join(self.engine.supported_tasks) or "none"
            raise ApiError(
                400,
                f"The model does not support the {api} API: it is {self._model_kind()} "
                f"(supported pooling tasks: {supported})",
            )

    def _default_task(self) -> str:
        """The pooling task of a request that names none: the model's own."""
        return self.model_config.default_pooling_task

    def pooling_params(self, param: str = "input", **fields: Any) -> PoolingParams:
        """PoolingParams(**fields); 400 naming the faulty field (`param` when none is named)."""
        try:
            check_prompt_name(self.model_config, fields.get("prompt_name"))
        except ValueError as e:
            raise ApiError(400, str(e), "prompt_name") from e
        try:
            return PoolingParams(**fields)
        except ValueError as e:
            raise ApiError(400, str(e), _field_of(str(e), param)) from e

    async def run_batch(self, work: Awaitable[T], param: str) -> T:
        """The engine's answer to `work`; a BatchInputError becomes a 400 naming the input."""
        try:
            return await work
        except BatchInputError as e:
            raise ApiError(400, format_batch_error(e, param), param) from e

    async def encode_input(
        self, value: Any, param: str = "input", **param_fields: Any
    ) -> list[PoolingRequestOutput]:
        """Every prompt of a request's `input` through the engine with the same PoolingParams
        (checked in this order: the prompts, their count, the parameters; 400 / 413 on a fault)."""
        prompts = parse_prompts(value, param)
        self.check_count(len(prompts), param)
        params = self.pooling_params(param, **param_fields)
        return await self.run_batch(self.engine.encode(prompts, [params] * len(prompts)), param)

    # ------------------------------------------------------------------ embeddings / pooling

    async def ranges_for(self, embed_dtype: str, param: str) -> np.ndarray | None:
        """The int8 / uint8 calibration ranges (None for the other dtypes); 400 when none."""
        if not needs_ranges(embed_dtype):
            return None
        return await self.calibration.ranges(self.engine, param)

    async def embed(self, req: p.EmbeddingRequest) -> p.EmbeddingResponse | Response:
        model = self.model_name(req.model)
        self.check_task("embed", "Embeddings")
        check_vllm_fields(req)
        ranges = await self.ranges_for(req.embed_dtype, "embed_dtype")
        value, param = await prompts_value(self, req)
        outputs = await self.encode_input(
            value,
            param,
            task="embed",
            dimensions=req.dimensions,
            use_activation=use_activation_of(req, "normalize"),
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            truncation_side=req.truncation_side,
            prompt_name=req.prompt_name,
        )
        if req.encoding_format in ("bytes", "bytes_only"):
            return bytes_response(outputs, req, model, _usage(outputs), "embd")
        data = [
            {"index": i, "embedding": vector}
            for i, vector in enumerate(
                vectors_of(outputs, req.encoding_format, req.embed_dtype, ranges, req.endianness)
            )
        ]
        return response_of(
            EmbeddingResponse,
            p.EmbeddingResponseData,
            model=model,
            data=data,
            usage=_usage(outputs),
            **response_id("embd", req),
        )

    async def pool(self, req: p.PoolingRequest) -> p.PoolingResponse | Response:
        model = self.model_name(req.model)
        task = req.task or self._default_task()
        try:
            check_pooling_task(task)
        except ValueError as e:
            raise ApiError(400, str(e), "task") from e
        self.check_task(task, f"Pooling (task={task})")
        check_vllm_fields(req)
        ranges = await self.ranges_for(req.embed_dtype, "embed_dtype")
        value, param = await prompts_value(self, req)
        outputs = await self.encode_input(
            value,
            param,
            task=task,
            dimensions=req.dimensions,
            use_activation=use_activation_of(req, "normalize", "activation"),
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            truncation_side=req.truncation_side,
            prompt_name=req.prompt_name,
        )
        if req.encoding_format in ("bytes", "bytes_only"):
            return bytes_response(outputs, req, model, _usage(outputs), "pool")
        data = [
            {"index": i, "data": vector}
            for i, vector in enumerate(
                vectors_of(outputs, req.encoding_format, req.embed_dtype, ranges, req.endianness)
            )
        ]
        return response_of(
            PoolingResponse,
            p.PoolingResponseData,
            model=model,
            data=data,
            usage=_usage(outputs),
            **response_id("pool", req),
        )

    # ------------------------------------------------------------------ classify

    async def classify(self, req: p.ClassificationRequest) -> p.ClassificationResponse:
        model = self.model_name(req.model)
        # A token classifier answers per token (the task it serves).
        per_token = "classify" not in self.engine.supported_tasks
        task = "token_classify" if per_token else "classify"
        self.check_task(task, "Classification")
        check_vllm_fields(req)
        value, param = await prompts_value(self, req)
        outputs = await self.encode_input(
            value,
            param,
            task=task,
            use_activation=use_activation_of(req, "activation"),
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            truncation_side=req.truncation_side,
        )
        id2label = getattr(self.model_config.hf_config, "id2label", None) or {}
        if per_token:
            data = token_classification_data(outputs, id2label)
            return p.ClassificationResponse(
                model=model, data=data, usage=_usage(outputs), **response_id("classify", req)
            )
        data = []
        for i, o in enumerate(outputs):
            probs = o.outputs.data.reshape(-1).tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            label = id2label.get(best, id2label.get(str(best), f"LABEL_{best}"))
            data.append(
                p.ClassificationData(index=i, label=label, probs=probs, num_classes=len(probs))
            )
        return p.ClassificationResponse(
            model=model, data=data, usage=_usage(outputs), **response_id("classify", req)
        )

    # ------------------------------------------------------------------ score / rerank

    async def score(self, req: p.ScoreRequest) -> p.ScoreResponse:
        model = self.model_name(req.model)
        names = _score_fields(req)
        first = await score_side(self, getattr(req, names[0]), names[0], req.model)
        second = await score_side(self, getattr(req, names[1]), names[1], req.model)
        try:
            pairs = expand_score_pairs(first, second, names)
        except ValueError as e:
            raise ApiError(400, str(e), names[0]) from e
        self.check_count(len(second), names[1])
        check_vllm_fields(req)
        pairs = await cut_pairs(self, req, pairs)
        scores, num_tokens = await self.score_pairs(
            pairs,
            req.truncate_prompt_tokens,
            use_activation_of(req, "activation"),
            param=names[1],
            truncation_side=req.truncation_side or "right",
        )
        data = [p.ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)]
        usage = p.UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens)
        return p.ScoreResponse(model=model, data=data, usage=usage, **response_id("score", req))

    async def rerank(self, req: p.RerankRequest) -> p.RerankResponse:
        model = self.model_name(req.model)
        query = await rerank_query(self, req.query, req.model)
        documents = await score_side(self, req.documents, "documents", req.model, False)
        self.check_count(len(documents), "documents")
        if req.top_n is not None and req.top_n < 0:
            raise ApiError(400, f"top_n must be >= 0 (0 = all), got {req.top_n}", "top_n")
        check_vllm_fields(req)
        pairs = await cut_pairs(self, req, [(query, doc) for doc in documents])
        scores, num_tokens = await self.score_pairs(
            pairs,
            req.truncate_prompt_tokens,
            use_activation_of(req, "activation"),
            param="documents",
            truncation_side=req.truncation_side or "right",
        )
        order = sorted(range(len(documents)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[: req.top_n]
        results = [
            p.RerankResult(
                index=i,
                document=(
                    p.RerankDocument(**rerank_document(req.documents, i, documents[i]))
                    if req.return_documents
                    else None
                ),
                relevance_score=scores[i],
            )
            for i in order
        ]
        return p.RerankResponse(
            model=model,
            usage=p.RerankUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
            results=results,
            **response_id("rerank", req),
        )

    # Scoring rules (pairs, cross-encoder scores, cosine of each distinct text once) are the
    # engine's (engine/pooling.py), shared with the offline LLM; here only the HTTP errors.

    async def score_pairs(
        self,
        pairs: list[tuple[str, str]],
        truncate_prompt_tokens: int | None,
        activation: bool | None,
        param: str = "text_2",
        truncation_side: str = "right",
    ) -> tuple[list[float], int]:
        """A cross-encoder reads each pair; a ColBERT model scores MaxSim; an embedding model
        scores the cosine (as vLLM)."""
        mc = self.model_config
        rule = scoring_rule(mc.task, mc.multi_vector is not None, mc.default_pooling_task)
        if rule == "late_interaction":
            return await self._score_by_late_interaction(pairs, truncate_prompt_tokens, param)
        if "score" in self.engine.supported_tasks:
            params = self.pooling_params(
                param,
                task="score",
                truncate_prompt_tokens=truncate_prompt_tokens,
                use_activation=activation,
                truncation_side=truncation_side,
            )
            outputs = await self.run_batch(
                self.engine.encode_pairs(pairs, [params] * len(pairs)), param
            )
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
        return await self._score_by_embedding(pairs, truncate_prompt_tokens, param, truncation_side)

    async def _score_by_embedding(
        self,
        pairs: list[tuple[str, str]],
        truncate_prompt_tokens: int | None,
        param: str,
        truncation_side: str,
    ) -> tuple[list[float], int]:
        plan = plan_embedding_scores(pairs)
        params = self.pooling_params(
            param,
            task="embed",
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
        )
        try:
            outputs = await self.engine.encode(plan.texts, [params] * len(plan.texts))
        except BatchInputError as e:
            first = e.errors[0]
            raise ApiError(400, f"{plan.texts[first.index]!r:.60}: {first.message}", param) from e
        scores = cosine_scores([o.outputs.data for o in outputs], plan.pair_slots)
        return filled(scores), sum(len(o.prompt_token_ids) for o in outputs)

    async def _score_by_late_interaction(
        self, pairs: list[tuple[str, str]], truncate_prompt_tokens: int | None, param: str
    ) -> tuple[list[float], int]:
        plan = plan_late_interaction_scores(pairs)
        sides = []
        for texts, role, side in (
            (plan.queries, "query", "text_1" if param == "text_2" else "query"),
            (plan.documents, "document", param),
        ):
            params = self.pooling_params(
                param,
                task="token_embed",
                truncate_prompt_tokens=truncate_prompt_tokens,
                # ColBERT encodes each side its way; another token_embed model the same way.
                prompt_name=role if self.model_config.multi_vector is not None else None,
            )
            try:
                sides.append(await self.engine.encode(texts, [params] * len(texts)))
            except BatchInputError as e:
                first = e.errors[0]
                raise ApiError(400, f"{texts[first.index]!r:.60}: {first.message}", side) from e
        queries, documents = sides
        scores = maxsim_scores(
            [o.outputs.data for o in queries], [o.outputs.data for o in documents], plan.pair_slots
        )
        num_tokens = sum(len(o.prompt_token_ids) for o in queries + documents)
        return filled(scores), num_tokens

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


_SCORE_FIELDS = (
    ("queries", "documents"),
    ("queries", "items"),
    ("text_1", "text_2"),
    ("data_1", "data_2"),
)


def _score_fields(req: p.ScoreRequest) -> tuple[str, str]:
    """The one pair of fields a /score body uses; 400 for none, half a pair, or two pairs."""
    given = [pair for pair in _SCORE_FIELDS if getattr(req, pair[1]) is not None]
    if not given:  # half a pair: the first side's pair (its other half then reported missing)
        given = [pair for pair in _SCORE_FIELDS if getattr(req, pair[0]) is not None][:1]
    if len(given) != 1:
        names = " or ".join(f"{a} / {b}" for a, b in _SCORE_FIELDS)
        what = "none" if not given else " and ".join(f"{a} / {b}" for a, b in given)
        raise ApiError(400, f"/score takes one pair of fields, {names}; got {what}", None)
    for name in given[0]:
        if getattr(req, name) is None:
            raise ApiError(400, f"{name} is missing (it goes with {' / '.join(given[0])})", name)
    return given[0]


def _field_of(message: str, default: str) -> str:
    names = ("dimensions", "truncate_prompt_tokens", "task", "max_active_dims", "prompt_name")
    for name in (*names, "use_activation", "truncation_side"):
        if name in message:
            return name
    return default
