"""Tiny random CLIP / SigLIP folders and deterministic images, shared by the multimodal tests.

Every folder is what `save_pretrained` writes for a dual-tower model: config.json and weights,
the tokenizer, and the PIL image processor's preprocessor_config.json (32 px images, 8 px
patches: 16 patches). Images are PNG-decoded PIL images built from a fixed seed, in the sizes and
modes a user gives (RGB of other sizes, RGBA, L, P), so the processor's resize, crop and
conversion all run.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image

IMAGE_SIZE = 32
PATCH_SIZE = 8
CLIP_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=77,
)
CLIP_VISION = dict(  # heads of 32: the CPU kernel's width, where it builds
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=IMAGE_SIZE,
    patch_size=PATCH_SIZE,
)
PROJECTION_DIM = 32
SIGLIP_TEXT_LEN = 16
"""SigLIP's text positions (max_position_embeddings): its texts are padded to this length."""


def make_images(count: int, seed: int = 0) -> list[Image.Image]:
    """`count` PNG-decoded images of varied sizes and modes (RGB, RGBA, L, P), fixed by `seed`."""
    rng = np.random.RandomState(seed)
    sizes = [(40, 50), (32, 32), (64, 20), (25, 70), (33, 47), (90, 90)]
    modes = ["RGB", "RGB", "RGBA", "L", "RGB", "P"]
    images = []
    for i in range(count):
        h, w = sizes[i % len(sizes)]
        base = rng.randint(0, 256, size=(h, w, 3)).astype("uint8")
        # Smooth structure plus noise: resizing differences show up in the pixel values.
        yy, xx = np.mgrid[0:h, 0:w]
        base[..., i % 3] = ((xx * 7 + yy * 3 + 40 * i) % 256).astype("uint8")
        image = Image.fromarray(base, "RGB")
        mode = modes[i % len(modes)]
        if mode == "RGBA":
            image = image.convert("RGBA")
        elif mode == "L":
            image = image.convert("L")
        elif mode == "P":
            image = image.convert("P")
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        images.append(Image.open(io.BytesIO(buffer.getvalue())))
    return images


def save_byte_bpe_tokenizer(folder: Path, special: list[str], max_length: int, pad_eos: bool):
    """A byte-level BPE tokenizer with CLIP's <|startoftext|> ... <|endoftext|> template."""
    from conftest import TINY_TEXTS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TINY_TEXTS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{special[0]} $A {special[1]}",
        special_tokens=[(special[0], 0), (special[1], 1)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=special[0],
        eos_token=special[1],
        pad_token=special[1] if pad_eos else special[2],
        model_max_length=max_length,
    )
    fast.save_pretrained(str(folder))
    return fast


def save_clip_image_processor(folder: Path) -> None:
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    ).save_pretrained(str(folder))


def build_clip(folder: Path, seed: int = 7, architecture: str = "CLIPModel") -> torch.nn.Module:
    """A tiny CLIPModel (or one of its *WithProjection towers) saved in `folder`, in eval mode."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = save_byte_bpe_tokenizer(
        folder, ["<|startoftext|>", "<|endoftext|>", "<|pad|>"], 77, pad_eos=False
    )
    save_clip_image_processor(folder)
    text = transformers.CLIPTextConfig(
        vocab_size=len(tokenizer), bos_token_id=0, eos_token_id=1, pad_token_id=2, **CLIP_TEXT
    )
    vision = transformers.CLIPVisionConfig(**CLIP_VISION)
    config = transformers.CLIPConfig(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        projection_dim=PROJECTION_DIM,
        initializer_factor=5.0,  # attention far from uniform: a dropped mask shows
    )
    torch.manual_seed(seed)
    model = transformers.CLIPModel(config).eval()
    if architecture == "CLIPModel":
        out: torch.nn.Module = model
    else:
        sub = text if "Text" in architecture else vision
        sub.projection_dim = PROJECTION_DIM
        out = getattr(transformers, architecture)(sub).eval()
        own = out.state_dict()
        whole = model.state_dict()
        out.load_state_dict(
            {k: whole.get(k, whole.get(f"vision_model.{k}", v)) for k, v in own.items()},
            strict=False,
        )
    out.save_pretrained(str(folder))
    return out


SIGLIP_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,  # heads of 32 in both towers: one backend (the CPU kernel's width)
    max_position_embeddings=SIGLIP_TEXT_LEN,
)


def save_siglip_tokenizer(
    folder: Path, mask_pads: bool, max_length: int = SIGLIP_TEXT_LEN, padding_side: str = "right"
) -> object:
    """A tiny fast tokenizer with SigLIP's template ("X </s>", no BOS, pads of </s>,
    model_max_length SIGLIP_TEXT_LEN; a unigram model trained on the shared test texts).
    transformers' own SiglipTokenizer is SentencePiece-only (no tokenizer.json), which
    tidepool's input processor does not take. mask_pads False: model_input_names
    ["input_ids"], so the tokenizer gives no attention_mask and the pads are attended."""
    from conftest import TINY_TEXTS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "</s>", "<unk>"]
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=120, special_tokens=special, unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(TINY_TEXTS * 3, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="</s>",
        pad_token="</s>",
        unk_token="<unk>",
        model_max_length=max_length,
        padding_side=padding_side,
        model_input_names=["input_ids", "attention_mask"] if mask_pads else ["input_ids"],
    )
    fast.save_pretrained(str(folder))
    return fast


def _sharpen(model: torch.nn.Module) -> None:
    """transformers' SigLIP init (xavier attention, zero biases, unit LayerNorms) gives near
    uniform attention on a tiny model: scale the queries / keys and perturb biases and norms
    so that a dropped mask, a wrong row or position shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "in_proj_weight", "probe")):
                param.mul_(4.0)
            elif name.endswith("bias") or "layer_norm" in name or "layernorm" in name:
                param.add_(0.1 * torch.randn_like(param))


def build_siglip(
    folder: Path,
    seed: int = 7,
    architecture: str = "SiglipModel",
    mask_pads: bool = True,
    tokenizer=None,
) -> torch.nn.Module:
    """A tiny SiglipModel (or SiglipVisionModel) saved in `folder` with its tokenizer (this
    module's fast one, or `tokenizer` as given) and PIL image processor (32 px resized without
    crop, 8 px patches), in eval mode."""
    import transformers
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        tokenizer = save_siglip_tokenizer(folder, mask_pads)
    images = SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    transformers.SiglipProcessor(images, tokenizer).save_pretrained(str(folder))
    text = transformers.SiglipTextConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **SIGLIP_TEXT,
    )
    vision = transformers.SiglipVisionConfig(**CLIP_VISION)
    torch.manual_seed(seed)
    if architecture == "SiglipVisionModel":
        model: torch.nn.Module = transformers.SiglipVisionModel(vision).eval()
    else:
        config = transformers.SiglipConfig(
            text_config=text.to_dict(), vision_config=vision.to_dict()
        )
        model = transformers.SiglipModel(config).eval()
    _sharpen(model)
    model.save_pretrained(str(folder))
    return model


SIGLIP2_TEXT_LEN = 64
"""Siglip2Processor pads texts to max_length 64 (its text_kwargs), whatever the tokenizer says."""
SIGLIP2_MAX_PATCHES = 16
"""The tiny NaFlex processor's max_num_patches (8 px patches): images of up to 16 patches at
their own aspect ratio (4 x 4, 2 x 8, 3 x 5, ...), from a 4 x 4 position grid."""


def build_siglip2(
    folder: Path, seed: int = 7, padding_side: str = "right", mask_pads: bool = True
) -> torch.nn.Module:
    """A tiny Siglip2Model saved in `folder` with a fast tokenizer (texts padded to 64; its
    padding side and mask as given: Siglip2Tokenizer's own default is left) and the PIL NaFlex
    image processor (8 px patches, at most 16 per image, RGB conversion on)."""
    import transformers
    from transformers.models.siglip2.image_processing_pil_siglip2 import (
        Siglip2ImageProcessorPil,
    )

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = save_siglip_tokenizer(folder, mask_pads, SIGLIP2_TEXT_LEN, padding_side)
    images = Siglip2ImageProcessorPil(
        patch_size=PATCH_SIZE, max_num_patches=SIGLIP2_MAX_PATCHES, do_convert_rgb=True
    )
    images.save_pretrained(str(folder))
    text = transformers.Siglip2TextConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **{**SIGLIP_TEXT, "max_position_embeddings": SIGLIP2_TEXT_LEN},
    )
    vision = {k: v for k, v in CLIP_VISION.items() if k != "image_size"}
    vision = transformers.Siglip2VisionConfig(**vision, num_patches=16)
    config = transformers.Siglip2Config(text_config=text.to_dict(), vision_config=vision.to_dict())
    torch.manual_seed(seed)
    model = transformers.Siglip2Model(config).eval()
    _sharpen(model)
    model.save_pretrained(str(folder))
    return model
