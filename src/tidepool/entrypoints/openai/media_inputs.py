"""Image content on the server's routes → the engine's prompts (vLLM's prompt dicts with
`multi_modal_data`), decoded off the event loop.

    /v1/embeddings, /pooling   messages whose content lists hold image parts → one prompt
    /score, /rerank            {"content": [...]} queries / documents        → a prompt each
    /v2/embed (Cohere)         images (data URLs), inputs ({"content": [...]}) → a prompt each

The parts are read by entrypoints/content_parts.py (shared with the offline LLM), the images by
multimodal/media.py under the engine's MediaConfig (the server's flags). Downloads and decoding
run on MEDIA_WORKERS threads of their own, every image of a request at once: a slow URL holds
neither the event loop nor the tokenizer's input workers. Every refusal is a 400 naming the
place of the part ("documents[2].content[0]: ..."); a model that takes no images answers a 400
naming the model and the first image part, before any image is fetched.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tidepool.entrypoints.content_parts import (
    Content,
    ContentError,
    check_takes_images,
    is_content_item,
    multimodal_prompt,
    parse_content,
    split_score_side,
)
from tidepool.entrypoints.openai.errors import ApiError
from tidepool.entrypoints.openai.inputs import (
    BuiltPrompts,
    check_request_chat_template,
    check_strings,
    check_text,
    parse_texts,
    type_name,
)
from tidepool.multimodal.media import MediaError, load_image

MEDIA_WORKERS = 8
"""Images fetched and decoded at once, all requests together."""
BASIC_CHAT_TEMPLATE = "{%- for message in messages -%}{{- message['content'] -}}{%- endfor -%}"
"""vLLM's fallback for image models without a chat template (CLIP, SigLIP, ColPali): the
messages' contents, back to back."""
_PARTS_TEMPLATE = re.compile(r"""['"]image['"]""")

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _media_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MEDIA_WORKERS, thread_name_prefix="tidepool-media")
        return _pool


def _bad(error: ValueError, param: str) -> ApiError:
    return ApiError(400, str(error), param)


async def decode_contents(serving: Any, contents: Sequence[Content], param: str) -> list[list[Any]]:
    """Each content's images decoded on the media threads, all at once (400 on the first
    refusal, in the order of the parts)."""
    config = serving.engine.config.media
    loop = asyncio.get_running_loop()
    futures = [
        [
            loop.run_in_executor(_media_pool(), load_image, source, config, place)
            for source, place in zip(c.images, c.image_places, strict=True)
        ]
        for c in contents
    ]
    flat = [f for group in futures for f in group]
    results = await asyncio.gather(*flat, return_exceptions=True)
    for result in results:
        if isinstance(result, MediaError):
            raise _bad(result, param)
        if isinstance(result, BaseException):
            raise result
    images = iter(results)
    return [[next(images) for _ in group] for group in futures]


def _check_model(
    serving: Any, req_model: str | None, contents: Sequence[Content], param: str
) -> None:
    places = [place for c in contents for place in c.image_places]
    if places:
        try:
            check_takes_images(serving.model_config, serving.model_name(req_model), places[0])
        except ContentError as e:
            raise _bad(e, param) from e


# ---------------------------------------------------------------------- messages


def _template_content(parts: list[dict[str, Any]], as_parts: bool) -> Any:
    """A content list as the chat template reads it: the text parts joined (vLLM's "string"
    format), or for a template that renders image parts itself, the parts with each image
    as {"type": "image"} (transformers' form)."""
    if not as_parts:
        return "\n".join(p["text"] for p in parts if p.get("type") in ("text", "input_text"))
    return [
        {"type": "text", "text": p["text"]}
        if p.get("type") in ("text", "input_text")
        else {"type": "image"}
        for p in parts
    ]


def _chat_template(serving: Any, req: Any) -> str:
    template = req.chat_template or (req.chat_template_kwargs or {}).get("chat_template")
    return (
        template
        or getattr(serving.engine.tokenizer, "chat_template", None)
        or (BASIC_CHAT_TEMPLATE)
    )


async def image_messages_prompts(serving: Any, req: Any) -> tuple[list[Any], str]:
    """`messages` with image parts → one prompt dict: the messages rendered with the chat
    template (the request's, the model's, else vLLM's basic one) and their images in order."""
    if req.add_special_tokens is False:
        raise ApiError(
            400,
            "add_special_tokens=false is not supported with image parts: the model's processor "
            "tokenizes the rendered prompt with its own special tokens",
            "add_special_tokens",
        )
    trusted = serving.limits.trust_request_chat_template
    check_request_chat_template(req.chat_template, req.chat_template_kwargs, trusted)
    template = _chat_template(serving, req)
    as_parts = _PARTS_TEMPLATE.search(template) is not None
    messages, contents = [], []
    for i, message in enumerate(req.messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] is not an object", "messages")
        check_strings(message, f"messages[{i}]", "messages")
        content = message.get("content")
        if isinstance(content, list):
            try:
                contents.append(parse_content(content, f"messages[{i}].content"))
            except ContentError as e:
                raise _bad(e, "messages") from e
            message = {**message, "content": _template_content(content, as_parts)}
        messages.append(message)
    _check_model(serving, req.model, contents, "messages")
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k != "chat_template"}
    rendered = await serving.engine.run_in_tokenizer(
        _render, serving.engine.tokenizer, messages, template, req, kwargs
    )
    images = [
        image for group in await decode_contents(serving, contents, "messages") for image in group
    ]
    return BuiltPrompts([multimodal_prompt(rendered, images)]), "messages"


def _render(
    tokenizer: Any, messages: list[Any], template: str, req: Any, kwargs: dict[str, Any]
) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            chat_template=template,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            **kwargs,
        )
    except Exception as e:  # jinja errors, message shapes the template cannot read
        raise ApiError(400, f"messages could not be rendered: {e}", "messages") from e


# ---------------------------------------------------------------------- score / rerank


async def score_side(
    serving: Any, value: Any, param: str, req_model: str | None, allow_single: bool = True
) -> list[Any]:
    """One side of /score or /rerank: strings (parse_texts' rules), or vLLM's multimodal items
    ({"content": [...]}: one input each; a single such object: one input per part) → strings
    and prompt dicts."""
    value = split_score_side(value)
    if not (isinstance(value, list) and any(is_content_item(v) for v in value)):
        return parse_texts(value, param, allow_single)
    items: list[Any] = []
    contents: list[tuple[int, Content]] = []
    for i, item in enumerate(value):
        place = f"{param}[{i}]"
        if is_content_item(item):
            try:
                contents.append((i, parse_content(item["content"], f"{place}.content")))
            except ContentError as e:
                raise _bad(e, param) from e
            items.append(None)
        elif isinstance(item, str) and item:
            items.append(check_text(item, place, param))
        else:
            kind = "an empty string" if item == "" else f"of type {type_name(item)}"
            raise ApiError(
                400, f"{place} is {kind}; expected a string or {{'content': [parts]}}", param
            )
    _check_model(serving, req_model, [c for _, c in contents], param)
    decoded = await decode_contents(serving, [c for _, c in contents], param)
    for (i, content), images in zip(contents, decoded, strict=True):
        items[i] = multimodal_prompt(content.text, images)
    return items


async def rerank_query(serving: Any, query: Any, req_model: str | None) -> Any:
    """/rerank's query: a non-empty string, or one {"content": [...]} item."""
    if is_content_item(query):
        return (await score_side(serving, [query], "query", req_model))[0]
    if not isinstance(query, str) or not query:
        raise ApiError(400, f"query must be a non-empty string, got {query!r:.40}", "query")
    return check_text(query, "query", "query")


def rerank_document(documents: Any, index: int, prompt: Any) -> dict[str, Any]:
    """The `document` of a /rerank result (vLLM's RerankDocument): a text document's text; an
    image document's text parts (None without) and its multi_modal part (the list of its parts
    when it has several)."""
    if isinstance(prompt, str) and not is_content_item(_item(documents, index)):
        return {"text": prompt}
    parts = _item(documents, index)["content"]
    texts = [p["text"] for p in parts if p.get("type") in ("text", "input_text")]
    images = [p for p in parts if p.get("type") not in ("text", "input_text")]
    return {
        "text": "\n".join(texts) if texts else None,
        "multi_modal": (images[0] if len(images) == 1 else images) if images else None,
    }


def _item(documents: Any, index: int) -> Any:
    documents = split_score_side(documents)
    return documents[index] if isinstance(documents, list) else documents


# ---------------------------------------------------------------------- Cohere


async def cohere_image_prompts(
    serving: Any, images: Any, inputs: Any, req_model: str | None
) -> tuple[list[Any], str]:
    """Cohere's `images` (data URLs: one image input each) or `inputs` ({"content": [...]},
    text and image parts) → prompts, and the field they came from."""
    param = "images" if images is not None else "inputs"
    value = images if images is not None else inputs
    if not isinstance(value, list) or not value:
        raise ApiError(400, f"{param} must be a non-empty list", param)
    contents = []
    for i, item in enumerate(value):
        place = f"{param}[{i}]"
        if param == "images":
            if not isinstance(item, str) or not item:
                raise ApiError(400, f"{place} must be an image data URL string", param)
            check_text(item, place, param)
            contents.append(Content((), (item,), (place,)))
            continue
        if not is_content_item(item):
            raise ApiError(400, f"{place} must be an object {{'content': [parts]}}", param)
        try:
            contents.append(parse_content(item["content"], f"{place}.content"))
        except ContentError as e:
            raise _bad(e, param) from e
    _check_model(serving, req_model, contents, param)
    decoded = await decode_contents(serving, contents, param)
    return [
        multimodal_prompt(c.text, imgs) for c, imgs in zip(contents, decoded, strict=True)
    ], param
