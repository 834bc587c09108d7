"""What each route does: parse and check the request, run it on the AsyncEngine, build the response.

Every client mistake becomes an `ApiError` with the HTTP status and the reason; the routes in
server.py only call these methods and serialize the result.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from tidepool.engine.async_engine import AsyncEngine
from tidepool.entrypoints.openai import protocol as p
from tidepool.outputs import BatchInputError, PoolingRequestOutput
from tidepool.params import PoolingParams

T = TypeVar("T")

INPUT_TYPES_HINT = "a string, a list of strings, a list of token ids or a list of token-id lists"
_MAX_ERRORS_SHOWN = 3


class ApiError(Exception):
    """A request the server refuses, with its HTTP status and a message for the client."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


@dataclass(frozen=True)
class ServingLimits:
    max_inputs_per_request: int = 2048
    """More inputs (or documents, or pairs) in one request → 413."""


# ---------------------------------------------------------------------- parsing helpers


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_prompts(value: Any, param: str = "input") -> list[Any]:
    """`input` as OpenAI accepts it → prompts for InputProcessor (strings or token-id dicts).

    "a" → ["a"];  ["a", "b"] → ["a", "b"];  [1, 2] → [{ids: [1, 2]}];  [[1], [2]] → two prompts.
    """
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ApiError(400, f"{param} must be {INPUT_TYPES_HINT}, got {_type_name(value)}", param)
    if not value:
        raise ApiError(400, f"{param} is an empty list: give at least one input", param)
    if all(_is_token_id(v) for v in value):
        return [{"prompt_token_ids": value}]
    prompts: list[Any] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list):
            prompts.append({"prompt_token_ids": item})
        else:
            raise ApiError(
                400,
                f"{param}[{i}] has type {_type_name(item)}; expected a string or a list of token "
                f"ids ({param} must be {INPUT_TYPES_HINT})",
                param,
            )
    return prompts


def parse_texts(value: Any, param: str, allow_single: bool = True) -> list[str]:
    """A string or a non-empty list of strings (score and rerank inputs)."""
    if isinstance(value, str) and allow_single:
        return [value]
    if isinstance(value, dict) and "text" in value and allow_single:
        return parse_texts(value["text"], param)
    if not isinstance(value, list):
        raise ApiError(
            400, f"{param} must be a string or a list of strings, got {_type_name(value)}", param
        )
    if not value:
        raise ApiError(400, f"{param} is an empty list", param)
    texts = []
    for i, item in enumerate(value):
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            item = item["text"]  # Cohere v1 / Jina document objects
        if not isinstance(item, str):
            raise ApiError(
                400, f"{param}[{i}] has type {_type_name(item)}; expected a string", param
            )
        if not item:
            raise ApiError(400, f"{param}[{i}] is an empty string", param)
        texts.append(item)
    return texts


def _type_name(value: Any) -> str:
    return {type(None): "null", dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), type(value).__name__
    )


def _format_batch_error(error: BatchInputError, param: str) -> str:
    shown = [f"{param}[{e.index}]: {e.message}" for e in error.errors[:_MAX_ERRORS_SHOWN]]
    more = len(error.errors) - _MAX_ERRORS_SHOWN
    return "; ".join(shown) + (f" (and {more} more invalid inputs)" if more > 0 else "")


def encode_floats(values: torch.Tensor, encoding_format: str) -> list[Any] | str:
    """float → nested lists; base64 → little-endian float32 bytes, as OpenAI encodes them."""
    if encoding_format == "base64":
        raw = values.detach().to(torch.float32).contiguous().numpy().astype("<f4", copy=False)
        return base64.b64encode(raw.tobytes()).decode("ascii")
    listed = values.tolist()
    return listed if isinstance(listed, list) else [listed]


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

    def _check_count(self, num_inputs: int, param: str) -> None:
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

    def _params(self, param: str = "input", **fields: Any) -> PoolingParams:
        try:
            return PoolingParams(**fields)
        except ValueError as e:
            raise ApiError(400, str(e), _field_of(str(e), param)) from e

    async def _run(self, work: Awaitable[T], param: str) -> T:
        try:
            return await work
        except BatchInputError as e:
            raise ApiError(400, _format_batch_error(e, param), param) from e

    async def _encode_input(self, value: Any, **param_fields: Any) -> list[PoolingRequestOutput]:
        """Every prompt of a request's `input` through the engine with the same PoolingParams
        (checked in this order: the prompts, their count, the parameters; 400 / 413 on a fault)."""
        prompts = parse_prompts(value)
        self._check_count(len(prompts), "input")
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
            p.EmbeddingResponseData(
                index=i, embedding=encode_floats(o.outputs.data, req.encoding_format)
            )
            for i, o in enumerate(outputs)
        ]
        return p.EmbeddingResponse(model=model, data=data, usage=_usage(outputs))

    async def pool(self, req: p.PoolingRequest) -> p.PoolingResponse:
        model = self.model_name(req.model)
        task = req.task or ("classify" if self.model_config.task == "classify" else "embed")
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
            p.PoolingResponseData(index=i, data=encode_floats(o.outputs.data, req.encoding_format))
            for i, o in enumerate(outputs)
        ]
        return p.PoolingResponse(model=model, data=data, usage=_usage(outputs))

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
        if len(first) == 1:
            first = first * len(second)
        elif len(first) != len(second):
            raise ApiError(
                400,
                f"text_1 has {len(first)} items and text_2 {len(second)}: give one text_1 item "
                "(1-to-N) or as many as text_2 (N-to-N)",
                "text_1",
            )
        self._check_count(len(second), "text_2")
        scores, num_tokens = await self._score_pairs(
            list(zip(first, second, strict=True)), req.truncate_prompt_tokens, req.activation
        )
        data = [p.ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)]
        usage = p.UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens)
        return p.ScoreResponse(model=model, data=data, usage=usage)

    async def rerank(self, req: p.RerankRequest) -> p.RerankResponse:
        model = self.model_name(req.model)
        if not isinstance(req.query, str) or not req.query:
            raise ApiError(400, f"query must be a non-empty string, got {req.query!r:.40}", "query")
        documents = parse_texts(req.documents, "documents", allow_single=False)
        self._check_count(len(documents), "documents")
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
            scores = [float(o.outputs.data.reshape(-1)[0]) for o in outputs]
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
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each distinct text once
        slot = {text: i for i, text in enumerate(texts)}
        params = self._params(param, task="embed", truncate_prompt_tokens=truncate_prompt_tokens)
        try:
            outputs = await self.engine.encode(texts, [params] * len(texts))
        except BatchInputError as e:
            first = e.errors[0]
            raise ApiError(400, f"{texts[first.index]!r:.60}: {first.message}", param) from e
        embeddings = torch.stack([o.outputs.data for o in outputs])
        left = embeddings[[slot[a] for a, _ in pairs]]
        right = embeddings[[slot[b] for _, b in pairs]]
        scores = F.cosine_similarity(left, right, dim=-1).tolist()
        scores = [s if math.isfinite(s) else 0.0 for s in scores]
        return scores, sum(len(o.prompt_token_ids) for o in outputs)

    async def render_chat(
        self,
        messages: list[Any],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Chat messages → the prompt text, by the tokenizer's chat template (or `chat_template`)."""
        messages = check_messages(messages)
        tokenizer = self.engine.tokenizer
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ApiError(
                400,
                "The model's tokenizer has no chat template, so the messages cannot be turned "
                "into a prompt: pass a Jinja template as `chat_template` in the request, or send "
                "a prompt instead",
                "messages",
            )

        def render() -> str:
            return tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )

        try:
            prompt = await self.engine.run_in_tokenizer(render)
        except Exception as e:  # jinja2 errors, transformers' ValueErrors, bad kwargs
            message = f"the chat template failed on these messages: {type(e).__name__}: {e}"
            raise ApiError(400, message, "messages") from e
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "the chat template rendered an empty prompt", "messages")
        return prompt

    # ------------------------------------------------------------------ tokenize

    async def tokenize(self, req: p.TokenizeRequest) -> p.TokenizeResponse:
        self.model_name(req.model)
        add_special_tokens = req.add_special_tokens
        prompt = req.prompt
        if req.messages is not None:
            prompt = await self.render_chat(req.messages)
            add_special_tokens = False  # the template writes them (as in /v1/chat/completions)
        if prompt is None:
            raise ApiError(400, "give 'prompt' (a string) or 'messages' to tokenize", "prompt")
        tokenizer = self.engine.tokenizer

        def run() -> tuple[list[int], list[str] | None]:
            ids = tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
            return ids, tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None

        ids, strs = await self.engine.run_in_tokenizer(run)
        return p.TokenizeResponse(
            count=len(ids),
            max_model_len=self.model_config.max_model_len,
            tokens=ids,
            token_strs=strs,
        )

    async def detokenize(self, req: p.DetokenizeRequest) -> p.DetokenizeResponse:
        self.model_name(req.model)
        tokenizer = self.engine.tokenizer

        def run() -> str:
            # Even len() reads the Rust tokenizer: only the tokenizer thread may touch it.
            vocab_size = len(tokenizer)
            for token in req.tokens:
                if not 0 <= token < vocab_size:
                    message = f"token id {token} is outside the vocabulary [0, {vocab_size})"
                    raise ApiError(400, message, "tokens")
            return tokenizer.decode(req.tokens)

        return p.DetokenizeResponse(prompt=await self.engine.run_in_tokenizer(run))

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


def check_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages for the template: a role each, content a string (text parts joined)."""
    if not messages:
        raise ApiError(400, "messages is an empty list: give at least one message", "messages")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] is not an object", "messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ApiError(400, f"messages[{i}] has no 'role' (a string)", "messages")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ApiError(
                        400,
                        f"messages[{i}].content has a part of type {kind!r}; only text parts "
                        "are supported",
                        "messages",
                    )
                texts.append(str(part.get("text", "")))
            content = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise ApiError(
                400,
                f"messages[{i}].content must be a string or a list of text parts",
                "messages",
            )
        checked.append({**message, "content": content})
    return checked


def _field_of(message: str, default: str) -> str:
    for name in ("dimensions", "truncate_prompt_tokens", "task"):
        if name in message:
            return name
    return default
