"""entrypoints/content_parts.py: content parts → prompts, as the offline LLM and the server read
them (vLLM's shapes); every bad shape refused naming its place."""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from tidepool.config import MediaConfig
from tidepool.entrypoints.content_parts import (
    ContentError,
    has_non_text_parts,
    parse_content,
    score_inputs,
    split_score_side,
)

CLIP = SimpleNamespace(architecture="CLIPModel")
BERT = SimpleNamespace(architecture="BertModel")


def _image(seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (6, 9, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def _data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ([], "non-empty list"),
        ("text", "non-empty list"),
        (["a string"], r"\[0\] must be an object"),
        ([{"type": "text"}], "without a string 'text'"),
        ([{"type": "image_url", "image_url": "data:x"}], "'image_url': {'url'"),
        ([{"type": "image_url", "image_url": {"url": "x", "detail": "high"}}], "detail='high'"),
        ([{"type": "image_url", "image_url": {"url": "x"}, "uuid": "u1"}], "uuid"),
        ([{"type": "input_image", "image_url": {"url": "x"}}], "URL string"),
        ([{"type": "video_url", "video_url": {"url": "x"}}], "'video_url' part is not supported"),
        ([{"type": "image_embeds", "image_embeds": "..."}], "image embeddings"),
        ([{"type": "picture"}], "type 'picture'; expected one of text, image_url, input_image"),
        ([{"type": "image_pil", "image_pil": "x"}], "offline only"),
    ],
)
def test_bad_parts_are_refused_by_place(parts, message: str) -> None:
    with pytest.raises(ContentError, match=message):
        parse_content(parts, "documents[3].content")


def test_parts_in_order() -> None:
    content = parse_content(
        [
            {"type": "text", "text": "a"},
            {"type": "image_url", "image_url": {"url": "u1", "detail": "auto"}},
            {"type": "input_text", "text": "b"},
            {"type": "input_image", "image_url": "u2"},
        ],
        "x",
    )
    assert content.text == "a\nb" and content.images == ("u1", "u2")
    assert content.image_places == ("x[1]", "x[3]")


def test_one_content_object_is_one_input_per_part() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert split_score_side({"content": parts}) == [{"content": [p]} for p in parts]
    assert split_score_side(["s", {"content": parts}]) == ["s", {"content": parts}]


def test_non_text_parts_are_seen() -> None:
    assert not has_non_text_parts([{"role": "user", "content": "plain"}])
    assert not has_non_text_parts([{"role": "user", "content": [{"type": "text", "text": "x"}]}])
    assert has_non_text_parts([{"role": "user", "content": [{"type": "video_url"}]}])


def test_score_inputs_build_vllm_prompt_dicts() -> None:
    pil, other = _image(1), _image(2)
    values = [
        "a text",
        {"content": [{"type": "image_pil", "image_pil": pil}]},
        {
            "content": [
                {"type": "image_url", "image_url": {"url": _data_url(other)}},
                {"type": "text", "text": "caption"},
                {"type": "image_pil", "image_pil": pil},
            ]
        },
        {"content": [{"type": "text", "text": "only text"}]},
    ]
    out = score_inputs(values, "data_2", CLIP, "clip", MediaConfig())
    assert out[0] == "a text" and out[3] == "only text"
    assert out[1] == {"prompt": "", "multi_modal_data": {"image": pil}}
    assert out[2]["prompt"] == "caption"
    decoded, same = out[2]["multi_modal_data"]["image"]
    np.testing.assert_array_equal(np.asarray(decoded), np.asarray(other))
    assert same is pil


def test_a_text_model_refuses_image_documents() -> None:
    values = [{"content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    with pytest.raises(ContentError, match=r"`bert` takes no images .*data_2\[0\]\.content\[0\]"):
        score_inputs(values, "data_2", BERT, "bert", MediaConfig())


def test_llm_score_refuses_image_documents_on_a_text_model(tiny_llm) -> None:
    llm = tiny_llm("bert")
    document = {"content": [{"type": "image_pil", "image_pil": _image()}]}
    with pytest.raises(ValueError, match=r"takes no images .*data_2\[0\]\.content\[0\]"):
        llm.score("a query", [document], use_tqdm=False)
    assert len(llm.score("a query", ["a text"], use_tqdm=False)) == 1  # the LLM goes on
