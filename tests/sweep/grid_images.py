"""The sweep's image entries (grid.py describes the data; images.py the inputs and references):
CLIP, SigLIP, SigLIP 2 (NaFlex), ColPali, ColQwen2 and the Qwen2-VL embedder, each on the tiny
folder its per-model test builds (tests/multimodal_models.py, paligemma_models.py,
qwen2_vl_models.py) with the entry's seed.

config carries what the bound and the inputs need: depth and the longest reduction as the
per-model tests count them (images.py's docstring), the text limit (CLIP's 77 positions, SigLIP's
fixed 16 and SigLIP 2's 64 padded lengths), and the builder's options.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sweep.grid import Case, Model

CONFIG_CLASSES = {
    "CLIPModel": "CLIPConfig",
    "CLIPVisionModelWithProjection": "CLIPVisionConfig",
    "SiglipModel": "SiglipConfig",
    "SiglipVisionModel": "SiglipVisionConfig",
    "Siglip2Model": "Siglip2Config",
}
PATCH_192 = 3 * 8 * 8
"""The patch GEMM's reduction of the 8 px SigLIP / CLIP towers: more than the FFN's 128."""
PATCH_1176 = 3 * 2 * 14 * 14
"""Qwen2-VL's patch linear (C x T x P x P)."""


def _image(key: str, hf_class: str, layout: str, depth: int, reduction: int, **extra: Any) -> Model:
    config = {"depth": depth, "reduction": reduction, **extra}
    config_class = CONFIG_CLASSES[hf_class]
    return Model(key, config_class, hf_class, config, "image", layout)


def _both(model: Model, output: str, ci: bool = False, **kw: Any) -> list[Case]:
    """SDPA (every machine; the CI case where `ci`) and the CPU kernel (requires_cpu_kernel:
    every tower here has heads of 32)."""
    return [
        Case(model, output, "native", backend="sdpa", ci=ci, **kw),
        Case(model, output, "native", backend="kernel", **kw),
    ]


MM = "multimodal_models"


def _variants(base: Model, output: str, variants: list[tuple[str, dict, int, bool]]) -> list[Case]:
    """Options of `base` (key suffix, builder patch, longest reduction, kernel case or not)."""
    cases: list[Case] = []
    for suffix, patch, reduction, kernel in variants:
        config = {**base.config, "patch": patch, "reduction": reduction}
        model = replace(base, key=f"{base.key}/{suffix}", config=config)
        cases += _both(model, output) if kernel else [Case(model, output, "native", backend="sdpa")]
    return cases


def clip_family() -> list[Case]:
    clip = _image("clip", "CLIPModel", "clip", 4, PATCH_192, text_limit=77)
    vision = _image("clip-vision", "CLIPVisionModelWithProjection", "clip_vision", 4, PATCH_192)
    # Two prompts a step: images and texts split over steps, each step's images one batch.
    steps = Case(clip, "image_embed", "native", backend="sdpa", llm_kwargs={"max_num_seqs": 2})
    both_towers = (f"{MM}.CLIP_TEXT", f"{MM}.CLIP_VISION")
    variants = [
        ("act=gelu", {t: {"hidden_act": "gelu"} for t in both_towers}, PATCH_192, False),
        ("eps=1e-3", {t: {"layer_norm_eps": 1e-3} for t in both_towers}, PATCH_192, False),
        # 48 px images of 16 px patches: 9 patches, a 768-term patch GEMM.
        (
            "s48-p16",
            {f"{MM}.CLIP_VISION": {"image_size": 48, "patch_size": 16}, f"{MM}.IMAGE_SIZE": 48},
            3 * 16 * 16,
            True,
        ),
        # One vision head of 64 (the kernel's other width); four of 16 (SDPA only).
        ("vheads1", {f"{MM}.CLIP_VISION": {"num_attention_heads": 1}}, PATCH_192, True),
        ("vheads4", {f"{MM}.CLIP_VISION": {"num_attention_heads": 4}}, PATCH_192, False),
    ]
    return [
        *_both(clip, "image_embed", ci=True),
        steps,
        *_variants(clip, "image_embed", variants),
        *_both(vision, "image_embed"),
    ]


def siglip_family() -> list[Case]:
    siglip = _image("siglip", "SiglipModel", "siglip", 4, PATCH_192, text_limit=16)
    # A tokenizer without attention_mask in model_input_names: the pads are attended.
    nomask = _image(
        "siglip/pads-attended",
        "SiglipModel",
        "siglip",
        4,
        PATCH_192,
        text_limit=16,
        options={"mask_pads": False},
    )
    vision = _image("siglip-vision", "SiglipVisionModel", "siglip_vision", 4, PATCH_192)
    towers = (f"{MM}.SIGLIP_TEXT", f"{MM}.CLIP_VISION")
    variants = [
        ("act=gelu", {t: {"hidden_act": "gelu"} for t in towers}, PATCH_192, False),
        ("eps=1e-3", {t: {"layer_norm_eps": 1e-3} for t in towers}, PATCH_192, False),
    ]
    return [
        *_both(siglip, "image_embed", ci=True),
        *_variants(siglip, "image_embed", variants),
        Case(nomask, "image_embed", "native", backend="sdpa"),
        *_both(vision, "image_embed"),
    ]


def siglip2_family() -> list[Case]:
    siglip2 = _image("siglip2", "Siglip2Model", "siglip2", 4, PATCH_192, text_limit=64)
    # Siglip2Tokenizer's own side: left pads, attended (no attention_mask).
    left = _image(
        "siglip2/left-pads-attended",
        "Siglip2Model",
        "siglip2",
        4,
        PATCH_192,
        text_limit=64,
        options={"padding_side": "left", "mask_pads": False},
    )
    # Left pads masked: tidepool runs the text without them, at the positions they pushed it to
    # (Request.first_position).
    left_masked = _image(
        "siglip2/left-pads-masked",
        "Siglip2Model",
        "siglip2",
        4,
        PATCH_192,
        text_limit=64,
        options={"padding_side": "left", "mask_pads": True},
    )
    variants = [
        # More patches than the 4 x 4 position grid (interpolated up), and fewer.
        ("max-patches=32", {f"{MM}.SIGLIP2_MAX_PATCHES": 32}, PATCH_192, True),
        ("max-patches=6", {f"{MM}.SIGLIP2_MAX_PATCHES": 6}, PATCH_192, False),
        ("act=gelu", {f"{MM}.SIGLIP_TEXT": {"hidden_act": "gelu"}}, PATCH_192, False),
    ]
    return [
        *_both(siglip2, "image_embed", ci=True),
        *_variants(siglip2, "image_embed", variants),
        Case(left, "image_embed", "native", backend="sdpa"),
        *_both(left_masked, "image_embed"),
    ]


def _colpali() -> Model:
    return Model(
        "colpali",
        "ColPaliConfig",
        "ColPaliForRetrieval",
        {"depth": 7, "reduction": PATCH_192, "text_limit": 32},
        "image",
        "colpali",
    )


def retrieval_family() -> list[Case]:
    colpali = _colpali()
    colqwen2 = Model(
        "colqwen2",
        "ColQwen2Config",
        "ColQwen2ForRetrieval",
        {"depth": 7, "reduction": PATCH_1176, "text_limit": 32},
        "image",
        "colqwen2",
    )
    # ColQwen2 and Qwen2-VL: SDPA only (the loader's choice for their vision tower, whose
    # max_num_patches, 16384 by default, is past what the CPU kernel takes; their text layers
    # are a decoder's). tests/models/test_qwen2_vl.py runs the kernel on the tower by hand.
    colqwen2_case = Case(colqwen2, "multivector", "native", backend="sdpa", ci=True)
    gemma = "paligemma_models.TEXT"
    variants = [
        ("kv4", {gemma: {"num_key_value_heads": 4}}, PATCH_192, True),
        ("act=gelu", {gemma: {"hidden_act": "gelu"}}, PATCH_192, False),
    ]
    return [
        *_both(colpali, "multivector", ci=True),
        *_variants(colpali, "multivector", variants),
        colqwen2_case,
    ]


def qwen2_vl_family() -> list[Case]:
    bound = {"depth": 6, "reduction": PATCH_1176}
    gme = Model(
        "qwen2-vl",
        "Qwen2VLConfig",
        "Qwen2VLForConditionalGeneration",
        bound,
        "image",
        "qwen2_vl",
    )
    base = Model("qwen2-vl-base", "Qwen2VLConfig", "Qwen2VLModel", bound, "image", "qwen2_vl_base")
    mean = {"pooler_config": {"pooling_type": "MEAN"}}
    # 5-token chunks: every image's placeholders split across steps.
    chunked = {"max_num_batched_tokens": 5, "max_num_seqs": 2}
    text, vision = "qwen2_vl_models.TEXT", "qwen2_vl_models.VISION"
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
    variants = [
        ("mrope=4-2-2", {text: {"rope_parameters": rope}}, PATCH_1176, False),
        ("vision-act=gelu", {vision: {"hidden_act": "gelu"}}, PATCH_1176, False),
        # Up to 140 x 140 px: grids of up to 10 x 10 patches (25 tokens).
        ("max-pixels=140^2", {"qwen2_vl_models.MAX_PIXELS": 140 * 140}, PATCH_1176, False),
        ("kv4", {text: {"num_key_value_heads": 4}}, PATCH_1176, False),
    ]
    return [
        Case(gme, "vlm_last", "native", backend="sdpa", ci=True),
        *_variants(gme, "vlm_last", variants),
        Case(gme, "vlm_mean", "native", backend="sdpa", llm_kwargs=mean),
        Case(gme, "vlm_last", "native", backend="sdpa", llm_kwargs=chunked),
        Case(base, "vlm_last", "native", backend="sdpa"),
        Case(base, "vlm_mean", "native", backend="sdpa", llm_kwargs=mean),
    ]


def reduced_precision() -> list[Case]:
    """bfloat16 on SDPA, with references.py's bfloat16 bound (float32 references)."""
    entries = [
        _image("clip", "CLIPModel", "clip", 4, PATCH_192, text_limit=77),
        _image("siglip2", "Siglip2Model", "siglip2", 4, PATCH_192, text_limit=64),
    ]
    cases = [Case(m, "image_embed", "native", "bfloat16", backend="sdpa") for m in entries]
    colpali = _colpali()
    gme = Model(
        "qwen2-vl",
        "Qwen2VLConfig",
        "Qwen2VLForConditionalGeneration",
        {"depth": 6, "reduction": PATCH_1176},
        "image",
        "qwen2_vl",
    )
    cases.append(Case(colpali, "multivector", "native", "bfloat16", backend="sdpa"))
    cases.append(Case(gme, "vlm_last", "native", "bfloat16", backend="sdpa"))
    return cases


def image_family() -> list[Case]:
    return [
        *reduced_precision(),
        *clip_family(),
        *siglip_family(),
        *siglip2_family(),
        *retrieval_family(),
        *qwen2_vl_family(),
    ]
