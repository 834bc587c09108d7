"""Content parts (chat messages' `content` lists, vLLM's score / rerank `{"content": [...]}`
items, Cohere's `inputs`) → the prompts the engine takes: a string, or vLLM's multimodal prompt
dict `{"prompt": str, "multi_modal_data": {"image": PIL image | [PIL images]}}`.

    {"type": "text", "text": "a cat"}                       a text part
    {"type": "image_url", "image_url": {"url": URL}}          an image (OpenAI's, vLLM's)
    {"type": "input_image", "image_url": URL}                 an image (OpenAI Responses' form)
    {"type": "image_pil", "image_pil": PIL.Image}             an image (offline only, vLLM's)

URL: a data: URL, an http(s) URL or a local file, as multimodal/media.py allows them. Other part
types (audio, video, image embeddings, files) are refused by name. Shared by the offline LLM
(llm.py: score's image documents) and the server (openai/media_inputs.py), so both read the
same parts the same way; shapes are checked here (ContentError), images decoded by media.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tidepool.config import MediaConfig, ModelConfig
from tidepool.multimodal.media import is_pil_image, load_image
from tidepool.multimodal.processing import takes_images as architecture_takes_images

IMAGE_PART_TYPES = ("image_url", "input_image", "image_pil")
_REFUSED_TYPES = {
    "image_embeds": "image embeddings are not taken; send the image itself",
    "audio_url": "tidepool takes text and image parts",
    "input_audio": "tidepool takes text and image parts",
    "video_url": "tidepool takes text and image parts",
    "file": "tidepool takes text and image parts",
}
_DETAILS = (None, "auto")
"""OpenAI's image_url.detail: a hint for its own models; vLLM ignores it, and so do the models
here, so only its default is taken."""


class ContentError(ValueError):
    """A content part of the wrong shape; the message names where it is."""


@dataclass(frozen=True)
class Content:
    """One message's or one document's parts, checked (images not yet decoded)."""

    texts: tuple[str, ...]
    images: tuple[Any, ...]
    """Each image's source: a URL / path string, or a PIL image (image_pil)."""
    image_places: tuple[str, ...]
    """Where each image part is ("documents[2].content[0]"), for error messages."""

    @property
    def text(self) -> str:
        """The text parts joined with a newline (vLLM's "string" content format)."""
        return "\n".join(self.texts)


def parse_content(parts: Any, where: str, *, offline: bool = False) -> Content:
    """A content list's text and image parts, in order (ContentError for a bad shape)."""
    if not isinstance(parts, list) or not parts:
        raise ContentError(f"{where} must be a non-empty list of content parts")
    texts: list[str] = []
    images: list[Any] = []
    places: list[str] = []
    for i, part in enumerate(parts):
        place = f"{where}[{i}]"
        if not isinstance(part, dict):
            raise ContentError(f"{place} must be an object with a 'type', got {part!r:.40}")
        kind = part.get("type")
        if kind in ("text", "input_text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise ContentError(f"{place} is a text part without a string 'text'")
            texts.append(text)
        elif kind in IMAGE_PART_TYPES:
            images.append(_image_source(part, kind, place, offline))
            places.append(place)
        elif kind in _REFUSED_TYPES:
            raise ContentError(f"{place}: a {kind!r} part is not supported: {_REFUSED_TYPES[kind]}")
        else:
            raise ContentError(
                f"{place} has the type {kind!r}; expected one of text, "
                + ", ".join(IMAGE_PART_TYPES[: 3 if offline else 2])
            )
    return Content(tuple(texts), tuple(images), tuple(places))


def _image_source(part: dict[str, Any], kind: str, place: str, offline: bool) -> Any:
    if part.get("uuid") is not None:
        raise ContentError(f"{place}: uuid is not supported (images are told apart by content)")
    if kind == "image_pil":
        image = part.get("image_pil")
        if not offline or not is_pil_image(image):
            where = "a PIL image" if offline else "offline only (LLM), a PIL image"
            raise ContentError(f"{place}: an image_pil part takes {where}")
        return image
    value = part.get("image_url")
    if kind == "image_url":
        if not isinstance(value, dict) or not isinstance(value.get("url"), str):
            raise ContentError(
                f"{place}: an image_url part is {{'type': 'image_url', 'image_url': {{'url': "
                "URL}}}} (a data:, http(s) or file URL)"
            )
        if value.get("detail") not in _DETAILS:
            raise ContentError(
                f"{place}: image_url.detail={value.get('detail')!r} is not supported (only "
                "'auto': the models here read the image at their processor's size)"
            )
        return value["url"]
    if not isinstance(value, str):
        raise ContentError(f"{place}: an input_image part takes image_url as a URL string")
    return value


def is_content_item(value: Any) -> bool:
    """A score / rerank / Cohere input given as {"content": [...]} rather than a string."""
    return isinstance(value, dict) and "content" in value


def has_non_text_parts(messages: Any) -> bool:
    """Whether any message's content list holds a part other than text (an image, or a part
    to refuse by name); their shapes are checked later."""
    if not isinstance(messages, list):
        return False
    return any(
        isinstance(m, dict)
        and isinstance(m.get("content"), list)
        and any(
            not isinstance(p, dict) or p.get("type") not in ("text", "input_text")
            for p in m["content"]
        )
        for m in messages
    )


# ---------------------------------------------------------------------- the model


def takes_images(model_config: ModelConfig) -> bool:
    """The model's architecture has an image prompt processor (multimodal/processing.py)."""
    return architecture_takes_images(model_config.architecture)


def check_takes_images(model_config: ModelConfig, model_name: str, place: str) -> None:
    """ContentError naming the model and the first image part when the model takes no images."""
    if not takes_images(model_config):
        raise ContentError(
            f"The model `{model_name}` takes no images ({model_config.architecture} is a text "
            f"model): {place} is an image part"
        )


# ---------------------------------------------------------------------- prompts


def multimodal_prompt(text: str, images: Sequence[Any]) -> str | dict[str, Any]:
    """A text alone; else vLLM's prompt dict (one image, or a list of several)."""
    if not images:
        return text
    image: Any = images[0] if len(images) == 1 else list(images)
    return {"prompt": text, "multi_modal_data": {"image": image}}


def load_content_images(content: Content, config: MediaConfig) -> list[Any]:
    """Each image of `content` decoded (MediaError naming its place)."""
    return [
        load_image(source, config, what=place)
        for source, place in zip(content.images, content.image_places, strict=True)
    ]


def content_prompt(content: Content, config: MediaConfig) -> str | dict[str, Any]:
    return multimodal_prompt(content.text, load_content_images(content, config))


def split_score_side(value: Any) -> Any:
    """vLLM's rule for one side of score / rerank given as a single {"content": [...]}: each of
    its parts is an input of its own (1-to-N stays 1-to-N); anything else as given."""
    if is_content_item(value) and isinstance(value["content"], list):
        return [{"content": [part]} for part in value["content"]]
    return value


def score_inputs(
    values: list[Any],
    where: str,
    model_config: ModelConfig,
    model_name: str,
    config: MediaConfig,
) -> list[Any]:
    """LLM.score's sides (a list, after split_score_side): strings (and prompt dicts) as given;
    each {"content": [...]} item a string or a multimodal prompt dict (ValueError:
    ContentError / MediaError)."""
    out = []
    for i, value in enumerate(values):
        if not is_content_item(value):
            out.append(value)
            continue
        content = parse_content(value["content"], f"{where}[{i}].content", offline=True)
        if content.images:
            check_takes_images(model_config, model_name, content.image_places[0])
        out.append(content_prompt(content, config))
    return out
