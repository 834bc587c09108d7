"""ColPali prompts: ColPaliProcessor's page prompt for an image, its query format for a text.

    {"prompt": "", "multi_modal_data": {"image": page}}
        → "<image>" x N + "<bos>" + "Describe the image." + "\n"   (process_images)
    "what does the chart show?"
        → "<bos>" + "Question: " + text + "<pad>" x 10 + "\n"       (process_queries: the pad
                                                                     token is its query
                                                                     augmentation token)

N is the vision tower's patches ((image_size / patch_size)², 1024 for a 448 px ColPali), the
folder's `image_seq_length` where it saves one (checked equal). The image is
transformers' PIL SiglipImageProcessor with the folder's preprocessor_config.json (resize to
image_size without a crop, rescale, normalize): pixel_values [3, H, W] per feature.

A text prompt is wrapped in the query format before tokenizing (`shape_prompt`); a prompt already
in that format (starting with the <bos> text and "Question: ") is taken as it is, so that inputs
written as process_queries writes them keep their ids. A tokenizer that adds its own <bos>
(Gemma's) gets the text without the "<bos>" text: one <bos> either way. Prompts with an image: "" takes the page
prompt; a non-empty prompt must hold one "<image>" per image, where the images go, and is
tokenized as given (PaliGemma's own layout is "<image>"s first).
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

IMAGE_TOKEN = "<image>"
VISUAL_PROMPT_PREFIX = "Describe the image."
QUERY_PREFIX = "Question: "
QUERY_AUGMENTATION = 10
"""transformers' ColPaliProcessor defaults: visual_prompt_prefix, query_prefix, and the number
of query augmentation tokens (its pad token) after a query."""


class ColPaliPromptProcessor(ImagePromptProcessor):
    def __init__(self, model_config: ModelConfig, tokenizer: Any) -> None:
        super().__init__(model_config, tokenizer)
        vlm = model_config.hf_config.vlm_config
        vision = vlm.vision_config
        self.image_token_id = int(vlm.image_token_id)
        self.num_image_tokens = (int(vision.image_size) // int(vision.patch_size)) ** 2
        self.image_processor = load_image_processor(model_config)
        saved = getattr(self.image_processor, "image_seq_length", None)
        if saved is not None and int(saved) != self.num_image_tokens:
            raise ValueError(
                f"preprocessor_config.json has image_seq_length {saved}, the vision config "
                f"{self.num_image_tokens} patches per image ({vision.image_size} px / "
                f"{vision.patch_size} px patches): the folder disagrees with itself"
            )
        self.settings = processor_settings(self.image_processor)
        self.bos = _required_token(tokenizer, "bos_token")
        self.pad = _required_token(tokenizer, "pad_token")
        self.page_prompt = f"{IMAGE_TOKEN}{self.bos}{VISUAL_PROMPT_PREFIX}\n"
        self.query_start = f"{self.bos}{QUERY_PREFIX}"
        self.text_bos = _text_bos(tokenizer, self.bos)

    def shape_prompt(self, text: str) -> str:
        """A text prompt → ColPaliProcessor.process_queries' text for it (without the <bos>
        where the tokenizer adds its own: the ids come out the same)."""
        if text.startswith(self.query_start):
            body = text.removeprefix(self.bos)
        else:
            body = f"{QUERY_PREFIX}{text}{self.pad * QUERY_AUGMENTATION}\n"
        return body if self.text_bos == "" else self.bos + body

    def process(self, prompt: str, images: Sequence[Any], task: str) -> ProcessedPrompt:
        if not prompt and len(images) == 1:
            prompt = self.page_prompt
        ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        slots = [i for i, token in enumerate(ids) if token == self.image_token_id]
        if len(slots) != len(images):
            raise ValueError(
                f"the prompt has {len(slots)} {IMAGE_TOKEN} for {len(images)} image(s): "
                f"ColPaliForRetrieval takes one {IMAGE_TOKEN} per image, where the image goes "
                '(or the prompt "" with one image: ColPaliProcessor\'s page prompt)'
            )
        processed = self.image_processor(images=list(images), return_tensors="pt")
        pixels = processed["pixel_values"]
        out: list[int] = []
        features = []
        previous = 0
        for index, (image, slot) in enumerate(zip(images, slots, strict=True)):
            out.extend(ids[previous:slot])
            features.append(
                MultiModalFeature(
                    modality="image",
                    data={"pixel_values": pixels[index]},
                    identifier=image_hash(image, self.settings),
                    offset=len(out),
                    length=self.num_image_tokens,
                )
            )
            out.extend([self.image_token_id] * self.num_image_tokens)
            previous = slot + 1
        out.extend(ids[previous:])
        return ProcessedPrompt(out, tuple(features))


def _text_bos(tokenizer: Any, bos: str) -> str:
    """What a query text must start with so that the tokenizer's ids begin with one <bos>:
    "" where the tokenizer adds it (Gemma's add_bos_token; ColPaliProcessor turns it off and
    writes "<bos>" instead: the same ids), else the <bos> text. A tokenizer that adds anything
    else (an EOS) would change the ids: refused."""
    added = list(tokenizer("", add_special_tokens=True)["input_ids"])
    if not added:
        return bos
    if added == [tokenizer.convert_tokens_to_ids(bos)]:
        return ""
    raise ValueError(
        f"the tokenizer adds {added} to every text; ColPaliProcessor tokenizes with the "
        "tokenizer's own special tokens off, and tidepool cannot turn them off for its texts"
    )


def _required_token(tokenizer: Any, attribute: str) -> str:
    token = getattr(tokenizer, attribute, None)
    if not token:
        raise ValueError(f"the tokenizer has no {attribute}: ColPaliProcessor's prompts need it")
    return str(token)
