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
    ShapedText,
    load_image_processor,
    processor_settings,
)


def vision_positions(hf_config: Any) -> int:
    """The vision tower's sequence length for one image: (image_size / patch_size)^2 patches,
    + 1 class token for CLIP (SigLIP has none)."""
    vision = getattr(hf_config, "vision_config", None) or hf_config
    patches = (vision.image_size // vision.patch_size) ** 2
    return patches + (1 if vision.model_type.startswith("clip") else 0)


class FixedLengthText:
    """SigLIP's texts: padded to one fixed length, as its processor does with
    padding="max_length" (vLLM 0.32: tokenization_kwargs={"padding": "max_length"}), since
    the text tower pools the last padded position. The length is the tokenizer's
    model_max_length (64 for most checkpoints), else the text's max_position_embeddings; the
    pads are keys unless the tokenizer returns an attention_mask (its model_input_names), as
    transformers' get_text_features is called on the processor's output."""

    def __init__(self, tokenizer: Any, text_config: Any, name: str) -> None:
        positions = text_config.max_position_embeddings
        # The input processor lifts model_max_length (it checks lengths itself): the folder's
        # value is in init_kwargs.
        length = tokenizer.init_kwargs.get("model_max_length", tokenizer.model_max_length)
        if not isinstance(length, int) or length > 1_000_000:  # transformers' "no limit"
            length = positions
        if length > positions:
            raise ValueError(
                f"{name}: the tokenizer pads texts to model_max_length {length}, beyond the text "
                f"tower's {positions} positions (max_position_embeddings)"
            )
        if tokenizer.pad_token_id is None:
            raise ValueError(f"{name}'s tokenizer has no pad token to pad its texts with")
        if getattr(tokenizer, "padding_side", "right") != "right":
            raise ValueError(
                f"{name}'s tokenizer pads on the {tokenizer.padding_side}: tidepool pads "
                "SigLIP's texts on the right only (its checkpoints' side)"
            )
        self.length = length
        self.pad_id = int(tokenizer.pad_token_id)
        self.masks_pads = "attention_mask" in getattr(tokenizer, "model_input_names", ())
        self.name = name

    def pad(self, token_ids: list[int]) -> ShapedText:
        if len(token_ids) > self.length:
            raise ValueError(
                f"{self.name} embeds texts of at most {self.length} tokens (its fixed, padded "
                f"text length), this one has {len(token_ids)}: shorten it or pass "
                "truncate_prompt_tokens"
            )
        padded = token_ids + [self.pad_id] * (self.length - len(token_ids))
        attended = len(token_ids) if self.masks_pads and len(token_ids) < self.length else None
        return ShapedText(padded, attended)


class DualTowerProcessor(ImagePromptProcessor):
    def __init__(self, model_config: ModelConfig, tokenizer: Any) -> None:
        super().__init__(model_config, tokenizer)
        self.image_processor = load_image_processor(model_config)
        self.settings = processor_settings(self.image_processor)
        self.num_positions = vision_positions(model_config.hf_config)
        self.name = model_config.architecture
        text_config = getattr(model_config.hf_config, "text_config", None)
        self.takes_text = text_config is not None
        self.fixed_length = (
            FixedLengthText(tokenizer, text_config, self.name)
            if self.takes_text and model_config.hf_config.model_type == "siglip"
            else None
        )

    def shape_text(self, token_ids: list[int]) -> ShapedText:
        if not self.takes_text:
            raise ValueError(
                f"{self.name} is a vision tower alone: it embeds images "
                "({'prompt': '', 'multi_modal_data': {'image': image}}), not texts"
            )
        if self.fixed_length is not None:
            return self.fixed_length.pad(token_ids)
        return ShapedText(token_ids)

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
