"""Siglip2Model natively (models/siglip2.py: SigLIP's text tower beside the NaFlex vision tower),
float32 on CPU.

References, on the same tiny random weights (tests/multimodal_models.py build_siglip2: 8 px
patches, at most 16 per image at its own aspect ratio from a 4 x 4 position grid, texts padded
to 64): transformers' Siglip2Model.get_image_features on the PIL NaFlex processor's
pixel_values / pixel_attention_mask / spatial_shapes, and get_text_features on the tokenizer's
output with Siglip2Processor's text settings (padding="max_length", max_length 64, truncation).
The processors are called directly: Siglip2Processor's own images_kwargs defaults (patch 16,
256 patches) are a real checkpoint's, not the tiny model's.

Tolerances: as tests/models/test_siglip.py (depth = layers + 2, the patch GEMM's 192 terms the
longest reduction; the image-text cosine matrix within 1e-4).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from multimodal_models import (
    CLIP_VISION,
    SIGLIP2_TEXT_LEN,
    SIGLIP_TEXT,
    build_siglip2,
    make_images,
)
from tolerances import assert_close, assert_cosine_close

from tidepool import LLM, PoolingParams

RAW = PoolingParams(use_activation=False)
TEXTS = ["a photo of a cat", "hi", "the capital of france", "a"]
DEPTH = SIGLIP_TEXT["num_hidden_layers"] + 2
REDUCTION = 3 * CLIP_VISION["patch_size"] ** 2


def _image_prompt(image):
    return {"prompt": "", "multi_modal_data": {"image": image}}


def _embed(llm, prompts, params=RAW):
    outs = llm.embed(prompts, pooling_params=params, use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outs])


@pytest.fixture(scope="module")
def siglip2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("siglip2") / "model"
    return folder, build_siglip2(folder)


@torch.inference_mode()
def _images(folder, model, images, mask=True):
    from transformers import AutoImageProcessor

    inputs = AutoImageProcessor.from_pretrained(str(folder), backend="pil")(
        images=images, return_tensors="pt"
    )
    if not mask:  # the guard: the padded patches attended to
        inputs["pixel_attention_mask"] = torch.ones_like(inputs["pixel_attention_mask"])
    return model.get_image_features(**inputs).pooler_output, inputs["spatial_shapes"]


@torch.inference_mode()
def _texts(folder, model, texts):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    inputs = tokenizer(
        texts,
        padding="max_length",
        max_length=SIGLIP2_TEXT_LEN,
        truncation=True,
        return_tensors="pt",
    )
    return model.get_text_features(**inputs).pooler_output


def _cosine_matrix(images, texts):
    return F.normalize(images, dim=-1) @ F.normalize(texts, dim=-1).T


@pytest.mark.parametrize("backend", ["default", "sdpa"])
def test_siglip2_images_and_texts_match_transformers(siglip2, backend, monkeypatch):
    """Images of several aspect ratios (4x4, 7x2, 2x6, 3x5 patches: fewer than 16 are padded
    and masked in transformers, unpadded here) and texts in one call; each equals
    transformers'; the image-text cosine matrix within 1e-4."""
    from tidepool.attention import cpu_kernels
    from tidepool.attention.backend import BUCKETED_SDPA

    folder, model = siglip2
    if backend == "sdpa":
        monkeypatch.setenv("TIDEPOOL_CPU_ATTENTION", "sdpa")
        monkeypatch.setattr(cpu_kernels, "_state", {})
    llm = LLM(str(folder), device="cpu", dtype="float32")
    assert llm.model_config.model_impl == "native"
    if backend == "sdpa":
        assert llm.engine.model_runner.model.attention_backend is BUCKETED_SDPA
    images = make_images(6)
    outs = llm.embed([*map(_image_prompt, images), *TEXTS], pooling_params=RAW, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    ref_images, shapes = _images(folder, model, images)
    assert len({tuple(s) for s in shapes.tolist()}) >= 4  # several aspect ratios
    # One placeholder per real patch.
    assert [len(o.prompt_token_ids) for o in outs[:6]] == shapes.prod(-1).tolist()
    expected = torch.cat([ref_images, _texts(folder, model, TEXTS)])
    assert F.cosine_similarity(got, expected, dim=-1).min() >= 0.9999
    assert_cosine_close(got, expected, depth=DEPTH, reduction=REDUCTION)
    assert_close(got, expected, depth=DEPTH, reduction=REDUCTION)
    matrix = _cosine_matrix(got[:6], got[6:])
    assert (matrix - _cosine_matrix(expected[:6], expected[6:])).abs().max() <= 1e-4
    # Guard: attending to the padded patches moves the padded images far more than the bound.
    unmasked, _ = _images(folder, model, images, mask=False)
    error = (got - expected).abs().max()
    assert (unmasked - ref_images).abs().max() > 100 * error


def test_siglip2_batch_invariance(siglip2):
    folder, _ = siglip2
    llm = LLM(str(folder), device="cpu", dtype="float32")
    images = make_images(4, seed=5)
    mixed = [TEXTS[0], _image_prompt(images[0]), TEXTS[1], *map(_image_prompt, images[1:])]
    together = _embed(llm, mixed)
    alone = torch.cat([_embed(llm, [p]) for p in mixed])
    assert_close(alone, together, depth=DEPTH, reduction=REDUCTION)


def test_siglip2_left_padding(tmp_path):
    """Siglip2Tokenizer pads on the left. Without an attention_mask the pads lead and are
    attended; with it they are keys of no row, so tidepool leaves them out and starts the text
    at the position they pushed it to (Request.first_position): both equal to transformers on
    the processor's padded, masked ids, texts of several lengths packed in one call and alone,
    images beside them."""
    folder = tmp_path / "left"
    model = build_siglip2(folder, seed=3, padding_side="left", mask_pads=False)
    llm = LLM(str(folder), device="cpu", dtype="float32")
    assert_close(_embed(llm, TEXTS), _texts(folder, model, TEXTS), depth=DEPTH, reduction=REDUCTION)

    masked = tmp_path / "left_masked"
    model = build_siglip2(masked, seed=3, padding_side="left", mask_pads=True)
    llm = LLM(str(masked), device="cpu", dtype="float32")
    expected_texts = _texts(masked, model, TEXTS)
    assert_close(_embed(llm, TEXTS), expected_texts, depth=DEPTH, reduction=REDUCTION)
    alone = torch.cat([_embed(llm, [t]) for t in TEXTS])
    assert_close(alone, expected_texts, depth=DEPTH, reduction=REDUCTION)
    images = make_images(2, seed=1)
    expected, _ = _images(masked, model, images)
    got = _embed(llm, list(map(_image_prompt, images)) + TEXTS)
    assert_close(got[:2], expected, depth=DEPTH, reduction=REDUCTION)
    assert_close(got[2:], expected_texts, depth=DEPTH, reduction=REDUCTION)
