"""vLLM 0.32's pooling request fields on tidepool's routes: each one honoured or refused with a
400 naming it (never accepted and ignored).

Honoured: use_activation (and the older normalize / activation), truncation_side,
add_special_tokens (False: texts run as token ids without [CLS] / [SEP] / BOS), `messages` (the
model's chat template renders them into the prompt; image parts: openai/media_inputs.py), request_id (echoed in `id`), the "bytes"
encodings, max_tokens_per_query / max_tokens_per_doc (score, rerank), user (no effect, as in
vLLM). Refused unless unset: priority, padding "max_length",
mm_processor_kwargs, media_io_kwargs, cache_salt; on score / rerank instruction and
chat_template_kwargs.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi.responses import Response

from tidepool.engine.prompts import check_prompt_name, prompt_text
from tidepool.engine.tokenization_kwargs import without_special_tokens
from tidepool.entrypoints.content_parts import has_non_text_parts
from tidepool.entrypoints.openai import protocol as p
from tidepool.entrypoints.openai.encodings import binary_values
from tidepool.entrypoints.openai.errors import ApiError
from tidepool.entrypoints.openai.inputs import check_request_chat_template
from tidepool.entrypoints.openai.media_inputs import image_messages_prompts
from tidepool.outputs import PoolingRequestOutput

_REFUSED = (
    ("priority", (0,), "requests are served first come, first served (no priorities)"),
    ("padding", (None, "do_not_pad"), "sequences run unpadded (max_length padding is not done)"),
    ("mm_processor_kwargs", (None, {}), "per-request processor options are not implemented"),
    ("media_io_kwargs", (None, {}), "image decoding takes no options (RGB, alpha over white)"),
    ("cache_salt", (None,), "there is no per-request prefix-cache salting"),
)


def check_vllm_fields(req: Any) -> None:
    """400 naming the first vLLM field that is set and that tidepool does not implement."""
    for name, unset, reason in _REFUSED:
        if hasattr(req, name) and getattr(req, name) not in unset:
            value = getattr(req, name)
            raise ApiError(400, f"{name}={value!r} is not supported here: {reason}", name)


def use_activation_of(req: Any, *aliases: str) -> bool | None:
    """use_activation, else the first older alias given (normalize, activation); 400 when they
    disagree."""
    value = getattr(req, "use_activation", None)
    for name in aliases:
        alias = getattr(req, name, None)
        if alias is None:
            continue
        if value is not None and alias != value:
            message = f"{name}={alias} contradicts use_activation={value}: give use_activation"
            raise ApiError(400, message, name)
        value = alias
    return value


def response_id(prefix: str, req: Any) -> dict[str, Any]:
    """The response's `id` keyword: the request's request_id when it gave one."""
    rid = getattr(req, "request_id", None)
    return {"id": f"{prefix}-{rid}"} if rid else {}


def render_messages(tokenizer: Any, req: Any) -> str:
    """`messages` rendered with the request's chat template, else the model's (400 when the
    model has none, naming the way to give one)."""
    if not isinstance(req.messages, list) or not req.messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages")
    if req.add_generation_prompt and req.continue_final_message:
        raise ApiError(
            400, "give add_generation_prompt or continue_final_message, not both", "messages"
        )
    kwargs = dict(req.chat_template_kwargs or {})
    template = req.chat_template
    if template is None:  # vLLM reads a template given among the keywords too
        template = kwargs.pop("chat_template", None)
    kwargs.pop("chat_template", None)
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ApiError(
            400,
            "the model's tokenizer has no chat template: give chat_template in the request or "
            "start the server with --chat-template",
            "messages",
        )
    try:
        return tokenizer.apply_chat_template(
            req.messages,
            tokenize=False,
            chat_template=template,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            **kwargs,
        )
    except Exception as e:  # jinja errors, bad message shapes
        raise ApiError(400, f"messages could not be rendered: {e}", "messages") from e


async def prompts_value(serving: Any, req: Any) -> tuple[Any, str]:
    """The request's prompts (`input`, or `messages` rendered: one prompt) with
    add_special_tokens applied, and the field they came from."""
    engine, model_config = serving.engine, serving.model_config
    if req.messages is not None and req.input is not None:
        raise ApiError(400, "give input or messages, not both", "messages")
    if has_non_text_parts(req.messages):
        return await image_messages_prompts(serving, req)
    if req.messages is not None:
        trusted = serving.limits.trust_request_chat_template
        check_request_chat_template(req.chat_template, req.chat_template_kwargs, trusted)
        value: Any = await engine.run_in_tokenizer(render_messages, engine.tokenizer, req)
        param, default_special = "messages", False
    elif req.input is None:
        raise ApiError(422, "input: Field required (or give messages)", "input")
    else:
        value, param, default_special = req.input, "input", True
    special = default_special if req.add_special_tokens is None else req.add_special_tokens
    if special:
        return value, param
    if model_config.multi_vector is not None:
        raise ApiError(400, "add_special_tokens=false is not supported on ColBERT models", param)
    name = getattr(req, "prompt_name", None)
    try:
        check_prompt_name(model_config, name)
    except ValueError as e:
        raise ApiError(400, str(e), "prompt_name") from e
    texts = value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None
    texts = texts if texts is not None else ([value] if isinstance(value, str) else None)
    if texts is None:  # token ids: taken as given
        return value, param
    prefix = prompt_text(model_config, name)
    lower = model_config.st.do_lower_case
    prompts = await engine.run_in_tokenizer(
        without_special_tokens, engine.tokenizer, texts, prefix, lower
    )
    return [item["prompt_token_ids"] for item in prompts], param


def bytes_response(
    outputs: list[PoolingRequestOutput], req: Any, model: str, usage: p.UsageInfo, prefix: str
) -> Response:
    """vLLM's binary answer: every output's values back to back; for "bytes" a `metadata`
    header (JSON) gives each one's byte range, shape, dtype and byte order."""
    chunks, items, start = [], [], 0
    for i, o in enumerate(outputs):
        data = o.outputs.data
        if data.is_sparse:
            raise ApiError(400, "sparse outputs have no bytes encoding", "encoding_format")
        raw = binary_values(data, req.embed_dtype, None, req.endianness)
        chunks.append(raw)
        shape = list(data.shape) if req.embed_dtype not in ("binary", "ubinary") else [len(raw)]
        items.append(
            {
                "index": i,
                "embed_dtype": req.embed_dtype,
                "endianness": req.endianness,
                "start": start,
                "end": start + len(raw),
                "shape": shape,
            }
        )
        start += len(raw)
    headers = {}
    if req.encoding_format == "bytes":
        rid = getattr(req, "request_id", None) or f"{time.time_ns():x}"
        metadata = {
            "id": f"{prefix}-{rid}",
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": items,
            "usage": usage.model_dump(),
        }
        headers["metadata"] = json.dumps(metadata, separators=(",", ":"))
    return Response(b"".join(chunks), media_type="application/octet-stream", headers=headers)


def _token_limit(req: Any, name: str, max_model_len: int, *, cap: bool = False) -> int:
    """vLLM's check of max_tokens_per_query / max_tokens_per_doc: 0 = no cut, else 1 to
    max_model_len - 1. With `cap` (max_tokens_per_doc), a limit of max_model_len or more is
    no cut instead of vLLM's 400: Cohere's rerank API (same field, /v2/rerank) documents it as a
    cap with a default of 4096, which its clients send whatever the model's length
    (docs/coming_from_vllm.md lists this as deliberately more permissive)."""
    value = getattr(req, name)
    if value < 0:
        raise ApiError(400, f"{name} must be a non-negative integer, got {value}", name)
    if cap and value >= max_model_len:
        return 0
    if value >= max_model_len:
        message = f"{name} ({value}) must be less than max_model_len ({max_model_len})."
        raise ApiError(400, message, name)
    return value


def cut_to_tokens(tokenizer: Any, text: str, max_tokens: int) -> str:
    """`text` cut to its first `max_tokens` tokens (no special tokens) at a character boundary
    of the original text, as vLLM's truncate_text_to_tokens: cut between the last kept token
    and the next one, re-tokenized until it fits (a BPE merge may change at the cut)."""
    while text:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        if len(enc["input_ids"]) <= max_tokens:
            break
        end = min(offsets[max_tokens - 1][1], offsets[max_tokens][0])
        text = text[: min(end, len(text) - 1)]
    return text


async def cut_pairs(serving: Any, req: Any, pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """/score and /rerank's vLLM scoring fields: max_tokens_per_query / max_tokens_per_doc cut
    each side before the pair is read; instruction and chat_template_kwargs are refused (a score
    template's instruction is fixed when the server starts); `user` has no effect."""
    for name in ("instruction", "chat_template_kwargs"):
        if getattr(req, name, None):
            raise ApiError(
                400,
                f"{name} is not supported per request here: a score template and its "
                "instruction are set when the server starts (--score-template, "
                "--score-instruction)",
                name,
            )
    max_model_len = serving.model_config.max_model_len
    max_query = _token_limit(req, "max_tokens_per_query", max_model_len)
    max_doc = _token_limit(req, "max_tokens_per_doc", max_model_len, cap=True)
    if not max_query and not max_doc:
        return pairs
    tokenizer = serving.engine.tokenizer

    def cut() -> list[tuple[str, str]]:
        cache: dict[tuple[str, int], str] = {}

        def one(text: str, limit: int) -> str:
            if not limit or not isinstance(text, str):
                return text
            if (text, limit) not in cache:
                cache[text, limit] = cut_to_tokens(tokenizer, text, limit)
            return cache[text, limit]

        return [(one(q, max_query), one(d, max_doc)) for q, d in pairs]

    return await serving.engine.run_in_tokenizer(cut)
