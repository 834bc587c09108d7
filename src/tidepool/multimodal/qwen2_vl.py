"""Qwen2-VL prompts (GME-style embedders, ColQwen2): images among the prompt's tokens.

    {"prompt": "<|vision_start|><|image_pad|><|vision_end|>What is on the page?",
     "multi_modal_data": {"image": image}}

Each <|image_pad|> of the prompt (one per image, in order; vLLM's and Qwen2VLProcessor's input)
becomes its image's placeholder run: t * h * w / merge² tokens for the image processor's grid
(t, h, w). The feature carries the processor's pixel_values [t * h * w, C * T * P * P] and
image_grid_thw [3] (the M-RoPE rule and the vision tower read it). ColQwen2 with an empty prompt
and one image takes its processor's page prompt (transformers' ColQwen2Processor
visual_prompt_prefix).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tidepool.config import ModelConfig
from tidepool.multimodal.features import MultiModalFeature, image_hash
from tidepool.multimodal.processing import (
    ImagePromptProcessor,
    ProcessedPrompt,
    load_image_processor,
    processor_settings,
)

IMAGE_TOKEN = "<|image_pad|>"
COLQWEN2_PAGE_PROMPT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image.<|im_end|>"
    "<|endoftext|>"
)
"""transformers' ColQwen2Processor.visual_prompt_prefix: the prompt of a page image."""


def vlm_config(hf_config: Any) -> Any:
    """The Qwen2-VL config (ColQwen2 keeps it as vlm_config)."""
    return getattr(hf_config, "vlm_config", None) or hf_config


class Qwen2VLPromptProcessor(ImagePromptProcessor):
    def __init__(self, model_config: ModelConfig, tokenizer: Any) -> None:
        super().__init__(model_config, tokenizer)
        config = vlm_config(model_config.hf_config)
        self.image_token_id = int(config.image_token_id)
        self.merge = int(config.vision_config.spatial_merge_size)
        self.image_processor = load_image_processor(model_config)
        self.settings = processor_settings(self.image_processor)
        self.name = model_config.architecture
        self.page_prompt = (
            COLQWEN2_PAGE_PROMPT if model_config.architecture == "ColQwen2ForRetrieval" else None
        )

    def process(self, prompt: str, images: Sequence[Any], task: str) -> ProcessedPrompt:
        if not prompt and self.page_prompt is not None and len(images) == 1:
            prompt = self.page_prompt
        ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        slots = [i for i, token in enumerate(ids) if token == self.image_token_id]
        if len(slots) != len(images):
            raise ValueError(
                f"the prompt has {len(slots)} {IMAGE_TOKEN} for {len(images)} image(s): "
                f"{self.name} takes one {IMAGE_TOKEN} per image, where the image goes (e.g. "
                f"'<|vision_start|>{IMAGE_TOKEN}<|vision_end|>')"
            )
        processed = self.image_processor(images=list(images), return_tensors="pt")
        pixels, grids = processed["pixel_values"], processed["image_grid_thw"]
        out: list[int] = []
        features = []
        start = previous = 0
        for image, slot, grid in zip(images, slots, grids, strict=True):
            t, h, w = (int(v) for v in grid.tolist())
            length = t * h * w // (self.merge * self.merge)
            out.extend(ids[previous:slot])
            features.append(
                MultiModalFeature(
                    modality="image",
                    data={
                        "pixel_values": pixels[start : start + t * h * w],
                        "image_grid_thw": grid,
                    },
                    identifier=image_hash(image, self.settings),
                    offset=len(out),
                    length=length,
                )
            )
            out.extend([self.image_token_id] * length)
            start += t * h * w
            previous = slot + 1
        out.extend(ids[previous:])
        return ProcessedPrompt(out, tuple(features))
