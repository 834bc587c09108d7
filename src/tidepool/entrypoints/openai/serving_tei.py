"""text-embeddings-inference's native routes over the same engine as the OpenAI routes:
/embed, /embed_all, /predict always; /rerank and /tokenize (whose paths vLLM's routes use too)
only with --api-style tei. Answers are TEI's bare JSON arrays."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tidepool.entrypoints.openai import protocol_tei as pt
from tidepool.entrypoints.openai.errors import ApiError
from tidepool.entrypoints.openai.inputs import check_text, parse_prompts, parse_texts, type_name
from tidepool.entrypoints.openai.serving import OpenAIServing
from tidepool.outputs import PoolingRequestOutput

_SIDES = {"Right": "right", "Left": "left"}


def _truncation(req: pt._Truncation) -> dict[str, Any]:
    """PoolingParams fields of TEI's `truncate` (to the model's length) and its direction."""
    return {
        "truncate_prompt_tokens": -1 if req.truncate else None,
        "truncation_side": _SIDES[req.truncation_direction],
    }


def _is_pair(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)


def parse_predict_inputs(value: Any) -> tuple[list[str | tuple[str, str]], bool]:
    """TEI's `inputs` of /predict → (texts and pairs, whether it was a batch). As TEI reads it,
    a list of exactly two strings is one pair: ["q", "d"] → one prediction of the pair."""
    if isinstance(value, str) or _is_pair(value):
        items, batch = [value], False
    elif isinstance(value, list) and value:
        items, batch = value, True
    else:
        raise ApiError(
            400, f"inputs must be a text, a pair or a list of them, got {type_name(value)}"
        )
    parsed: list[str | tuple[str, str]] = []
    for i, item in enumerate(items):
        where = f"inputs[{i}]" if batch else "inputs"
        if isinstance(item, str) and item:
            parsed.append(check_text(item, where, "inputs"))
        elif _is_pair(item) and all(item):
            parsed.append(
                (check_text(item[0], where, "inputs"), check_text(item[1], where, "inputs"))
            )
        else:
            raise ApiError(400, f"{where} must be a non-empty text or a pair of texts", "inputs")
    return parsed, batch


class TeiServing:
    shared_paths = ("/rerank", "/tokenize")
    """TEI routes whose paths vLLM's routes use too: added only with --api-style tei."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.engine = serving.engine

    def _prompt(self, prompt_name: str | None) -> str:
        """The text of a sentence-transformers prompt of the model; 400 for an unknown one."""
        if prompt_name is None:
            return ""
        st = self.serving.model_config.st
        if prompt_name not in st.prompts:
            known = ", ".join(sorted(st.prompts)) or "none"
            raise ApiError(
                400, f"prompt_name {prompt_name!r} is not a prompt of the model (it has: {known})"
            )
        if st.default_prompt_name:
            if prompt_name == st.default_prompt_name:
                return ""  # the input processor adds it already
            raise ApiError(
                400, "the model has a default prompt: prompt_name cannot replace it here"
            )
        return st.prompts[prompt_name]

    async def _encode(
        self, value: Any, prompt_name: str | None, **fields: Any
    ) -> list[PoolingRequestOutput]:
        prompts = parse_prompts(value, "inputs")
        self.serving.check_count(len(prompts), "inputs")
        prompt = self._prompt(prompt_name)
        prompts = [prompt + x if isinstance(x, str) else x for x in prompts]
        params = self.serving.pooling_params("inputs", **fields)
        return await self.serving.run_batch(
            self.engine.encode(prompts, [params] * len(prompts)), "inputs"
        )

    async def embed(self, req: pt.TeiEmbedRequest) -> list[list[float]]:
        self.serving.check_task("embed", "/embed")
        outputs = await self._encode(
            req.inputs,
            req.prompt_name,
            task="embed",
            normalize=req.normalize,
            dimensions=req.dimensions,
            **_truncation(req),
        )
        return [o.outputs.data.tolist() for o in outputs]

    async def embed_all(self, req: pt.TeiEmbedAllRequest) -> list[list[list[float]]]:
        self.serving.check_task("token_embed", "/embed_all")
        outputs = await self._encode(
            req.inputs, req.prompt_name, task="token_embed", **_truncation(req)
        )
        return [o.outputs.data.tolist() for o in outputs]

    async def rerank(self, req: pt.TeiRerankRequest) -> list[dict[str, Any]]:
        if not isinstance(req.query, str) or not req.query:
            raise ApiError(400, f"query must be a non-empty string, got {type_name(req.query)}")
        check_text(req.query, "query", "query")
        texts = parse_texts(req.texts, "texts", allow_single=False)
        self.serving.check_count(len(texts), "texts")
        if req.top_n is not None and req.top_n < 0:
            raise ApiError(400, f"top_n must be >= 0 (0 = all), got {req.top_n}")
        truncation = _truncation(req)
        scores, _ = await self.serving.score_pairs(
            [(req.query, text) for text in texts],
            truncation["truncate_prompt_tokens"],
            not req.raw_scores,
            param="texts",
            truncation_side=truncation["truncation_side"],
        )
        order = sorted(range(len(texts)), key=lambda i: -scores[i])[: req.top_n or None]
        with_text = req.return_text or bool(req.return_documents)
        ranks = [
            pt.TeiRank(index=i, score=scores[i], text=texts[i] if with_text else None)
            for i in order
        ]
        return [r.model_dump(exclude_none=True) for r in ranks]

    async def predict(self, req: pt.TeiPredictRequest) -> list[Any]:
        self.serving.check_task("classify", "/predict")
        items, batch = parse_predict_inputs(req.inputs)
        self.serving.check_count(len(items), "inputs")
        params = self.serving.pooling_params(
            "inputs", task="classify", activation=not req.raw_scores, **_truncation(req)
        )
        texts = {i: item for i, item in enumerate(items) if isinstance(item, str)}
        pairs = {i: item for i, item in enumerate(items) if not isinstance(item, str)}
        outputs: dict[int, PoolingRequestOutput] = {}
        if texts:
            work = self.engine.encode(list(texts.values()), [params] * len(texts))
            outputs.update(zip(texts, await self.serving.run_batch(work, "inputs"), strict=True))
        if pairs:
            work = self.engine.encode_pairs(list(pairs.values()), [params] * len(pairs))
            outputs.update(zip(pairs, await self.serving.run_batch(work, "inputs"), strict=True))
        predictions = [self._labels(outputs[i]) for i in range(len(items))]
        return predictions if batch else predictions[0]

    def _labels(self, output: PoolingRequestOutput) -> list[dict[str, Any]]:
        """Every label with its score, the best first (TEI's order)."""
        id2label = getattr(self.serving.model_config.hf_config, "id2label", None) or {}
        scores = output.outputs.data.reshape(-1).tolist()
        labels = [id2label.get(k, id2label.get(str(k), f"LABEL_{k}")) for k in range(len(scores))]
        ranked = sorted(zip(scores, labels, strict=True), key=lambda x: -x[0])
        return [pt.TeiPrediction(score=s, label=label).model_dump() for s, label in ranked]

    async def tokenize(self, req: pt.TeiTokenizeRequest) -> list[list[dict[str, Any]]]:
        texts = parse_texts(req.inputs, "inputs")
        self.serving.check_count(len(texts), "inputs")
        prompt = self._prompt(req.prompt_name)
        texts = [prompt + t for t in texts]
        tokenizer = self.engine.tokenizer

        def run() -> list[list[dict[str, Any]]]:
            enc = tokenizer(
                texts,
                add_special_tokens=req.add_special_tokens,
                return_offsets_mapping=True,
                return_special_tokens_mask=True,
            )
            return [
                _tokens(tokenizer, text, ids, offsets, special)
                for text, ids, offsets, special in zip(
                    texts,
                    enc["input_ids"],
                    enc["offset_mapping"],
                    enc["special_tokens_mask"],
                    strict=True,
                )
            ]

        return await self.engine.run_in_tokenizer(run)


def _tokens(
    tokenizer: Any, text: str, ids: list[int], offsets: list[tuple[int, int]], special: list[int]
) -> list[dict[str, Any]]:
    strings = tokenizer.convert_ids_to_tokens(ids)
    tokens = []
    for token_id, (start, stop), is_special, string in zip(
        ids, offsets, special, strings, strict=True
    ):
        token = (
            pt.TeiToken(id=token_id, text=string, special=True, start=None, stop=None)
            if is_special
            else pt.TeiToken(
                id=token_id, text=text[start:stop], special=False, start=start, stop=stop
            )
        )
        tokens.append(token.model_dump())
    return tokens


@dataclass(frozen=True)
class TeiRoute:
    """One TEI route: its handler, its body, and the pooling task a model needs to serve it."""

    handler: Callable[[TeiServing, Any], Awaitable[Any]]
    body_type: type
    task: str | None
    """On a server of several models, TEI's requests (which name no model) go to the first
    model serving this task; None: the first model."""


TEI_ROUTES: dict[str, TeiRoute] = {
    "/embed": TeiRoute(TeiServing.embed, pt.TeiEmbedRequest, "embed"),
    "/embed_all": TeiRoute(TeiServing.embed_all, pt.TeiEmbedAllRequest, "token_embed"),
    "/predict": TeiRoute(TeiServing.predict, pt.TeiPredictRequest, "classify"),
    "/rerank": TeiRoute(TeiServing.rerank, pt.TeiRerankRequest, "score"),
    "/tokenize": TeiRoute(TeiServing.tokenize, pt.TeiTokenizeRequest, None),
}
