"""Qwen2-VL on the decoder path, against transformers on the same tiny random weights.

The vision tower alone (packed images, both encoder backends) against
Qwen2VisionTransformerPretrainedModel; the M-RoPE rule against Qwen2VLModel.get_rope_index; the
embedder (LAST pooling over mixed image + text tokens, normalized) against the last hidden state
of Qwen2VLModel's forward on the same prompt, in mixed batches, chunked over steps (each image
encoded once) and with the prefix cache keyed by the images' content.

Tolerances (tests/tolerances.py): the image path chains the patch linear (reduction C*T*P*P =
1176, the longest), 2 vision blocks, the merger and 2 text layers: depth 6 over 1176 terms.
"""

from __future__ import annotations

import pytest
import torch
from qwen2_vl_models import (
    IMAGE_PAD,
    IMAGE_PROMPT,
    VISION,
    build_qwen2_vl,
    image_processor,
    make_images,
    qwen2_vl_config,
    reference_inputs,
)
from tolerances import assert_close, float32_rtol

from tidepool import LLM
from tidepool.models.mrope import ImagePlacement, mrope_positions
from tidepool.outputs import BatchInputError

DEPTH, REDUCTION = 6, 1176
VISION_DEPTH = VISION["depth"] + 2  # + patch linear and merger


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl") / "model")


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), device="cpu", dtype="float32", enable_prefix_caching=False)


IMAGES = make_images(6)
CASES = [
    ("<|im_start|>" + IMAGE_PROMPT + "Describe the image.<|im_end|>", [IMAGES[0]]),
    ("Query: what does the chart show?", []),
    (IMAGE_PROMPT + " and " + IMAGE_PROMPT + " a red square", [IMAGES[1], IMAGES[2]]),
    (IMAGE_PROMPT, [IMAGES[3]]),
    ("a blue circle " + IMAGE_PROMPT + " on a white page", [IMAGES[4]]),
]


def _prompt(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def _reference(hf, text, images, plain_positions=False):
    model, tokenizer = hf
    inputs = reference_inputs(tokenizer, text, images)
    if plain_positions:  # every token at its index on all three rows: no M-RoPE
        n = inputs["input_ids"].shape[1]
        inputs["position_ids"] = torch.arange(n).view(1, 1, n).expand(3, 1, n)
    with torch.no_grad():
        hidden = model.model(**inputs).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=-1)


def _embed(llm, cases):
    outs = llm.embed([_prompt(t, i) for t, i in cases], use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outs])


# ------------------------------------------------------------------ the vision tower


@pytest.mark.parametrize("backend_name", ["bucketed_sdpa", "cpu_kernel"])
def test_vision_tower_packed_equals_transformers(backend_name):
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    from tidepool.attention import backend as registry
    from tidepool.models.qwen2_vl_vision import Qwen2VisionTransformer, vision_weights

    backend = registry.ENCODER_BACKENDS[backend_name]
    spec = registry.AttentionSpec(torch.device("cpu"), torch.float32, 32, 64)
    if not backend.supports(spec):
        pytest.skip(f"{backend_name} does not run here (its kernel did not build for this CPU)")
    config = qwen2_vl_config(64).vision_config
    torch.manual_seed(3)
    reference = Qwen2VisionTransformerPretrainedModel._from_config(config).eval()
    for p in reference.parameters():  # random everywhere (norms too), std 0.2
        torch.nn.init.normal_(p, std=0.2)
    ours = Qwen2VisionTransformer(config)
    state = dict(vision_weights(ours, reference.state_dict().items()))
    assert not ours.load_state_dict(state, strict=False).missing_keys
    for module in ours.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    ours.set_encoder_backend(backend.for_spec(spec))
    processed = image_processor()(images=IMAGES[:4], return_tensors="pt")
    pixels, grid = processed["pixel_values"], processed["image_grid_thw"]
    with torch.no_grad():
        expected = reference(pixels, grid_thw=grid).pooler_output
        packed = ours(pixels, [tuple(g) for g in grid.tolist()])
    assert_close(packed, expected, depth=VISION_DEPTH, reduction=REDUCTION, msg="packed")
    start = row = 0
    for g in grid.tolist():  # each image alone: the packing changes nothing
        with torch.no_grad():
            alone = ours(pixels[start : start + g[0] * g[1] * g[2]], [tuple(g)])
        n = alone.shape[0]
        assert_close(alone, expected[row : row + n], depth=VISION_DEPTH, reduction=REDUCTION)
        start, row = start + g[0] * g[1] * g[2], row + n
    assert row == expected.shape[0]


# ------------------------------------------------------------------ M-RoPE


def test_mrope_rule_equals_get_rope_index(hf):
    model, tokenizer = hf
    for text, images in CASES:
        inputs = reference_inputs(tokenizer, text, images)
        expected, delta = model.model.get_rope_index(
            inputs["input_ids"],
            inputs["mm_token_type_ids"],
            image_grid_thw=inputs.get("image_grid_thw"),
        )
        ids = inputs["input_ids"][0].tolist()
        grids = inputs["image_grid_thw"].tolist() if images else []
        starts = [i for i, t in enumerate(ids) if t == IMAGE_PAD and (i == 0 or ids[i - 1] != t)]
        placements = [ImagePlacement(s, tuple(g)) for s, g in zip(starts, grids, strict=True)]
        got = mrope_positions(len(ids), placements, merge=2)
        assert torch.equal(got.prompt, expected[:, 0]), text
        assert got.delta == int(delta), text
        # Decoding: index i past the prompt is i + delta on all three rows (transformers'
        # compute_3d_position_ids with a cache).
        later = got.between(len(ids) - 1, len(ids) + 3)
        assert torch.equal(later[:, 0], expected[:, 0, -1])
        steps = torch.arange(len(ids), len(ids) + 3) + int(delta)
        assert torch.equal(later[:, 1:], steps.expand(3, -1))


def test_mrope_rule_refuses_overlapping_images():
    with pytest.raises(ValueError, match="overlaps another"):
        mrope_positions(10, [ImagePlacement(0, (1, 4, 4)), ImagePlacement(2, (1, 2, 2))], 2)


# ------------------------------------------------------------------ the embedder


def test_embedder_equals_transformers_on_mixed_batch(llm, hf):
    got = _embed(llm, CASES)
    expected = torch.stack([_reference(hf, t, i) for t, i in CASES])
    assert_close(got, expected, depth=DEPTH, reduction=REDUCTION, dim=-1)
    # Guard: without M-RoPE a prompt with an image of more than one token (a grid, whose rows
    # and columns get their own positions) moves by far more than the bound. (A one-token
    # image's M-RoPE positions are the plain ones.)
    bound = float32_rtol(DEPTH, REDUCTION)
    checked = 0
    for text, images in CASES:
        inputs = reference_inputs(hf[1], text, images)
        if int((inputs["input_ids"] == IMAGE_PAD).sum()) > len(images):
            plain = _reference(hf, text, images, plain_positions=True)
            assert (plain - _reference(hf, text, images)).abs().max() > 30 * bound, text
            checked += 1
    assert checked >= 2


def test_batch_invariance_across_image_and_text_prompts(llm):
    together = _embed(llm, CASES)
    for row, case in enumerate(CASES):
        alone = _embed(llm, [case])[0]
        assert_close(alone, together[row], depth=DEPTH, reduction=REDUCTION)
    reordered = _embed(llm, CASES[::-1]).flip(0)
    assert_close(reordered, together, depth=DEPTH, reduction=REDUCTION)


def test_chunked_prefill_encodes_each_image_once(folder, hf):
    # 5-token chunks: every image's placeholders (1 .. 9 tokens) split across steps.
    chunked = LLM(str(folder), dtype="float32", max_num_batched_tokens=5, max_num_seqs=2)
    runner = chunked.engine.model_runner
    got = _embed(chunked, CASES)
    expected = torch.stack([_reference(hf, t, i) for t, i in CASES])
    assert_close(got, expected, depth=DEPTH, reduction=REDUCTION, dim=-1)
    assert runner.multimodal.num_encoded == sum(len(i) for _, i in CASES)
    assert runner.multimodal.cache == {}
    assert chunked.get_metrics().num_steps > len(CASES)


def test_prefix_cache_is_keyed_by_the_image(folder, hf):
    llm = LLM(str(folder), dtype="float32", enable_prefix_caching=True)
    first, second = IMAGES[0].resize((84, 84)), IMAGES[1].resize((84, 84))
    text = IMAGE_PROMPT + " a red square and a blue circle on a white page"
    a = _embed(llm, [(text, [first])])[0]
    hits = llm.get_metrics().prefix_cache_hits
    b = _embed(llm, [(text, [second])])[0]  # same token ids, other pixels: no hit
    assert llm.get_metrics().prefix_cache_hits == hits
    assert_close(a, _reference(hf, text, [first]), depth=DEPTH, reduction=REDUCTION)
    assert_close(b, _reference(hf, text, [second]), depth=DEPTH, reduction=REDUCTION)
    assert (a - b).abs().max() > 30 * float32_rtol(DEPTH, REDUCTION)
    encoded = llm.engine.model_runner.multimodal.num_encoded
    again = llm.embed([_prompt(text, [first])], use_tqdm=False)[0]  # the same image: a hit
    num_tokens = len(again.prompt_token_ids)
    assert num_tokens > 16 and again.num_cached_tokens == (num_tokens - 1) // 16 * 16
    assert llm.get_metrics().prefix_cache_hits - hits == again.num_cached_tokens
    assert_close(torch.tensor(again.outputs.embedding), a, depth=DEPTH, reduction=REDUCTION)
    # Its image lies in the cached blocks: nothing left to encode.
    assert llm.engine.model_runner.multimodal.num_encoded == encoded


def test_image_count_must_match_the_placeholders(llm):
    good = _prompt(*CASES[0])
    bad = {"prompt": IMAGE_PROMPT + IMAGE_PROMPT, "multi_modal_data": {"image": IMAGES[0]}}
    with pytest.raises(BatchInputError) as info:
        llm.embed([good, bad], use_tqdm=False)
    (error,) = info.value.errors
    assert error.index == 1 and "2 <|image_pad|> for 1 image(s)" in error.message
    assert info.value.outputs[0] is not None  # the good prompt still ran


def test_generation_is_refused(folder):
    with pytest.raises(ValueError, match="runner='generate' is not available"):
        LLM(str(folder), runner="generate")
