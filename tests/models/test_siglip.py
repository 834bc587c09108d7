"""SiglipModel / SiglipVisionModel natively (models/siglip.py, siglip_vision.py), float32 on CPU.

References, on the same tiny random weights (tests/multimodal_models.py build_siglip: 32 px
images resized without crop, 8 px patches, heads of 32 in both towers, texts padded to 16):
transformers' SiglipModel.get_text_features on SiglipProcessor(padding="max_length") output and
get_image_features on its pixel_values (pooler_output), and sentence-transformers 6's encode.

Tolerances: tests/tolerances.py with depth = layers + 2 (the embeddings or patch GEMM, and the
text head or the image pooling head) and the longest reduction the patch GEMM's 3 * 8 * 8 = 192
terms (more than the FFN's 128): rtol = 96 * 4 * sqrt(192) * 2**-24 ~ 3.2e-4 of the magnitude.
The image-text cosine matrix: each entry is a dot product of two unit vectors, so a norm-wise
relative error e in each moves it by at most ~2e; the issue's 1e-4 bound allows e ~ 5e-5, far
above float32 rounding at this depth (measured ~5e-6) and far below what a wrong row, pad mask or
position does (~1e-1, guarded below).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from multimodal_models import (
    CLIP_VISION,
    SIGLIP_TEXT,
    SIGLIP_TEXT_LEN,
    build_siglip,
    make_images,
)
from tolerances import assert_close, assert_cosine_close

from tidepool import LLM, PoolingParams

RAW = PoolingParams(use_activation=False)
TEXTS = ["a photo of a cat", "hi", "the capital of france", "a", "tokens tokens tokens"]
DEPTH = SIGLIP_TEXT["num_hidden_layers"] + 2
REDUCTION = 3 * CLIP_VISION["patch_size"] ** 2  # the patch GEMM: 192 > intermediate 128
BACKENDS = ("default", "sdpa")


def _image_prompt(image):
    return {"prompt": "", "multi_modal_data": {"image": image}}


def _embed(llm, prompts, params=RAW):
    outs = llm.embed(prompts, pooling_params=params, use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outs])


def _load(folder, backend, monkeypatch):
    """LLM on the default backend (the CPU kernel where it builds) or on bucketed SDPA."""
    from tidepool.attention import cpu_kernels
    from tidepool.attention.backend import BUCKETED_SDPA

    if backend == "sdpa":
        monkeypatch.setenv("TIDEPOOL_CPU_ATTENTION", "sdpa")
        monkeypatch.setattr(cpu_kernels, "_state", {})  # the kernel's availability is cached
    llm = LLM(str(folder), device="cpu", dtype="float32")
    assert llm.model_config.model_impl == "native"
    if backend == "sdpa":
        assert llm.engine.model_runner.model.attention_backend is BUCKETED_SDPA
    return llm


@pytest.fixture(scope="module")
def siglip(tmp_path_factory):
    folder = tmp_path_factory.mktemp("siglip") / "model"
    return folder, build_siglip(folder)


@torch.inference_mode()
def _transformers(folder, model, images, texts, mask=True):
    """get_image_features / get_text_features on SiglipProcessor's tensors (padding="max_length");
    mask=False drops the processor's attention_mask (for the guard)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(folder), backend="pil")
    inputs = processor(text=texts, padding="max_length", return_tensors="pt")
    assert inputs["input_ids"].shape == (len(texts), SIGLIP_TEXT_LEN)
    if not mask:
        inputs.pop("attention_mask", None)
    text_rows = model.get_text_features(**inputs).pooler_output
    if not images:
        return None, text_rows
    image_rows = model.get_image_features(**processor(images=images, return_tensors="pt"))
    return image_rows.pooler_output, text_rows


def _cosine_matrix(images, texts):
    return F.normalize(images, dim=-1) @ F.normalize(texts, dim=-1).T


@pytest.mark.parametrize("backend", BACKENDS)
def test_siglip_images_and_texts_match_transformers(siglip, backend, monkeypatch, report_tolerance):
    """One call mixing images and texts: each equals transformers' features; the image-text
    cosine matrix within 1e-4. The tokenizer returns an attention_mask: the pads are no keys."""
    folder, model = siglip
    llm = _load(folder, backend, monkeypatch)
    images = make_images(6)
    got = _embed(llm, [*map(_image_prompt, images), *TEXTS])
    ref_images, ref_texts = _transformers(folder, model, images, TEXTS)
    expected = torch.cat([ref_images, ref_texts])
    assert got.shape == expected.shape == (len(images) + len(TEXTS), SIGLIP_TEXT["hidden_size"])
    report_tolerance(f"native tiny siglip images + texts ({backend})", got, expected)
    assert F.cosine_similarity(got, expected, dim=-1).min() >= 0.9999
    assert_cosine_close(got, expected, depth=DEPTH, reduction=REDUCTION)
    assert_close(got, expected, depth=DEPTH, reduction=REDUCTION)
    got_images, got_texts = got[: len(images)], got[len(images) :]
    matrix = _cosine_matrix(got_images, got_texts)
    assert (matrix - _cosine_matrix(ref_images, ref_texts)).abs().max() <= 1e-4
    # Guards: attending to the pads, or another image, moves far more than the tolerance.
    error = (got - expected).abs().max()
    _, unmasked = _transformers(folder, model, [], TEXTS, mask=False)
    assert (unmasked - ref_texts).abs().max() > 100 * error
    assert (ref_images[0] - ref_images[1]).abs().max() > 100 * error


def test_siglip_pads_attended_without_a_mask(tmp_path):
    """A tokenizer whose model_input_names has no attention_mask (the processor gives input_ids
    alone): get_text_features attends to the pads, and so does tidepool."""
    folder = tmp_path / "nomask"
    model = build_siglip(folder, seed=11, mask_pads=False)
    llm = LLM(str(folder), device="cpu", dtype="float32")
    _, expected = _transformers(folder, model, [], TEXTS)
    got = _embed(llm, TEXTS)
    assert_close(got, expected, depth=DEPTH, reduction=REDUCTION)
    assert F.cosine_similarity(got, expected, dim=-1).min() >= 0.9999


def test_siglip_texts_are_padded_to_the_fixed_length(siglip):
    """Every text runs as SiglipProcessor(padding="max_length") writes it: its ids, then </s>
    pads up to 16 (the prompt_token_ids of the output)."""
    from transformers import AutoProcessor

    folder, _ = siglip
    llm = LLM(str(folder), device="cpu", dtype="float32")
    outs = llm.embed(TEXTS, use_tqdm=False)
    processor = AutoProcessor.from_pretrained(str(folder), backend="pil")
    expected = processor(text=TEXTS, padding="max_length")["input_ids"]
    assert [list(o.prompt_token_ids) for o in outs] == expected
    assert all(len(ids) == SIGLIP_TEXT_LEN for ids in expected)
    assert expected[1][-1] == processor.tokenizer.pad_token_id  # "hi" ends in pads


def test_siglip_too_long_text_is_refused(siglip):
    """A text over the fixed length fails alone, naming the limit; the others go on. The
    processor's own refusal (a max_model_len above the fixed length) names it too."""
    from transformers import AutoTokenizer

    from tidepool.multimodal.dual_tower import FixedLengthText

    folder, _ = siglip
    llm = LLM(str(folder), device="cpu", dtype="float32")
    long_text = "tokens " * 20
    with pytest.raises(ValueError, match="maximum of 16"):
        llm.embed(["fine", long_text], use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    shaper = FixedLengthText(tokenizer, llm.model_config.hf_config.text_config, "SiglipModel")
    assert shaper.length == SIGLIP_TEXT_LEN
    with pytest.raises(ValueError, match="at most 16 tokens"):
        shaper.pad(list(range(SIGLIP_TEXT_LEN + 1)))


def test_siglip_max_model_len_below_the_fixed_length_is_refused(siglip):
    folder, _ = siglip
    with pytest.raises(ValueError, match="pads every text to 16 tokens, more than max_model_len 8"):
        LLM(str(folder), device="cpu", dtype="float32", max_model_len=8)


def test_siglip_score_is_the_cosine_of_text_and_image(siglip):
    """LLM.score(text, images): the cosine of the embeddings (as CLIP's), not SigLIP's sigmoid
    of logit_scale * cosine + logit_bias (those weights are skipped)."""
    folder, _ = siglip
    llm = LLM(str(folder), device="cpu", dtype="float32")
    images = make_images(3, seed=4)
    pages = list(map(_image_prompt, images))
    scores = torch.tensor([o.outputs.score for o in llm.score(TEXTS[0], pages, use_tqdm=False)])
    vectors = _embed(llm, [TEXTS[0], *pages], PoolingParams())
    torch.testing.assert_close(scores, vectors[1:] @ vectors[0], atol=1e-6, rtol=0)


def test_siglip_batch_invariance(siglip):
    """An image or a text alone equals itself in a mixed batch; the default normalizes."""
    folder, _ = siglip
    llm = LLM(str(folder), device="cpu", dtype="float32")
    images = make_images(4, seed=5)
    mixed = [TEXTS[0], _image_prompt(images[0]), TEXTS[1], *map(_image_prompt, images[1:])]
    mixed.append(TEXTS[3])
    together = _embed(llm, mixed)
    alone = torch.cat([_embed(llm, [p]) for p in mixed])
    assert_close(alone, together, depth=DEPTH, reduction=REDUCTION)
    normalized = _embed(llm, mixed[:2], PoolingParams())
    torch.testing.assert_close(normalized.norm(dim=-1), torch.ones(2))


def test_siglip_vision_tower_hidden_states_match_transformers(siglip):
    """The tower alone (what PaliGemma / ColPali read): encode() equals the vision model's
    last_hidden_state (after post_layernorm), pool() its pooler_output."""
    from transformers import AutoImageProcessor

    folder, model = siglip
    llm = LLM(str(folder), device="cpu", dtype="float32")
    tower = llm.engine.model_runner.model.vision_model
    processor = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    pixels = processor(images=make_images(3, seed=2), return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        ref = model.vision_model(pixel_values=pixels)
        hidden = tower.encode(pixels)
        pooled = tower.pool(hidden)
    assert hidden.shape == ref.last_hidden_state.shape == (3, 16, CLIP_VISION["hidden_size"])
    assert_close(hidden, ref.last_hidden_state, depth=DEPTH, reduction=REDUCTION)
    assert_close(pooled, ref.pooler_output, depth=DEPTH, reduction=REDUCTION)


def test_siglip_vision_model_alone(tmp_path):
    """SiglipVisionModel: its pooler_output, equal to transformers'; texts refused."""
    from transformers import AutoImageProcessor

    folder = tmp_path / "vision"
    model = build_siglip(folder, architecture="SiglipVisionModel")
    llm = LLM(str(folder), device="cpu", dtype="float32")
    images = make_images(3, seed=9)
    got = _embed(llm, list(map(_image_prompt, images)))
    processor = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    with torch.inference_mode():
        expected = model(**processor(images=images, return_tensors="pt")).pooler_output
    assert_close(got, expected, depth=DEPTH, reduction=REDUCTION)
    with pytest.raises(ValueError, match="vision tower alone"):
        llm.embed(["a text"], use_tqdm=False)
    # Checkpoints saved before transformers 5 name the tensors vision_model.*: the same vectors.
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    state = load_file(str(weights))
    assert not any(k.startswith("vision_model.") for k in state)
    save_file({f"vision_model.{k}": v for k, v in state.items()}, str(weights))
    again = LLM(str(folder), device="cpu", dtype="float32")
    torch.testing.assert_close(_embed(again, list(map(_image_prompt, images))), got)


def test_siglip_matches_sentence_transformers(siglip):
    """sentence-transformers 6 loads the folder (Transformer module, get_*_features). Its text
    default is padding=True (longest), not SigLIP's max_length: with the module's
    processing_kwargs set to max_length it equals tidepool (min cosine >= 0.9999, the cosine
    matrix within 1e-4); with its default it does not (the guard)."""
    from sentence_transformers import SentenceTransformer

    folder, _ = siglip
    llm = LLM(str(folder), device="cpu", dtype="float32")
    images = make_images(5, seed=3)
    st = SentenceTransformer(str(folder), device="cpu")
    longest = st.encode(TEXTS[1:3], convert_to_tensor=True)  # padded to 14, not 16
    st[0].processing_kwargs = {"text": {"padding": "max_length"}}
    ref_images = st.encode(images, convert_to_tensor=True)
    ref_texts = st.encode(TEXTS, convert_to_tensor=True)
    got = _embed(llm, [*map(_image_prompt, images), *TEXTS])
    got_images, got_texts = got[: len(images)], got[len(images) :]
    assert F.cosine_similarity(got, torch.cat([ref_images, ref_texts]), dim=-1).min() >= 0.9999
    matrix = _cosine_matrix(got_images, got_texts)
    assert (matrix - _cosine_matrix(ref_images, ref_texts)).abs().max() <= 1e-4
    error = (got_texts - ref_texts).abs().max()
    assert (got_texts[1:3] - longest).abs().max() > 100 * error
