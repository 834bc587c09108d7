"""CLIP / SigLIP prompts: a text goes to the text tower; an image alone to the vision tower.

An image request is {"prompt": "", "multi_modal_data": {"image": image}} (vLLM's offline input
for these models): one image, no text. Its prompt_token_ids are placeholders, one per position of
the vision tower (CLIP: the patches + the class token; SigLIP: the patches), so the scheduler
counts them in its token budget; their ids are never embedded (0s). The tower's positions are its
own: their number is the vision config's, not bounded by the text's max_model_len.
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


def vision_positions(hf_config: Any) -> int:
    """The vision tower's sequence length for one image: (image_size / patch_size)^2 patches,
    + 1 class token for CLIP (SigLIP has none)."""
    vision = getattr(hf_config, "vision_config", None) or hf_config
    patches = (vision.image_size // vision.patch_size) ** 2
    return patches + (1 if vision.model_type.startswith("clip") else 0)


class DualTowerProcessor(ImagePromptProcessor):
    def __init__(self, model_config: ModelConfig, tokenizer: Any) -> None:
        super().__init__(model_config, tokenizer)
        self.image_processor = load_image_processor(model_config)
        self.settings = processor_settings(self.image_processor)
        self.num_positions = vision_positions(model_config.hf_config)
        self.name = model_config.architecture

    def process(self, prompt: str, images: Sequence[Any], task: str) -> ProcessedPrompt:
        if prompt:
            raise ValueError(
                f"{self.name} embeds an image alone or a text alone: give the image as "
                "{'prompt': '', 'multi_modal_data': {'image': image}} and the text as its own "
                "prompt"
            )
        if len(images) != 1:
            raise ValueError(f"{self.name} takes one image per prompt, got {len(images)}")
        if task != "embed":
            raise ValueError(
                f"an image gives {self.name} one embedding (task 'embed'), not {task!r}"
            )
        image = images[0]
        pixels = self.image_processor(images=[image], return_tensors="pt")["pixel_values"][0]
        feature = MultiModalFeature(
            modality="image",
            data={"pixel_values": pixels},
            identifier=image_hash(image, self.settings),
            offset=0,
            length=self.num_positions,
        )
        return ProcessedPrompt(
            [0] * self.num_positions, (feature,), counts_toward_max_model_len=False
        )
