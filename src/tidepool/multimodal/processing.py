"""A prompt and its images → token ids with placeholders + one MultiModalFeature per image.

    {"prompt": str, "multi_modal_data": {"image": PIL.Image | [PIL.Image, ...]}}   (vLLM's input)
        │  check_multi_modal_data: known modality keys, PIL images (decoding is media.py's)
        ▼
    ImagePromptProcessor.process(prompt, images, task)       one per model family, registered
        │  the model's own Hugging Face image processor (`load_image_processor`: the PIL one,
        │  transformers' torchvision path does not load beside the CPU torch), its placeholder
        │  rule (CLIP: 50 positions per 224 px image; Qwen2-VL: the processor's <|image_pad|> runs)
        ▼
    ProcessedPrompt(prompt_token_ids, mm_features)  →  Request.mm_features

A family's processor is one class, registered by architecture (`register_image_processor`, or an
entry in `_PROCESSORS`): the input processor asks `processor_for(model_config, tokenizer)` and a
model without one refuses `multi_modal_data`, naming it. `process` raises ValueError for an input
the model cannot take; the input processor makes that prompt's RequestError of it.
"""

from __future__ import annotations

import importlib
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tidepool.config import ModelConfig
from tidepool.multimodal.features import MODALITIES, MultiModalFeature, check_features


@dataclass(frozen=True)
class ProcessedPrompt:
    prompt_token_ids: list[int]
    mm_features: tuple[MultiModalFeature, ...]
    counts_toward_max_model_len: bool = True
    """False where the placeholders are another tower's positions (CLIP's image-only prompts:
    the vision tower's patches, limited by its own config, not by the text's max_model_len)."""

    def __post_init__(self) -> None:
        check_features(self.mm_features, len(self.prompt_token_ids))


@dataclass(frozen=True)
class ShapedText:
    """A text prompt as the model runs it (ImagePromptProcessor.shape_text)."""

    token_ids: list[int]
    num_attended_tokens: int | None = None
    """Keys: the first this many tokens (the others, e.g. SigLIP's pads where its tokenizer
    masks them, are queries only: Request.num_attended_tokens); None: every token."""
    first_position: int = 0
    """The first token's position (Request.first_position): SigLIP 2's left-padded texts,
    whose masked leading pads are left out, keep the positions the pads pushed them to."""


class ImagePromptProcessor(ABC):
    """A model family's rule for prompts with images (see the module docstring)."""

    modalities: tuple[str, ...] = ("image",)

    def __init__(self, model_config: ModelConfig, tokenizer: Any) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer

    @abstractmethod
    def process(self, prompt: str, images: Sequence[Any], task: str) -> ProcessedPrompt:
        """`images`: decoded PIL images, in prompt order; `task`: the request's pooling task
        (or "generate"). Raises ValueError naming what the model cannot take."""

    def shape_prompt(self, text: str) -> str:
        """A text prompt without images, before tokenizing: the text the model's processor
        would tokenize (ColPali's query format); the text itself by default."""
        return text

    def shape_text(self, token_ids: list[int]) -> ShapedText:
        """A prompt without images, tokenized: the ids the model runs (SigLIP pads to its text
        length); raises ValueError where the model takes no text."""
        return ShapedText(token_ids)


_PROCESSORS: dict[str, tuple[str, str]] = {
    # Dual-tower models: an image-only prompt is the vision tower's input.
    "CLIPModel": ("tidepool.multimodal.dual_tower", "DualTowerProcessor"),
    "CLIPVisionModelWithProjection": ("tidepool.multimodal.dual_tower", "DualTowerProcessor"),
    "SiglipModel": ("tidepool.multimodal.dual_tower", "DualTowerProcessor"),
    "SiglipVisionModel": ("tidepool.multimodal.dual_tower", "DualTowerProcessor"),
    "Siglip2Model": ("tidepool.multimodal.dual_tower", "NaFlexProcessor"),
    # Images among the prompt's tokens: one <|image_pad|> per image, expanded to its grid.
    "Qwen2VLModel": ("tidepool.multimodal.qwen2_vl", "Qwen2VLPromptProcessor"),
    "Qwen2VLForConditionalGeneration": ("tidepool.multimodal.qwen2_vl", "Qwen2VLPromptProcessor"),
    "ColQwen2ForRetrieval": ("tidepool.multimodal.qwen2_vl", "Qwen2VLPromptProcessor"),
    # PaliGemma's <image> tokens, one run of the vision tower's patches per image.
    "ColPaliForRetrieval": ("tidepool.multimodal.paligemma", "ColPaliPromptProcessor"),
}
"""Architecture (ModelConfig.architecture) → (module, class) of its ImagePromptProcessor."""


def register_image_processor(architecture: str, module: str, class_name: str) -> None:
    """Give `architecture` its prompt processor (imported when a model of it loads)."""
    _PROCESSORS[architecture] = (module, class_name)


def takes_images(architecture: str) -> bool:
    return architecture in _PROCESSORS


def processor_for(model_config: ModelConfig, tokenizer: Any) -> ImagePromptProcessor | None:
    """The model's prompt processor, or None for a text-only model."""
    entry = _PROCESSORS.get(model_config.architecture)
    if entry is None:
        return None
    cls = getattr(importlib.import_module(entry[0]), entry[1])
    return cls(model_config, tokenizer)


def load_image_processor(model_config: ModelConfig) -> Any:
    """The folder's Hugging Face image processor, its PIL implementation (transformers'
    default would be the torchvision one, which does not load beside the CPU torch)."""
    from transformers import AutoImageProcessor

    path = model_config.path
    names = ("preprocessor_config.json", "processor_config.json")  # the latter: ST 6's save
    if not any((path / name).is_file() for name in names):
        raise ValueError(
            f"{path} has neither {' nor '.join(names)}: the image processor (sizes, "
            "normalization) the model's images need is not in the folder"
        )
    return AutoImageProcessor.from_pretrained(str(path), backend="pil")


def processor_settings(image_processor: Any) -> str:
    """The processor's settings as stable JSON (they enter every image's identifier)."""
    return json.dumps(
        {"class": type(image_processor).__name__, **image_processor.to_dict()},
        sort_keys=True,
        default=str,
    )


def check_multi_modal_data(value: Any, modalities: tuple[str, ...]) -> dict[str, list[Any]] | str:
    """vLLM's multi_modal_data → {modality: [items]}, or why it cannot be read. Items must be
    decoded PIL images (multimodal/media.py decodes bytes, URLs and paths)."""
    from PIL import Image

    if not isinstance(value, dict):
        return f"multi_modal_data must be a dict such as {{'image': <PIL image>}}, got {type(value).__name__}"
    unknown = [k for k in value if k not in modalities]
    if unknown:
        known = [k for k in unknown if k in MODALITIES or k in ("audio", "video")]
        what = "this model takes" if known else "tidepool knows"
        return (
            f"multi_modal_data key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(repr(k) for k in unknown)} not supported: {what} "
            f"{', '.join(repr(m) for m in modalities)} only"
        )
    out: dict[str, list[Any]] = {}
    for modality, items in value.items():
        listed = list(items) if isinstance(items, (list, tuple)) else [items]
        if not listed:
            return f"multi_modal_data[{modality!r}] is an empty list"
        for item in listed:
            if not isinstance(item, Image.Image):
                return (
                    f"multi_modal_data[{modality!r}] must hold PIL images (PIL.Image.Image), "
                    f"found {type(item).__name__}"
                )
        out[modality] = listed
    return out
