"""ColPali (`ColPaliForRetrieval`) against transformers on the same tiny random weights.

Pages ({"prompt": "", image}: ColPaliProcessor's page prompt) and queries (plain texts, which
tidepool puts in process_queries' format) give one normalized vector per token, equal to
`ColPaliForRetrieval(**processor outputs).embeddings` at the unpadded tokens (per-token cosine
>= 0.9999 and within the float32 bound); `LLM.score` is MaxSim, equal to the processor's
`score_retrieval` within 1e-4 relative (and the float32 bound).

Depth 7 (patch linear, 2 vision layers, the projector, 2 Gemma layers, the projection) over
192 terms (the patch linear's reduction, 3 x 8 x 8, the longest).
"""

from __future__ import annotations

import pytest
import torch
from multimodal_models import make_images
from paligemma_models import build_colpali, colpali_config, reference_processor
from tolerances import assert_close, assert_cosine_close, float32_rtol

from tidepool import LLM
from tidepool.outputs import BatchInputError

DEPTH, REDUCTION = 7, 192
IMAGES = make_images(3, seed=5)
QUERIES = ["what does the chart show?", "a red square", "Describe the image."]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_colpali(tmp_path_factory.mktemp("colpali") / "model")


def _unpadded(rows, inputs):
    return [e[m.bool()] for e, m in zip(rows, inputs["attention_mask"], strict=True)]


@pytest.fixture(scope="module")
def reference(folder):
    """(processor, model, page vectors, query vectors, query ids): transformers' unpadded rows."""
    from transformers import ColPaliForRetrieval

    model = ColPaliForRetrieval.from_pretrained(str(folder), dtype=torch.float32).eval()
    processor = reference_processor(folder)
    pages, queries = processor.process_images(IMAGES), processor.process_queries(QUERIES)
    with torch.no_grad():
        page_rows = model(**pages).embeddings
        query_rows = model(**queries).embeddings
    ids = [
        i[m.bool()].tolist()
        for i, m in zip(queries["input_ids"], queries["attention_mask"], strict=True)
    ]
    return processor, model, _unpadded(page_rows, pages), _unpadded(query_rows, queries), ids


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), device="cpu", dtype="float32")


def _pages(images=IMAGES):
    return [{"prompt": "", "multi_modal_data": {"image": image}} for image in images]


def _vectors(llm, prompts):
    outputs = llm.encode(prompts, pooling_task="token_embed", use_tqdm=False)
    return [o.outputs.data for o in outputs], outputs


def test_token_vectors_equal_transformers(llm, reference):
    _, _, page_vectors, query_vectors, query_ids = reference
    assert llm.llm_engine.config.model.pooling_tasks == ("token_embed",)
    got, outputs = _vectors(llm, _pages() + QUERIES)
    # The queries' ids are process_queries' (BOS, "Question: ", the text, 10 pads, "\n").
    assert [o.prompt_token_ids for o in outputs[len(IMAGES) :]] == query_ids
    for vectors, expected in zip(got, page_vectors + query_vectors, strict=True):
        assert vectors.shape == expected.shape
        worst = assert_cosine_close(vectors, expected, depth=DEPTH, reduction=REDUCTION)
        assert worst >= 0.9999
        assert_close(vectors, expected, depth=DEPTH, reduction=REDUCTION, dim=-1)


def test_query_already_in_the_query_format_is_taken_as_it_is(llm, reference):
    processor, _, _, query_vectors, query_ids = reference
    written = processor.tokenizer.decode(query_ids[0])  # "<bos>Question: ...<pad>x10\n"
    got, outputs = _vectors(llm, [written])
    assert outputs[0].prompt_token_ids == query_ids[0]
    assert_close(got[0], query_vectors[0], depth=DEPTH, reduction=REDUCTION, dim=-1)


def test_attention_is_bidirectional_as_transformers(reference, llm):
    """Guard: transformers run causally (its mask without token_type_ids on a padded batch)
    gives other vectors than the bidirectional run tidepool matches, by far more than the
    bound: the comparison above would catch a causal tidepool."""
    processor, model, _, query_vectors, _ = reference
    queries = processor.process_queries(QUERIES)
    with torch.no_grad():
        causal = model(
            input_ids=queries["input_ids"], attention_mask=queries["attention_mask"]
        ).embeddings
    bound = float32_rtol(DEPTH, REDUCTION)
    for causal_rows, expected in zip(_unpadded(causal, queries), query_vectors, strict=True):
        assert (causal_rows - expected).abs().max() > 30 * bound


def test_score_is_maxsim_equal_to_score_retrieval(llm, reference):
    processor, _, page_vectors, query_vectors, _ = reference
    # batch_size=1: score_retrieval pads a batch's passages with zero vectors, which would
    # take part in its max; one passage per batch has no padding.
    expected = processor.score_retrieval(query_vectors, page_vectors, batch_size=1)
    for row, text in enumerate(QUERIES):
        got = torch.tensor([o.outputs.score for o in llm.score(text, _pages(), use_tqdm=False)])
        assert torch.allclose(got, expected[row], rtol=1e-4, atol=0)
        assert_close(got, expected[row], depth=DEPTH, reduction=REDUCTION * 32)
    # Guard: the pages' scores are far apart (1e-4 relative could not hide a swapped page).
    spread = expected.max(1).values - expected.min(1).values
    assert (spread / expected.abs().max(1).values).min() > 0.01


def test_batch_invariance_across_image_and_text_prompts(llm):
    prompts = _pages() + QUERIES
    together, _ = _vectors(llm, prompts)
    for row, prompt in enumerate(prompts):
        (alone,), _ = _vectors(llm, [prompt])
        assert_close(alone, together[row], depth=DEPTH, reduction=REDUCTION)
    reordered, _ = _vectors(llm, prompts[::-1])
    for got, expected in zip(reordered[::-1], together, strict=True):
        assert_close(got, expected, depth=DEPTH, reduction=REDUCTION)


def test_image_count_must_match_the_placeholders(llm):
    good = _pages()[0]
    bad = [
        {"prompt": "no placeholder here", "multi_modal_data": {"image": IMAGES[0]}},
        {"prompt": "<image><image><bos>two", "multi_modal_data": {"image": IMAGES[0]}},
        {"prompt": "", "multi_modal_data": {"image": IMAGES[:2]}},
    ]
    with pytest.raises(BatchInputError) as info:
        llm.encode([good, *bad], pooling_task="token_embed", use_tqdm=False)
    messages = {e.index: e.message for e in info.value.errors}
    assert "has 0 <image> for 1 image(s)" in messages[1]
    assert "has 2 <image> for 1 image(s)" in messages[2]
    assert "has 0 <image> for 2 image(s)" in messages[3]
    assert info.value.outputs[0] is not None  # the good prompt still ran


def test_unused_checkpoint_tensors_are_refused(folder):
    from transformers import AutoConfig

    from tidepool.models.colpali import ColPaliForRetrieval

    model = ColPaliForRetrieval(AutoConfig.from_pretrained(str(folder)))
    extra = [("vlm.language_model.model.layers.0.self_attn.q_norm.weight", torch.zeros(32))]
    with pytest.raises(ValueError, match=r"does not use 1 checkpoint tensors: .*q_norm"):
        model.load_weights(extra)


def test_text_configs_it_does_not_implement_are_refused():
    from tidepool.models.paligemma import check_text_config

    config = colpali_config(320).vlm_config.text_config
    check_text_config(config)
    config.hidden_activation = "gelu"  # which one trained it: not guessed
    with pytest.raises(ValueError, match="hidden_activation='gelu' and hidden_act="):
        check_text_config(config)
    config.model_type = "gemma2"
    with pytest.raises(ValueError, match="PaliGemma 1 .* only"):
        check_text_config(config)


def test_bucketed_sdpa_matches_transformers(folder, reference, llm, monkeypatch):
    """The SDPA backend's padded buckets (its builder's LayerRows) for the text and the vision
    tower: equal to transformers too, and to the default backend (the CPU kernel where it
    builds)."""
    from tidepool.attention import cpu_kernels
    from tidepool.attention.backend import BUCKETED_SDPA

    _, _, page_vectors, query_vectors, _ = reference
    prompts = _pages() + QUERIES
    by_default, _ = _vectors(llm, prompts)
    monkeypatch.setenv("TIDEPOOL_CPU_ATTENTION", "sdpa")
    monkeypatch.setattr(cpu_kernels, "_state", {})  # the kernel's availability is cached
    sdpa = LLM(str(folder), device="cpu", dtype="float32")
    model = sdpa.engine.model_runner.model
    assert model.attention_backend is BUCKETED_SDPA and model.vision_backend is BUCKETED_SDPA
    got, _ = _vectors(sdpa, prompts)
    for vectors, expected, default in zip(
        got, page_vectors + query_vectors, by_default, strict=True
    ):
        assert_cosine_close(vectors, expected, depth=DEPTH, reduction=REDUCTION)
        assert_close(vectors, expected, depth=DEPTH, reduction=REDUCTION, dim=-1)
        assert_close(vectors, default, depth=DEPTH, reduction=REDUCTION, dim=-1)


def test_both_checkpoint_layouts_load_the_same_weights(folder):
    """transformers 5 saves vlm.language_model.model.* and vlm.vision_tower.*; the in-memory
    names (vlm.language_model.*) and transformers 4's SiglipVisionModel names
    (vlm.vision_tower.vision_model.*), with an lm_head and a SigLIP pooling head (read by
    nothing), load the same parameters."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from tidepool.models.colpali import ColPaliForRetrieval

    saved = load_file(str(folder / "model.safetensors"))
    assert any(k.startswith("vlm.language_model.model.") for k in saved)
    renamed = {
        k.replace("vlm.language_model.model.", "vlm.language_model.").replace(
            "vlm.vision_tower.", "vlm.vision_tower.vision_model."
        ): v
        for k, v in saved.items()
    }
    renamed["vlm.language_model.lm_head.weight"] = saved[
        "vlm.language_model.model.embed_tokens.weight"
    ]
    renamed["vlm.vision_tower.vision_model.head.probe"] = torch.zeros(1, 1, 64)  # never read
    config = AutoConfig.from_pretrained(str(folder))
    models = [ColPaliForRetrieval(config), ColPaliForRetrieval(config)]
    assert models[0].load_weights(saved.items()) == models[1].load_weights(renamed.items())
    one, two = (dict(m.named_parameters()) for m in models)
    assert all(torch.equal(one[name], two[name]) for name in one)


def test_image_content_parts_score_as_page_prompts(llm):
    """A document given as content parts (the routes' and LLM.score's form) is the page
    prompt "" + its image: the same scores as the prompt dicts."""
    parts = [{"content": [{"type": "image_pil", "image_pil": image}]} for image in IMAGES]
    by_parts = [o.outputs.score for o in llm.score(QUERIES[0], parts, use_tqdm=False)]
    by_dicts = [o.outputs.score for o in llm.score(QUERIES[0], _pages(), use_tqdm=False)]
    assert by_parts == by_dicts
