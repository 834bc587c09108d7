"""Tiny random Qwen2-VL and ColQwen2 folders, their reference inputs, deterministic images.

A folder is what `save_pretrained` writes: config.json and weights, a byte-level BPE tokenizer
with Qwen2-VL's special tokens, and the PIL image processor's preprocessor_config.json with tiny
pixel bounds (28 x 28 .. 84 x 84 after its resize: grids of 2 x 2 .. 6 x 6 patches of 14 px,
1 .. 9 placeholder tokens per image). Vision: 2 blocks of 64 (2 heads of 32: the CPU kernel's
width); text: Qwen2, hidden 64, 2 layers, 4 query / 2 KV heads of 16, mrope_section [2, 3, 3].
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
PAD, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = range(7)
IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>"
MIN_PIXELS, MAX_PIXELS = 28 * 28, 84 * 84
CORPUS = [
    "Describe the image.",
    "Query: what does the chart show?",
    "a red square and a blue circle on a white page",
    "The quick brown fox jumps over the lazy dog.",
    "user assistant system picture document page",
]
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=IM_END,
    pad_token_id=PAD,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)
VISION = dict(depth=2, embed_dim=64, hidden_size=64, num_heads=2, initializer_range=0.2)
EMBEDDING_DIM = 24
"""ColQwen2's per-token vector width."""


def make_images(count: int, seed: int = 0) -> list[Image.Image]:
    """`count` PNG-decoded RGB images of varied sizes (each resized to another grid), fixed."""
    rng = np.random.RandomState(seed)
    sizes = [(30, 30), (60, 45), (84, 84), (20, 70), (50, 50), (33, 61)]
    images = []
    for i in range(count):
        h, w = sizes[i % len(sizes)]
        pixels = rng.randint(0, 256, size=(h, w, 3)).astype("uint8")
        yy, xx = np.mgrid[0:h, 0:w]
        pixels[..., i % 3] = ((xx * 5 + yy * 9 + 30 * i) % 256).astype("uint8")
        buffer = io.BytesIO()
        Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
        images.append(Image.open(io.BytesIO(buffer.getvalue())))
    return images


def save_tokenizer(folder: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.save_pretrained(str(folder))
    return len(fast)


def image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def qwen2_vl_config(vocab_size: int):
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config=dict(TEXT, vocab_size=vocab_size),
        vision_config=VISION,
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )


def build_qwen2_vl(folder: Path, seed: int = 40) -> Path:
    """A Qwen2VLForConditionalGeneration folder (GME's layout: an embedder by LAST pooling)."""
    from transformers import Qwen2VLForConditionalGeneration

    folder.mkdir(parents=True)
    config = qwen2_vl_config(save_tokenizer(folder))
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    torch.manual_seed(seed)
    Qwen2VLForConditionalGeneration(config).eval().save_pretrained(str(folder))
    image_processor().save_pretrained(str(folder))
    return folder


def build_colqwen2(folder: Path, seed: int = 41) -> Path:
    from transformers import ColQwen2Config, ColQwen2ForRetrieval

    folder.mkdir(parents=True)
    vlm = qwen2_vl_config(save_tokenizer(folder))
    config = ColQwen2Config(vlm_config=vlm.to_dict(), embedding_dim=EMBEDDING_DIM)
    config.architectures = ["ColQwen2ForRetrieval"]
    torch.manual_seed(seed)
    ColQwen2ForRetrieval(config).eval().save_pretrained(str(folder))
    image_processor().save_pretrained(str(folder))
    return folder


def reference_inputs(
    tokenizer, prompt: str, images: list[Image.Image], processor=None, ids: list[int] | None = None
) -> dict:
    """What Qwen2VLProcessor gives transformers for `prompt` (one <|image_pad|> per image,
    expanded to its grid's tokens) without its video processor (torchvision): input_ids,
    pixel_values, image_grid_thw, mm_token_type_ids, all with a batch of one. `processor`: the
    image processor (this module's by default); `ids`: the prompt already tokenized."""
    if ids is None:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    out: dict = {}
    grids: list[list[int]] = []
    if images:
        processed = (processor or image_processor())(images=images, return_tensors="pt")
        out["pixel_values"] = processed["pixel_values"]
        out["image_grid_thw"] = processed["image_grid_thw"]
        grids = processed["image_grid_thw"].tolist()
    expanded: list[int] = []
    grid_iter = iter(grids)
    for token in ids:
        if token == IMAGE_PAD:
            t, h, w = next(grid_iter)
            expanded.extend([IMAGE_PAD] * (t * h * w // 4))
        else:
            expanded.append(token)
    input_ids = torch.tensor([expanded])
    out["input_ids"] = input_ids
    out["mm_token_type_ids"] = (input_ids == IMAGE_PAD).int()
    return out
