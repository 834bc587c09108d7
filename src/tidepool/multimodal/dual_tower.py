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

SIGLIP2_TEXT_LENGTH = 64
"""Siglip2Processor's text padding: max_length 64 (its text_kwargs), whatever the tokenizer's
model_max_length."""


def vision_positions(hf_config: Any) -> int:
    """The vision tower's sequence length for one image: (image_size / patch_size)^2 patches,
    + 1 class token for CLIP (SigLIP has none); 0 for SigLIP 2's NaFlex tower, whose length
    is each image's (NaFlexProcessor)."""
    vision = getattr(hf_config, "vision_config", None) or hf_config
    if vision.model_type.startswith("siglip2"):
        return 0
    patches = (vision.image_size // vision.patch_size) ** 2
    return patches + (1 if vision.model_type.startswith("clip") else 0)


class FixedLengthText:
    """SigLIP's texts: padded to one fixed length, as its processor does with
    padding="max_length" (vLLM 0.32: tokenization_kwargs={"padding": "max_length"}), since
    the text tower pools the last padded position. The length is the tokenizer's
    model_max_length (64 for most checkpoints), else the text's max_position_embeddings; the
    pads are keys unless the tokenizer returns an attention_mask (its model_input_names), as
    transformers' get_text_features is called on the processor's output."""

    def __init__(
        self, tokenizer: Any, text_config: Any, name: str, length: int | None = None
    ) -> None:
        positions = text_config.max_position_embeddings
        if length is None:
            # The input processor lifts model_max_length (it checks lengths itself): the
            # folder's value is in init_kwargs.
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
        self.padding_side = getattr(tokenizer, "padding_side", "right")
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
        pads = [self.pad_id] * (self.length - len(token_ids))
        if self.padding_side == "left":
            if self.masks_pads and pads:
                # No token attends to a masked pad, and the pooled row (the last) is the text's
                # own: the pads are left out, the text keeps the positions they pushed it to.
                return ShapedText(token_ids, first_position=len(pads))
            return ShapedText(pads + token_ids)
        attended = len(token_ids) if self.masks_pads and pads else None
        return ShapedText(token_ids + pads, attended)


class DualTowerProcessor(ImagePromptProcessor):
    def __init__(self, model_config: ModelConfig, tokenizer: Any) -> None:
        super().__init__(model_config, tokenizer)
        self.image_processor = load_image_processor(model_config)
        self.settings = processor_settings(self.image_processor)
        self.num_positions = vision_positions(model_config.hf_config)
        self.name = model_config.architecture
        text_config = getattr(model_config.hf_config, "text_config", None)
        self.takes_text = text_config is not None
        model_type = model_config.hf_config.model_type
        self.fixed_length = (
            FixedLengthText(tokenizer, text_config, self.name, SIGLIP2_TEXT_LENGTH)
            if self.takes_text and model_type == "siglip2"
            else FixedLengthText(tokenizer, text_config, self.name)
            if self.takes_text and model_type == "siglip"
            else None
        )
        if self.fixed_length is not None and self.fixed_length.length > model_config.max_model_len:
            raise ValueError(
                f"{self.name} pads every text to {self.fixed_length.length} tokens, more than "
                f"max_model_len {model_config.max_model_len}: raise max_model_len to at least "
                f"{self.fixed_length.length}"
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
        feature = self.image_feature(images[0])
        return ProcessedPrompt([0] * feature.length, (feature,), counts_toward_max_model_len=False)

    def image_feature(self, image: Any) -> MultiModalFeature:
        """One image → its feature: the processor's pixel_values, one position per placeholder."""
        pixels = self.image_processor(images=[image], return_tensors="pt")["pixel_values"][0]
        return MultiModalFeature(
            modality="image",
            data={"pixel_values": pixels},
            identifier=image_hash(image, self.settings),
            offset=0,
            length=self.num_positions,
        )


class NaFlexProcessor(DualTowerProcessor):
    """SigLIP 2's NaFlex images: the processor resizes each image to at most max_num_patches
    patches at its aspect ratio and pads them to max_num_patches (pixel_attention_mask); the
    feature keeps the h * w real patches and spatial_shapes (h, w): one placeholder each."""

    def image_feature(self, image: Any) -> MultiModalFeature:
        out = self.image_processor(images=[image], return_tensors="pt")
        h, w = (int(v) for v in out["spatial_shapes"][0])
        mask = out["pixel_attention_mask"][0].bool()
        if int(mask.sum()) != h * w or not bool(mask[: h * w].all()):
            raise ValueError(
                f"{self.name}: the image processor's pixel_attention_mask does not mark the "
                f"first {h} x {w} patches (its spatial_shapes) as the image's"
            )
        return MultiModalFeature(
            modality="image",
            data={
                "pixel_values": out["pixel_values"][0][: h * w],
                "spatial_shapes": out["spatial_shapes"][0],
            },
            identifier=image_hash(image, self.settings),
            offset=0,
            length=h * w,
        )
