"""The engine's multi-modal contract without a model: prompt dicts, features, the runner's
encoder cache and scatter (worker/multimodal.py), and the prefix cache's keys for images."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tidepool.engine.prompt_dicts import ParsedPrompt, parse_prompt
from tidepool.kv_cache.hashing import update_block_hashes
from tidepool.multimodal.features import MultiModalFeature, image_hash
from tidepool.params import PoolingParams
from tidepool.request import Request
from tidepool.worker.multimodal import MultiModalRunner

HIDDEN = 4


def _image(seed: int, size=(8, 6)) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3)).astype("uint8")
    return Image.fromarray(pixels, "RGB")


def _feature(offset: int, length: int, value: float, identifier: str = "a") -> MultiModalFeature:
    rows = torch.full((length, HIDDEN), value) + torch.arange(length)[:, None]
    return MultiModalFeature("image", {"rows": rows}, identifier, offset, length)


class FakeVLM:
    """embed_multimodal returns each item's `rows`; text embeddings are the ids, broadcast."""

    supported_modalities = ("image",)

    def __init__(self) -> None:
        self.calls: list[int] = []

    def embed_multimodal(self, features):
        self.calls.append(len(features))
        return [f.data["rows"] for f in features]

    def embed_input_ids(self, input_ids):
        return input_ids.float()[:, None].repeat(1, HIDDEN)


def _runner() -> tuple[MultiModalRunner, FakeVLM]:
    model = FakeVLM()
    runner = MultiModalRunner.for_model(model, pooler=None)  # type: ignore[arg-type]
    assert runner is not None
    return runner, model


def _request(request_id: str, num_tokens: int, *features: MultiModalFeature) -> Request:
    return Request(
        request_id, list(range(100, 100 + num_tokens)), PoolingParams(), mm_features=features
    )


def test_chunked_prompt_encodes_each_image_once_and_scatters_its_rows():
    """Two requests; one image split over two steps. Every placeholder gets its row, every other
    token keeps its text embedding, the cache empties once the placeholders are computed."""
    runner, model = _runner()
    a = _request("a", 12, _feature(2, 6, 10.0), _feature(9, 2, 50.0, "b"))
    b = _request("b", 5, _feature(0, 3, 70.0, "c"))
    # step 1: a's tokens [0, 5) and b's whole prompt; step 2: a's [5, 12)
    embeds = runner.inputs_embeds(torch.arange(10), [a, b], [0, 0], [5, 5])
    assert model.calls == [2]  # a's first image and b's, in one call; a's second is not reached
    assert embeds is not None
    expected = torch.arange(10).float()[:, None].repeat(1, HIDDEN)
    expected[2:5] = a.mm_features[0].data["rows"][:3]
    expected[5:8] = b.mm_features[0].data["rows"]
    torch.testing.assert_close(embeds, expected, rtol=0, atol=0)
    assert set(runner.cache) == {"a"}  # b's image is done; a's first is half computed
    embeds = runner.inputs_embeds(torch.arange(7), [a], [5], [7])
    assert model.calls == [2, 1]  # only a's second image is new
    expected = torch.arange(7).float()[:, None].repeat(1, HIDDEN)
    expected[0:3] = a.mm_features[0].data["rows"][3:]
    expected[4:6] = a.mm_features[1].data["rows"]
    torch.testing.assert_close(embeds, expected, rtol=0, atol=0)
    assert runner.cache == {} and runner.num_encoded == 3


def test_steps_without_placeholders_leave_the_embeddings_to_the_model():
    runner, model = _runner()
    a = _request("a", 12, _feature(6, 4, 1.0))
    assert runner.inputs_embeds(torch.arange(6), [a], [0], [6]) is None
    assert model.calls == []
    runner.inputs_embeds(torch.arange(2), [a], [6], [2])
    runner.free({"a"})  # aborted mid-image
    assert runner.cache == {}


def test_wrong_row_count_from_the_model_is_an_error():
    runner, model = _runner()
    bad = MultiModalFeature("image", {"rows": torch.zeros(3, HIDDEN)}, "x", 0, 4)
    with pytest.raises(ValueError, match="returned 3 rows for an item of 4 placeholders"):
        runner.inputs_embeds(torch.arange(4), [_request("a", 4, bad)], [0], [4])


def test_prefix_cache_keys_include_the_image():
    """Same placeholder ids, different images: the blocks holding placeholders hash apart,
    the block before them does not; the same image hashes the same."""
    block = 4
    one = _request("1", 12, _feature(5, 4, 0.0, "img-1"))
    two = _request("2", 12, _feature(5, 4, 0.0, "img-2"))
    same = _request("3", 12, _feature(5, 4, 0.0, "img-1"))
    h1, h2, h3 = (update_block_hashes(r, block) for r in (one, two, same))
    assert h1[0] == h2[0] and h1[1] != h2[1] and h1[2] != h2[2]
    assert h1 == h3


def test_image_identifier_is_the_pixels_and_the_settings():
    assert image_hash(_image(0), "s") == image_hash(_image(0), "s")
    assert image_hash(_image(0), "s") != image_hash(_image(1), "s")
    assert image_hash(_image(0), "s") != image_hash(_image(0), "t")
    assert image_hash(_image(0), "s") != image_hash(_image(0).convert("RGBA"), "s")


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ({"prompt": "", "multi_modal_data": {"audio": 1}}, r"'audio' not supported: this model"),
        ({"prompt": "", "multi_modal_data": {"imag": 1}}, r"'imag' not supported: tidepool knows"),
        ({"prompt": "", "multi_modal_data": {"image": b"png"}}, r"must hold PIL images.*bytes"),
        ({"prompt": "", "multi_modal_data": {"image": []}}, r"is an empty list"),
        ({"prompt": "", "multi_modal_data": [1]}, r"multi_modal_data must be a dict"),
        ({"prompt_token_ids": [1], "multi_modal_data": {"image": _image(0)}}, r"needs a text"),
        ({"prompt": "x", "mm_processor_kwargs": {"a": 1}}, r"mm_processor_kwargs is not"),
    ],
)
def test_multi_modal_data_is_checked(prompt, message):
    import re

    problem = parse_prompt(prompt, 1000, ("image",))
    assert isinstance(problem, str) and re.search(message, problem), problem


def test_multi_modal_data_is_read_for_a_model_that_takes_images_only():
    image = _image(0)
    parsed = parse_prompt({"prompt": "", "multi_modal_data": {"image": image}}, 1000, ("image",))
    assert isinstance(parsed, ParsedPrompt) and parsed.mm_data == {"image": [image]}
    assert parsed.text == ""
    refused = parse_prompt({"prompt": "", "multi_modal_data": {"image": image}}, 1000)
    assert isinstance(refused, str) and "this model takes text and token ids only" in refused
