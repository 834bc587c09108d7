"""The sweep's image side: inputs, tiny folders, references and tidepool's calls for the image models.

Inputs. `sweep_images(seed)`: PIL images made from the entry's seed, in the sizes and modes users
give (1 x 1 up to 120 x 48, below and above the processor's target, square, wide, tall; RGB,
RGBA / LA with a real alpha gradient, L, P, P with a transparent colour, 16-bit grey, CMYK),
decoded from PNG / JPEG bytes, so that the processor's conversion (alpha composited over white),
resize, crop and NaFlex / Qwen2-VL grids all run; one image comes twice. Texts are seeded word
sequences of several lengths under the model's text limit, as strings and as token ids. A case's
inputs are `Item`s (a prompt and its images); models that take both get images and texts mixed
in one list. tidepool runs them packed (one call) and alone (one call each); the reference runs
each alone through the model's own processor, loaded from the folder (`backend="pil"`).

References (transformers, as the per-model tests in tests/models/ use them):

    image_embed   CLIPModel / SiglipModel / Siglip2Model get_image_features / get_text_features
                  (pooler_output), CLIPVisionModelWithProjection image_embeds, SiglipVisionModel
                  pooler_output; tidepool's embed(normalize=False)
    multivector   ColPaliForRetrieval / ColQwen2ForRetrieval(**process_images / process_queries)
                  .embeddings at the unpadded tokens; tidepool's token_embed
    vlm_last      Qwen2-VL (Qwen2VLModel or ...ForConditionalGeneration's .model) last_hidden_state
    vlm_mean      at the last token / its mean over the tokens; tidepool's embed(normalize=False),
                  the default pooling (LAST) or pooler_config={"pooling_type": "MEAN"}

Bounds: tests/tolerances.py, with each per-model test's depth and longest reduction (the patch
GEMM: 3 x 8 x 8 = 192 for CLIP / SigLIP / ColPali, 3 x 2 x 14 x 14 = 1176 for Qwen2-VL), which
the grid entry carries as config["depth"] / config["reduction"].
"""

from __future__ import annotations

import contextlib
import importlib
import io
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
from PIL import Image

from sweep.grid import Case, Model

OUTPUTS = ("image_embed", "multivector", "vlm_last", "vlm_mean")
LAYOUTS = (
    "clip",
    "clip_vision",
    "siglip",
    "siglip_vision",
    "siglip2",
    "colpali",
    "colqwen2",
    "qwen2_vl",
    "qwen2_vl_base",
)
TAKES_TEXT = ("clip", "siglip", "siglip2", "colpali", "colqwen2", "qwen2_vl", "qwen2_vl_base")
SIZES = [
    (32, 32),
    (40, 50),
    (64, 20),
    (25, 70),
    (90, 90),
    (17, 33),
    (120, 48),
    (28, 28),
    (8, 60),
    (1, 1),
    (3, 150),
]
MODES = ["RGB", "RGBA", "L", "P", "LA", "CMYK", "RGB", "I;16", "P+transparency", "RGBA", "L"]
"""P+transparency: a palette image with a transparent colour (PNG's tRNS), which the
processors' convert_to_rgb composites over white like an alpha channel."""
WORDS = (
    "a red square and blue circle on white page the quick brown fox jumps over lazy dog "
    "describe image chart picture document table figure caption what does show capital france"
).split()


@dataclass(frozen=True)
class Item:
    """One prompt: its text and images (tidepool's form); `source`: the text the reference's
    processor is given where it differs (ColQwen2's queries: the raw query)."""

    text: str
    images: tuple[Any, ...] = field(default_factory=tuple)
    source: str | None = None
    token_ids: tuple[int, ...] | None = None
    """A token-id prompt ({"prompt_token_ids": ...}: no tokenizer on tidepool's side)."""

    def prompt(self) -> Any:
        if self.token_ids is not None:
            return {"prompt_token_ids": list(self.token_ids)}
        if not self.images:
            return self.text
        image = self.images[0] if len(self.images) == 1 else list(self.images)
        return {"prompt": self.text, "multi_modal_data": {"image": image}}


def sweep_images(seed: int, count: int = len(SIZES)) -> list[Image.Image]:
    """`count` images of SIZES (in a seeded order) and MODES, decoded from their bytes."""
    rng = np.random.RandomState(seed)
    sizes = [SIZES[i] for i in rng.permutation(len(SIZES))]
    images = []
    for i in range(count):
        h, w = sizes[i % len(sizes)]
        pixels = rng.randint(0, 256, size=(h, w, 3)).astype("uint8")
        yy, xx = np.mgrid[0:h, 0:w]
        pixels[..., i % 3] = ((xx * 7 + yy * 3 + 40 * i) % 256).astype("uint8")
        image = Image.fromarray(pixels, "RGB")
        mode = MODES[i % len(MODES)]
        if mode in ("RGBA", "LA"):  # a real alpha: compositing over white changes the pixels
            alpha = Image.fromarray((64 + (xx * 11 + yy * 5) % 192).astype("uint8"), "L")
            image = image.convert(mode)
            image.putalpha(alpha)
        elif mode == "I;16":  # 16-bit grey, some values past 255 (convert("RGB") saturates them)
            grey = pixels[..., 0].astype("uint16") + 40
            image = Image.fromarray(grey)
        elif mode == "P+transparency":
            image = image.convert("P")
            image.info["transparency"] = int(np.asarray(image)[0, 0])
        elif mode != "RGB":
            image = image.convert(mode)
        buffer = io.BytesIO()
        if mode == "P+transparency":
            image.save(buffer, format="PNG", transparency=image.info["transparency"])
        else:
            image.save(buffer, format="JPEG" if mode == "CMYK" else "PNG")
        images.append(Image.open(io.BytesIO(buffer.getvalue())))
    return images


def sweep_texts(seed: int, tokenizer, limit: int, count: int = 6) -> list[str]:
    """Seeded word sequences of 1 word up to `limit` tokens (the tokenizer's, specials in)."""
    rng = random.Random(seed)
    texts: list[str] = []
    for n in (1, 2, 4, 7, 12, 20, 40, 70)[: count + 2]:
        words = [rng.choice(WORDS) for _ in range(n)]
        while len(words) > 1 and len(tokenizer(" ".join(words))["input_ids"]) > limit:
            words.pop()
        text = " ".join(words)
        if text not in texts:
            texts.append(text)
    return texts[:count]


# ----------------------------------------------------------------------------- folders


def build(spec: Model, root: Path) -> Path:
    """The tiny folder of an image entry: the per-model tests' builders (tests/*_models.py),
    with the entry's options patched into their sizes (`_patched`)."""
    with _patched(spec.config.get("patch", {})):
        return _build(spec, root / "hf")


@contextlib.contextmanager
def _patched(patch: dict[str, Any]) -> Iterator[None]:
    """The entry's options, as changes to the builders' module-level sizes while they build:
    {"module.DICT": {key: value}} updates a dict (CLIP_VISION, TEXT, ...), {"module.NAME":
    value} replaces a constant (IMAGE_SIZE, MAX_PIXELS, ...); all restored afterwards."""
    with contextlib.ExitStack() as stack:
        for target, value in patch.items():
            module_name, name = target.rsplit(".", 1)
            module = importlib.import_module(module_name)
            current = getattr(module, name)
            if isinstance(current, dict) and isinstance(value, dict):
                stack.enter_context(mock.patch.dict(current, value))
            else:
                stack.enter_context(mock.patch.object(module, name, value))
        yield


def _build(spec: Model, folder: Path) -> Path:
    import multimodal_models as mm
    import paligemma_models
    import qwen2_vl_models

    layout, seed, options = spec.layout, spec.seed, spec.config.get("options", {})
    if layout in ("clip", "clip_vision"):
        mm.build_clip(folder, seed, spec.hf_class)
    elif layout in ("siglip", "siglip_vision"):
        mm.build_siglip(folder, seed, spec.hf_class, **options)
    elif layout == "siglip2":
        mm.build_siglip2(folder, seed, **options)
    elif layout == "colpali":
        paligemma_models.build_colpali(folder, seed)
    elif layout == "colqwen2":
        qwen2_vl_models.build_colqwen2(folder, seed)
    elif layout == "qwen2_vl":
        qwen2_vl_models.build_qwen2_vl(folder, seed)
    elif layout == "qwen2_vl_base":
        _build_qwen2_vl_base(folder, seed)
    else:
        raise ValueError(f"unknown image layout {layout!r}")
    return folder


def _build_qwen2_vl_base(folder: Path, seed: int) -> None:
    """A Qwen2VLModel folder (the body alone: language_model.*, visual.*)."""
    from qwen2_vl_models import image_processor, qwen2_vl_config, save_tokenizer
    from transformers import Qwen2VLModel

    folder.mkdir(parents=True)
    config = qwen2_vl_config(save_tokenizer(folder))
    config.architectures = ["Qwen2VLModel"]
    torch.manual_seed(seed)
    Qwen2VLModel(config).eval().save_pretrained(str(folder))
    image_processor().save_pretrained(str(folder))


# ----------------------------------------------------------------------------- inputs


def inputs(model: Model, folder: Path) -> list[Item]:
    """Images and (where the model takes them) texts, mixed in one list."""
    from transformers import AutoTokenizer

    images = sweep_images(model.seed)
    if model.layout not in TAKES_TEXT:
        return [Item("", (image,)) for image in [*images, images[0]]]
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if model.layout.startswith("qwen2_vl"):
        return _qwen2_vl_items(model, tokenizer, images)
    limit = int(model.config.get("text_limit", 32))
    texts = sweep_texts(model.seed, tokenizer, limit)
    if model.layout == "colqwen2":
        queries = [Item(_colqwen2_query(folder, t), (), t) for t in texts]
    else:
        queries = [Item(t) for t in texts]
    if model.layout in ("clip", "siglip", "siglip2"):  # the same texts as token ids
        queries += [Item(t, token_ids=tuple(tokenizer(t)["input_ids"])) for t in texts[1::2]]
    pages = [Item("", (image,)) for image in images]
    pages.append(Item("", (images[0],)))  # the same image twice in one call
    mixed: list[Item] = []
    for i in range(max(len(pages), len(queries))):  # interleaved: images beside texts
        mixed += pages[i : i + 1] + queries[i : i + 1]
    return mixed


def _colqwen2_query(folder: Path, text: str) -> str:
    """ColQwen2Processor's query ("Query: " + text + 10 pads + newline): tidepool takes query
    texts as they are (as tests/models/test_colqwen2.py gives them)."""
    processor = _colqwen2_processor(folder)
    ids = processor.process_queries([text])["input_ids"][0]
    return processor.tokenizer.decode(ids)


def _qwen2_vl_items(model: Model, tokenizer, images: list) -> list[Item]:
    """Texts alone, an image alone, images inside texts, two images in one prompt; and a text
    of 33+ tokens (two full prefix-cache blocks of 16) before or after an image, with two
    images of the same size (the same token ids, other pixels: the cache must not confuse
    them) and one of them again (the same image: a legitimate hit)."""
    from qwen2_vl_models import IMAGE_PROMPT

    texts = sweep_texts(model.seed, tokenizer, 40, count=5)
    long = " ".join(texts)
    assert len(tokenizer(long)["input_ids"]) > 32, long
    same_a, same_b = images[5].resize((56, 56)), images[6].resize((56, 56))
    return [
        Item("<|im_start|>" + IMAGE_PROMPT + texts[0] + "<|im_end|>", (images[0],)),
        Item(texts[1]),
        Item(IMAGE_PROMPT + " " + texts[2] + " " + IMAGE_PROMPT, (images[1], images[2])),
        Item(IMAGE_PROMPT, (images[3],)),
        Item(texts[3] + " " + IMAGE_PROMPT + " " + texts[4], (images[4],)),
        Item(long + IMAGE_PROMPT, (same_a,)),
        Item(long + IMAGE_PROMPT, (same_b,)),
        Item(IMAGE_PROMPT + long, (same_a,)),
        Item(IMAGE_PROMPT + long, (same_b,)),
        Item(IMAGE_PROMPT + long, (same_a,)),
        Item(texts[4]),
        Item(texts[2], token_ids=tuple(tokenizer(texts[2])["input_ids"])),
        Item(IMAGE_PROMPT, (images[7],)),
        Item(IMAGE_PROMPT, (images[8],)),
    ]


# ----------------------------------------------------------------------------- references


def _hf(model: Model, folder: Path):
    import transformers

    cls = getattr(transformers, model.hf_class)
    return cls.from_pretrained(str(folder), dtype=torch.float32).eval()


def _image_processor(folder: Path):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(folder), backend="pil")


@torch.inference_mode()
def ref_image_embed(model: Model, folder: Path, items: list[Item]) -> list[torch.Tensor]:
    from transformers import AutoTokenizer

    hf = _hf(model, folder)
    images = _image_processor(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    out = []
    for item in items:
        if item.images:
            pixels = images(images=list(item.images), return_tensors="pt")
            if model.layout == "clip_vision":
                out.append(hf(**pixels).image_embeds[0])
            elif model.layout == "siglip_vision":
                out.append(hf(**pixels).pooler_output[0])
            else:
                out.append(hf.get_image_features(**pixels).pooler_output[0])
            continue
        out.append(hf.get_text_features(**_text_batch(model, tokenizer, item)).pooler_output[0])
    return out


def _text_batch(model: Model, tokenizer, item: Item) -> dict:
    """CLIP: the tokenizer's ids as they are; SigLIP's: padded to the fixed length as
    SiglipProcessor / Siglip2Processor do (padding="max_length"), a token-id prompt by the
    tokenizer's own pad (the attention_mask where its model_input_names has one)."""
    fixed = model.layout != "clip"
    length = int(model.config["text_limit"])
    pad = {"padding": "max_length", "max_length": length} if fixed else {}
    if item.token_ids is not None:
        return tokenizer.pad({"input_ids": [list(item.token_ids)]}, return_tensors="pt", **pad)
    return tokenizer([item.text], return_tensors="pt", **pad)


def _colqwen2_processor(folder: Path):
    from transformers import AutoTokenizer, ColQwen2Processor

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return ColQwen2Processor(image_processor=_image_processor(folder), tokenizer=tokenizer)


def _colpali_processor(folder: Path):
    from transformers import AutoTokenizer, ColPaliProcessor

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return ColPaliProcessor(image_processor=_image_processor(folder), tokenizer=tokenizer)


@torch.inference_mode()
def ref_multivector(model: Model, folder: Path, items: list[Item]) -> list[torch.Tensor]:
    hf = _hf(model, folder)
    processor = (_colpali_processor if model.layout == "colpali" else _colqwen2_processor)(folder)
    out = []
    for item in items:
        if item.images:
            batch = processor.process_images(list(item.images))
        else:
            batch = processor.process_queries([item.source or item.text])
        rows = hf(**batch).embeddings[0]
        out.append(rows[batch["attention_mask"][0].bool()])
    return out


def _qwen2_vl_inputs(folder: Path, tokenizer, item: Item) -> dict:
    """qwen2_vl_models.reference_inputs with the folder's own image processor."""
    from qwen2_vl_models import reference_inputs

    ids = list(item.token_ids or tokenizer(item.text, add_special_tokens=False)["input_ids"])
    images = list(item.images) if item.images else []
    processor = _image_processor(folder) if images else None
    return reference_inputs(tokenizer, "", images, processor=processor, ids=ids)


@torch.inference_mode()
def _ref_vlm(model: Model, folder: Path, items: list[Item], pooling: str) -> list[torch.Tensor]:
    from transformers import AutoTokenizer

    hf = _hf(model, folder)
    body = hf.model if hasattr(hf, "lm_head") else hf
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    out = []
    for item in items:
        hidden = body(**_qwen2_vl_inputs(folder, tokenizer, item)).last_hidden_state[0]
        out.append(hidden[-1] if pooling == "last" else hidden.mean(0))
    return out


def ref_vlm_last(model: Model, folder: Path, items: list[Item]) -> list[torch.Tensor]:
    return _ref_vlm(model, folder, items, "last")


def ref_vlm_mean(model: Model, folder: Path, items: list[Item]) -> list[torch.Tensor]:
    return _ref_vlm(model, folder, items, "mean")


REFERENCES = {
    "image_embed": ref_image_embed,
    "multivector": ref_multivector,
    "vlm_last": ref_vlm_last,
    "vlm_mean": ref_vlm_mean,
}


# ----------------------------------------------------------------------------- tidepool


def run_tidepool(llm, output: str, items: list[Item]) -> list[torch.Tensor]:
    from tidepool import PoolingParams

    prompts = [item.prompt() for item in items]
    if output == "multivector":
        outs = llm.encode(prompts, pooling_task="token_embed", use_tqdm=False)
        return [o.outputs.data for o in outs]
    raw = PoolingParams(use_activation=False)  # embed: no normalization
    outs = llm.embed(prompts, pooling_params=raw, use_tqdm=False)
    return [torch.tensor(o.outputs.embedding) for o in outs]


def set_backend(llm, case: Case) -> None:
    """The case's encoder backend on every tower that takes one: the dual towers' one backend,
    ColPali's text layers and SigLIP tower, Qwen2-VL's vision tower (its text layers are a
    decoder's, on the decoder backend the loader chose)."""
    from tidepool.attention.backend import BUCKETED_SDPA, CPU_KERNEL, AttentionSpec

    backend = {"sdpa": BUCKETED_SDPA, "kernel": CPU_KERNEL}[case.backend or "sdpa"]
    model = llm.engine.model_runner.model
    cpu, dtype = torch.device("cpu"), getattr(torch, case.dtype)
    if case.model.layout.startswith(("qwen2_vl", "colqwen2")):
        spec = model.visual.attention_spec(cpu, dtype)
        assert backend.supports(spec), f"{case.id}: {backend.name} does not take {spec}"
        model.visual.set_encoder_backend(backend.for_spec(spec))
        return
    spec = model.attention_spec(cpu, dtype)
    assert backend.supports(spec), f"{case.id}: {backend.name} does not take {spec}"
    model.set_attention_backend(backend.for_spec(spec))
    if case.model.layout == "colpali":
        tower = model.vision_tower
        tower_spec = AttentionSpec(cpu, dtype, tower.head_dim, tower.num_patches)
        assert backend.supports(tower_spec), f"{case.id}: {backend.name} for the vision tower"
        tower.set_attention_backend(backend.for_spec(tower_spec))


def guard(case: Case, items: list[Item], ref: list[torch.Tensor], rtol: float) -> None:
    """Different inputs have references further apart than 10x the float32 bound (a model
    answering one constant, or ignoring the pixels, would pass nothing), and raw outputs are not
    unit vectors (a tidepool that normalized would then fail, not pass)."""
    if case.output == "multivector":  # a page's last rows are its fixed suffix: all rows
        rows = torch.stack([r.mean(0) for r in ref]).double()
    else:
        rows = torch.stack([r.reshape(-1, r.shape[-1])[-1] for r in ref]).double()
    for i, a in enumerate(items):
        for j in range(i + 1, len(items)):
            if _same(a, items[j]):
                continue
            apart = float((rows[i] - rows[j]).norm() / rows[j].norm())
            assert apart > 10 * rtol, f"{case.id}: items {i} and {j} only {apart:.2e} apart"
    if case.output != "multivector":
        norms = rows.norm(dim=-1)
        assert (norms - 1).abs().max() > 1e-2, f"{case.id}: reference vectors of norm 1"


def _same(a: Item, b: Item) -> bool:
    if a.text != b.text or len(a.images) != len(b.images):
        return False
    return all(
        x.mode == y.mode and x.size == y.size and x.tobytes() == y.tobytes()
        for x, y in zip(a.images, b.images, strict=True)
    )
