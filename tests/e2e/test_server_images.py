"""Image inputs on a real server (uvicorn in a thread): every route's image parts, its 400s in
the route's own error shape, and the requests around a bad one still answered.

The engine side (multi_modal_data inside the engine, the CLIP / SigLIP models) is another part
of issue 29; here the routes are tested up to their boundary with it, vLLM's prompt dict
{"prompt": str, "multi_modal_data": {"image": PIL image | [PIL images]}}: on a text model every
image part is refused naming the model and the part, and on a stand-in that takes images (the
same tiny model with the route's model check lifted) the prompts the route hands the engine are
recorded and compared with the images sent, pixel for pixel.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image
from serverlib import ThreadedServer, start_threaded_server

NAME = "tiny-embedder"


def _png(seed: int, size: tuple[int, int] = (12, 8), mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], len(mode)), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels if len(mode) > 1 else pixels[..., 0], mode).save(buffer, "PNG")
    return buffer.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


IMAGE = _png(1)
IMAGE_URL = _data_url(IMAGE)


def _rgb(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.fixture(scope="module")
def media_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    (folder / "page.png").write_bytes(_png(2))
    return folder


@pytest.fixture(scope="module")
def engine(tiny_model_path, media_folder):
    from tidepool.engine.async_engine import AsyncEngine

    return AsyncEngine.from_args(
        str(tiny_model_path("bert")),
        device="cpu",
        dtype="float32",
        allowed_local_media_path=str(media_folder),
    )


@pytest.fixture(scope="module")
def server(engine) -> Iterator[ThreadedServer]:
    from tidepool.entrypoints.openai.server import ServerArgs, build_app

    srv = start_threaded_server(build_app(engine, ServerArgs(served_model_name=[NAME])))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        yield client


MESSAGES = [{"role": "user", "content": [_part(IMAGE_URL)]}]
ROUTES = {
    "embeddings messages": ("/v1/embeddings", {"messages": MESSAGES}, "messages[0].content[0]"),
    "pooling messages": ("/pooling", {"messages": MESSAGES}, "messages[0].content[0]"),
    "score documents": (
        "/score",
        {"queries": "a red square", "documents": [{"content": [_part(IMAGE_URL)]}]},
        "documents[0].content[0]",
    ),
    "score one content object": (
        "/score",
        {"queries": "a red square", "documents": {"content": [_part(IMAGE_URL)] * 2}},
        "documents[0].content[0]",
    ),
    "rerank documents": (
        "/rerank",
        {"query": "a red square", "documents": ["text", {"content": [_part(IMAGE_URL)]}]},
        "documents[1].content[0]",
    ),
    "rerank query": (
        "/rerank",
        {"query": {"content": [_part(IMAGE_URL)]}, "documents": ["a", "b"]},
        "query[0].content[0]",
    ),
    "cohere images": ("/v2/embed", {"images": [IMAGE_URL], "input_type": "image"}, "images[0]"),
    "cohere inputs": (
        "/v2/embed",
        {"inputs": [{"content": [{"type": "text", "text": "x"}, _part(IMAGE_URL)]}]},
        "inputs[0].content[1]",
    ),
}


def _message(answer: httpx.Response, path: str) -> str:
    body = answer.json()
    if path == "/v2/embed":  # Cohere's shape
        assert set(body) == {"message"}
        return body["message"]
    assert set(body) == {"error"} and body["error"]["code"] == answer.status_code
    assert body["error"]["type"] == "BadRequestError"
    return body["error"]["message"]


def _text_request_works(http: httpx.Client) -> None:
    answer = http.post("/v1/embeddings", json={"input": ["still fine"], "model": NAME})
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["data"][0]["embedding"]) > 0


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_text_model_refuses_image_parts(http, route: str) -> None:
    path, body, place = ROUTES[route]
    answer = http.post(path, json=body)
    assert answer.status_code == 400, answer.text
    message = _message(answer, path)
    assert f"The model `{NAME}` takes no images" in message and place in message, message
    _text_request_works(http)


# ---------------------------------------------------------------------- a stand-in image model


@pytest.fixture
def image_model(server, engine, monkeypatch) -> list[list[Any]]:
    """The route's model check lifted and the engine's encode recorded: each call's prompts
    (the dicts replaced by a text, so the tiny text model answers)."""
    from tidepool.entrypoints.openai import media_inputs

    monkeypatch.setattr(media_inputs, "check_takes_images", lambda *args: None)
    calls: list[list[Any]] = []
    real = engine.encode

    async def recorded(prompts, params):
        calls.append(list(prompts))
        texts = [p if isinstance(p, str) else (p["prompt"] or "image") for p in prompts]
        return await real(texts, params)

    monkeypatch.setattr(engine, "encode", recorded)
    return calls


def _images(prompt: Any) -> list[np.ndarray]:
    assert isinstance(prompt, dict) and set(prompt) == {"prompt", "multi_modal_data"}
    image = prompt["multi_modal_data"]["image"]
    images = image if isinstance(image, list) else [image]
    assert all(i.mode == "RGB" for i in images)
    return [np.asarray(i) for i in images]


def test_messages_become_one_prompt_dict(http, image_model) -> None:
    second = _png(3, mode="RGBA")
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "first"},
                _part(IMAGE_URL),
                {"type": "text", "text": "second"},
                _part(_data_url(second)),
            ],
        }
    ]
    for path in ("/v1/embeddings", "/pooling"):
        image_model.clear()
        answer = http.post(path, json={"messages": messages})
        assert answer.status_code == 200, answer.text
        (prompt,) = image_model[0]
        # The tiny model has no chat template: vLLM's basic one (the contents, back to back),
        # the text parts joined with a newline.
        assert prompt["prompt"] == "first\nsecond"
        got = _images(prompt)
        np.testing.assert_array_equal(got[0], _rgb(IMAGE))
        rgba = np.asarray(Image.open(io.BytesIO(second)).convert("RGBA")).astype(float)
        over_white = rgba[..., :3] * rgba[..., 3:] / 255 + 255 * (1 - rgba[..., 3:] / 255)
        np.testing.assert_allclose(got[1], over_white, atol=1)


def test_score_and_rerank_image_documents(http, image_model, media_folder) -> None:
    documents = [
        "a plain text document",
        {"content": [_part(IMAGE_URL)]},
        {"content": [_part("page.png"), {"type": "text", "text": "page two"}]},
    ]
    answer = http.post("/score", json={"queries": "query", "documents": documents})
    assert answer.status_code == 200, answer.text
    assert [d["index"] for d in answer.json()["data"]] == [0, 1, 2]
    (prompts,) = image_model
    assert prompts[:2] == ["query", "a plain text document"]
    assert prompts[2]["prompt"] == "" and prompts[3]["prompt"] == "page two"
    np.testing.assert_array_equal(_images(prompts[2])[0], _rgb(IMAGE))
    np.testing.assert_array_equal(_images(prompts[3])[0], _rgb(_png(2)))

    answer = http.post("/rerank", json={"query": "query", "documents": documents})
    assert answer.status_code == 200, answer.text
    by_index = {r["index"]: r["document"] for r in answer.json()["results"]}
    assert by_index[0] == {"text": "a plain text document"}
    assert by_index[1] == {"multi_modal": _part(IMAGE_URL)}  # vLLM's RerankDocument
    assert by_index[2] == {"text": "page two", "multi_modal": _part("page.png")}


def test_cohere_images_and_inputs(http, image_model) -> None:
    answer = http.post("/v2/embed", json={"images": [IMAGE_URL], "input_type": "image"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["images"] == [{"width": 12, "height": 8, "format": "png", "bit_depth": 8}]
    assert body["texts"] is None and len(body["embeddings"]["float"]) == 1
    np.testing.assert_array_equal(_images(image_model[0][0])[0], _rgb(IMAGE))
    inputs = [
        {"content": [{"type": "text", "text": "caption"}, _part(IMAGE_URL)]},
        {"content": [{"type": "text", "text": "only text"}]},
    ]
    answer = http.post("/v2/embed", json={"inputs": inputs})
    assert answer.status_code == 200, answer.text
    assert image_model[1][0]["prompt"] == "caption" and image_model[1][1] == "only text"


BAD_IMAGES = {
    "undecodable": (_data_url(b"not an image"), "could not be decoded"),
    "not base64": ("data:image/png;base64,@@@", "not valid base64"),
    "http not allowed": ("http://example.com/cat.png", "--allowed-media-domains"),
    "outside the folder": ("/etc/passwd", "outside the allowed folder"),
    "20000 x 20000": (None, "too large"),
    "video part": (None, "'video_url' part is not supported"),
}


def _bad_part(case: str) -> dict[str, Any]:
    url, _ = BAD_IMAGES[case]
    if case == "video part":
        return {"type": "video_url", "video_url": {"url": "x"}}
    if case == "20000 x 20000":
        import struct
        import zlib

        def chunk(kind: bytes, body: bytes) -> bytes:
            crc = zlib.crc32(kind + body) & 0xFFFFFFFF
            return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

        ihdr = struct.pack(">IIBBBBB", 20_000, 20_000, 8, 2, 0, 0, 0)
        url = _data_url(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))
    return _part(url)


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_bad_images_answer_400_on_every_route(http, image_model, case: str) -> None:
    part, word = _bad_part(case), BAD_IMAGES[case][1]
    bodies = {
        "/v1/embeddings": {"messages": [{"role": "user", "content": [part]}]},
        "/score": {"queries": "q", "documents": [{"content": [part]}]},
        "/rerank": {"query": "q", "documents": [{"content": [part]}]},
        "/v2/embed": {"inputs": [{"content": [part]}]},
    }
    for path, body in bodies.items():
        answer = http.post(path, json=body)
        assert answer.status_code == 400, answer.text
        message = _message(answer, path)
        assert word in message, message
    assert image_model == []  # nothing reached the engine
    _text_request_works(http)


def test_add_special_tokens_false_with_images_is_refused(http, image_model) -> None:
    body = {"messages": MESSAGES, "add_special_tokens": False}
    answer = http.post("/v1/embeddings", json=body)
    assert answer.status_code == 400 and "add_special_tokens" in _message(answer, "/v1/embeddings")
