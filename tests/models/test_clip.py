"""CLIPModel natively (models/clip.py), float32 on CPU: images and texts into one space.

References, on the same tiny random weights (tests/multimodal_models.py: 32 px images, 8 px
patches, heads of 32 in the vision tower so that the CPU kernel runs it where it builds):
transformers' CLIPModel.get_image_features / get_text_features on the PIL processor's tensors,
and sentence-transformers 6's SentenceTransformer.encode on images and texts (its Transformer
module calls those same methods). Tolerances: tests/tolerances.py, depth = layers + embeddings
+ projection, the longest reduction the FFN's intermediate width.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from multimodal_models import CLIP_TEXT, PROJECTION_DIM, build_clip, make_images
from tolerances import assert_close, assert_cosine_close

from tidepool import LLM, PoolingParams
from tidepool.models.layers.linear import Linear

RAW = PoolingParams(normalize=False)
TEXTS = ["a photo of a cat", "hi", "The quick brown fox jumps over the lazy dog.", "a"]
DEPTH = CLIP_TEXT["num_hidden_layers"] + 2
REDUCTION = CLIP_TEXT["intermediate_size"]


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clip") / "model"
    model = build_clip(folder)
    llm = LLM(str(folder), device="cpu", dtype="float32")
    return folder, model, llm


def _image_prompt(image):
    return {"prompt": "", "multi_modal_data": {"image": image}}


def _embed(llm, prompts, params=RAW):
    outs = llm.embed(prompts, pooling_params=params, use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outs])


@torch.inference_mode()
def _transformers(folder, model, images, texts):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(folder), backend="pil")
    image_rows = model.get_image_features(**processor(images=images, return_tensors="pt"))
    text_rows = [
        model.get_text_features(**processor(text=[t], return_tensors="pt")).pooler_output
        for t in texts
    ]
    return image_rows.pooler_output, torch.cat(text_rows)


def test_clip_images_and_texts_match_transformers(clip, report_tolerance):
    """One call mixing images and texts: each equals transformers' own features."""
    folder, model, llm = clip
    assert llm.model_config.model_impl == "native"
    images = make_images(6)
    got = _embed(llm, [*map(_image_prompt, images), *TEXTS])
    ref_images, ref_texts = _transformers(folder, model, images, TEXTS)
    expected = torch.cat([ref_images, ref_texts])
    assert got.shape == expected.shape == (len(images) + len(TEXTS), PROJECTION_DIM)
    report_tolerance("native tiny clip images + texts", got, expected)
    assert_cosine_close(got, expected, depth=DEPTH, reduction=REDUCTION)
    assert_close(got, expected, depth=DEPTH, reduction=REDUCTION)
    # Guard: the images differ from one another by far more than the tolerance.
    assert (ref_images[0] - ref_images[1]).abs().max() > 100 * (got - expected).abs().max()


def test_clip_on_bucketed_sdpa_matches_transformers(clip, monkeypatch):
    """The SDPA backend lays the towers' rows out as padded buckets (its builder's LayerRows):
    texts of different lengths and images on it equal transformers too, and equal the default
    backend's vectors (the CPU kernel where it builds)."""
    from tidepool.attention import cpu_kernels
    from tidepool.attention.backend import BUCKETED_SDPA

    folder, model, default = clip
    images = make_images(3, seed=7)
    prompts = [*map(_image_prompt, images), *TEXTS]
    by_default = _embed(default, prompts)
    monkeypatch.setenv("TIDEPOOL_CPU_ATTENTION", "sdpa")
    monkeypatch.setattr(cpu_kernels, "_state", {})  # the kernel's availability is cached
    llm = LLM(str(folder), device="cpu", dtype="float32")
    assert llm.engine.model_runner.model.attention_backend is BUCKETED_SDPA
    got = _embed(llm, prompts)
    ref_images, ref_texts = _transformers(folder, model, images, TEXTS)
    expected = torch.cat([ref_images, ref_texts])
    assert_cosine_close(got, expected, depth=DEPTH, reduction=REDUCTION)
    assert_close(got, expected, depth=DEPTH, reduction=REDUCTION)
    assert_close(by_default, got, depth=DEPTH, reduction=REDUCTION)


def test_clip_matches_sentence_transformers(clip, tmp_path):
    """sentence-transformers 6 loads the plain folder (Transformer module, get_*_features) and
    the folder it saves (modules.json): min cosine >= 0.9999, the image-text cosine matrix
    within 1e-4, and tidepool loads the saved folder to the same vectors."""
    from sentence_transformers import SentenceTransformer

    folder, _, llm = clip
    images = make_images(5, seed=3)
    st = SentenceTransformer(str(folder), device="cpu")
    ref_images = st.encode(images, convert_to_tensor=True)
    ref_texts = st.encode(TEXTS, convert_to_tensor=True)
    got = _embed(llm, [*map(_image_prompt, images), *TEXTS])
    got_images, got_texts = got[: len(images)], got[len(images) :]
    cos = F.cosine_similarity(got, torch.cat([ref_images, ref_texts]), dim=-1)
    assert cos.min() >= 0.9999
    matrix = F.normalize(got_images, dim=-1) @ F.normalize(got_texts, dim=-1).T
    ref_matrix = F.normalize(ref_images, dim=-1) @ F.normalize(ref_texts, dim=-1).T
    assert (matrix - ref_matrix).abs().max() <= 1e-4
    saved = tmp_path / "st"
    st.save(str(saved))
    again = LLM(str(saved), device="cpu", dtype="float32")
    assert_close(
        _embed(again, [*map(_image_prompt, images), *TEXTS]),
        got,
        depth=DEPTH,
        reduction=REDUCTION,
    )


def test_clip_batch_invariance(clip):
    """An image or a text alone equals itself in a mixed batch; the default normalizes."""
    _, _, llm = clip
    images = make_images(4, seed=5)
    mixed = [TEXTS[0], _image_prompt(images[0]), TEXTS[1], *map(_image_prompt, images[1:])]
    together = _embed(llm, mixed)
    alone = torch.cat([_embed(llm, [p]) for p in mixed])
    assert_close(alone, together, depth=DEPTH, reduction=REDUCTION)
    normalized = _embed(llm, mixed[:2], PoolingParams())
    torch.testing.assert_close(normalized.norm(dim=-1), torch.ones(2))


def test_clip_bad_image_prompts_fail_alone(clip):
    """Text with an image, two images, an image for token_embed, bytes instead of PIL, an audio
    key: each that prompt's error, naming it; the good prompts of the batch go on."""
    _, _, llm = clip
    image = make_images(1)[0]
    bad = [
        ({"prompt": "a cat", "multi_modal_data": {"image": image}}, "embeds an image alone"),
        ({"prompt": "", "multi_modal_data": {"image": [image, image]}}, "one image per prompt"),
        ({"prompt": "", "multi_modal_data": {"image": b"\x89PNG"}}, "must hold PIL images"),
        ({"prompt": "", "multi_modal_data": {"audio": image}}, "'audio' not supported"),
    ]
    for prompt, message in bad:
        with pytest.raises(ValueError, match=message):
            llm.embed(["fine", prompt], use_tqdm=False)
    with pytest.raises(ValueError, match="one embedding"):
        llm.encode([_image_prompt(image)], pooling_task="token_embed", use_tqdm=False)


def test_clip_vision_tower_alone(tmp_path):
    """CLIPVisionModelWithProjection: image_embeds, equal to transformers'; texts refused."""
    from transformers import AutoImageProcessor

    folder = tmp_path / "vision"
    model = build_clip(folder, architecture="CLIPVisionModelWithProjection")
    llm = LLM(str(folder), device="cpu", dtype="float32")
    images = make_images(3, seed=9)
    got = _embed(llm, list(map(_image_prompt, images)))
    processor = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    with torch.inference_mode():
        expected = model(**processor(images=images, return_tensors="pt")).image_embeds
    assert_close(got, expected, depth=DEPTH, reduction=REDUCTION)
    with pytest.raises(ValueError, match="vision tower alone"):
        llm.embed(["a text"], use_tqdm=False)


def test_clip_by_hub_id_embeds_images(clip, fake_hub):
    """A Hub id downloads the image processor's config with the weights (a snapshot without it
    could not take an image): images by id equal the local folder's."""
    from hub_server import folder_files

    folder, _, llm = clip
    fake_hub.hub.add("org/tiny-clip", folder_files(folder))
    images = make_images(2)
    by_id = LLM("org/tiny-clip", device="cpu", dtype="float32")
    got = _embed(by_id, [_image_prompt(im) for im in images])
    torch.testing.assert_close(
        got, _embed(llm, [_image_prompt(im) for im in images]), rtol=0, atol=0
    )
    assert "preprocessor_config.json" in fake_hub.hub.fetched("org/tiny-clip")


@pytest.mark.parametrize("impl", ["transformers", "fallback"])
def test_clip_off_the_native_model_is_refused(clip, impl):
    """The transformers backend and the fallback take token ids, not images: a clear refusal
    at load (it was an AttributeError from deep in the backend), naming what runs instead."""
    folder, _, _ = clip
    with pytest.raises(ValueError, match=f'model_impl="auto" or "native", not {impl!r}'):
        LLM(str(folder), model_impl=impl)


def _legacy_st_layout(folder, root):
    """sentence-transformers' older CLIP layout (the Hub's clip-ViT-* repos): modules.json
    naming its CLIPModel module, the model in 0_CLIPModel/, nothing else at the top."""
    import json
    import shutil

    root.mkdir(parents=True)
    shutil.copytree(folder, root / "0_CLIPModel")
    modules = [
        {
            "idx": 0,
            "name": "0",
            "path": "0_CLIPModel",
            "type": "sentence_transformers.models.CLIPModel",
        }
    ]
    (root / "modules.json").write_text(json.dumps(modules))
    return root


def test_clip_older_sentence_transformers_layout(clip, tmp_path, fake_hub, monkeypatch):
    """The folder and its Hub id load to sentence-transformers' own vectors on that folder
    (raw: no Normalize module), images and texts; offline, from the cache."""
    from hub_server import folder_files
    from sentence_transformers import SentenceTransformer

    folder, _, llm = clip
    root = _legacy_st_layout(folder, tmp_path / "clip-ViT-tiny")
    images = make_images(4, seed=5)
    prompts = [*map(_image_prompt, images), *TEXTS]
    st = SentenceTransformer(str(root), device="cpu")
    reference = torch.cat(
        [st.encode(images, convert_to_tensor=True), st.encode(TEXTS, convert_to_tensor=True)]
    )
    local = LLM(str(root), device="cpu", dtype="float32")
    got = torch.tensor([o.outputs.embedding for o in local.embed(prompts, use_tqdm=False)])
    assert F.cosine_similarity(got, reference, dim=-1).min() >= 0.9999
    norms = got.norm(dim=-1)
    assert ((norms - reference.norm(dim=-1)).abs() <= 1e-4 * norms).all()  # raw, as ST
    assert (norms - 1).abs().max() > 1e-2  # guard: not normalized
    fake_hub.hub.add("org/clip-legacy", folder_files(root))
    by_id = LLM("org/clip-legacy", device="cpu", dtype="float32")
    again = torch.tensor([o.outputs.embedding for o in by_id.embed(prompts, use_tqdm=False)])
    torch.testing.assert_close(again, got, rtol=0, atol=0)
    assert "0_CLIPModel/preprocessor_config.json" in fake_hub.hub.fetched("org/clip-legacy")
    fake_hub.hub.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cached = LLM("org/clip-legacy", device="cpu", dtype="float32")
    offline = torch.tensor([o.outputs.embedding for o in cached.embed(prompts, use_tqdm=False)])
    torch.testing.assert_close(offline, got, rtol=0, atol=0)


@pytest.mark.skipif(
    not Linear(4, 4).fuses("swish"), reason="no oneDNN packed linear here: quick_gelu runs unfused"
)
def test_quick_gelu_runs_as_the_swish_post_op():
    """CLIP's quick_gelu, no oneDNN post-op, becomes its swish with the 1.702 moved into fc1's
    and fc2's weights (models/towers.py, TowerMLP): equal to transformers' fc2(quick_gelu(fc1 x)),
    and folded once however often the loader's hook runs."""
    from transformers.activations import QuickGELUActivation

    from tidepool.models.towers import TowerMLP

    torch.manual_seed(0)
    mlp = TowerMLP(64, 256, "quick_gelu")
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.2)
    fc1, fc2 = (torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    with torch.no_grad():
        for ref, ours in ((fc1, mlp.fc1), (fc2, mlp.fc2)):
            ref.weight.copy_(ours.weight)
            ref.bias.copy_(ours.bias)
    for _ in range(2):  # the second call must not scale again
        mlp.process_weights_after_loading()
    for linear in (mlp.fc1, mlp.fc2):
        linear.process_weights_after_loading()
    assert mlp.fc1.activation == "swish"
    x, residual = torch.randn(33, 64), torch.randn(33, 64)
    expected = fc2(QuickGELUActivation()(fc1(x))) + residual
    # depth 2 (two GEMMs), the longest reduction fc2's 256, plus one rounding of each weight
    assert_close(mlp(x, residual), expected, depth=3, reduction=256)
