"""CLIP image embedding: tidepool vs sentence-transformers and vLLM, images/s on the same images.

The model has CLIP ViT-B/32's shape with random weights (fixed seed): a vision tower of 224 px
images in 32 px patches (49 patches + the class token), 12 layers of 768, 12 heads, MLP 3072, and
a CLIP-base text tower (12 layers of 512, 8 heads, MLP 2048, 77 positions), both projected to
512. transformers' CLIPModel is saved with a byte-level BPE tokenizer and the PIL CLIP image
processor (shortest edge 224, centre crop 224), then loaded by sentence-transformers 6 (its
Transformer module: CLIPModel.get_image_features) and saved again as its own folder
(modules.json): both sides load that folder. The images are PNG-decoded, of varied sizes and
modes (RGB, RGBA, L, P; 96 to 640 px sides), so resizing, cropping and RGB conversion are part of
the work timed on both sides.

The third side is vLLM 0.32's CPU build (--vllm-python, /work/venv-vllm; --no-vllm leaves it out)
in its own process (image_worker.py, with peers.py's CPU environment for vLLM): `vllm.LLM(model=
..., runner="pooling", dtype="float32")`, prefix caching and its multimodal processor cache off
(on, its rounds after the first reuse the first round's results: 716 images/s on
16 images), `LLM.embed` on
`{"prompt": "", "multi_modal_data": {"image": image}}` (vLLM's CLIP takes an image with an empty
prompt only); its pooler is CLIP's default there, LAST, the class token through the visual
projection, L2-normalized (the cosine does not see the scale). It loads the plain transformers
folder build_clip writes first (root/"transformers"; the sentence-transformers folder loads too).
It reads the images from lossless PNG copies of the same decoded images, opened once before its
rounds, so all three time preprocessing and the model. Its wall and CPU seconds are its own
process's. Two things of the model's making are vLLM's conditions: CLIP's special tokens come
after the trained vocabulary, as in CLIP's own (vLLM takes token id 0 for its image placeholder and
asserts no special token has it), and the text width must not exceed projection_dim (its
clip.py raises NotImplementedError): ViT-B/32's, 512 both, loads; --quick's (text 64, projection
32) does not (at 64 both, vLLM's input-embedding buffer, 512 wide, does not match), so there
vLLM's error is printed in place of its figures, as for any model or layout it refuses.

The sides run in float32 on all cores, the order rotating each round (A B C, B C A, ...); a ratio
quoted is the median of the per-round ratios; the vectors are checked to agree (min cosine vs
tidepool's) so all figures are for the same work. Then tidepool's bfloat16 (cosine vs its float32)
and int8 (quantization="int8"), or the refusal message where tidepool does not take them for CLIP.

    python benchmarks/clip_images.py [--images 256] [--rounds 3] [--batch-size 32] [--quick]
        [--no-variants] [--vllm-python PATH] [--no-vllm]
"""

from __future__ import annotations

import argparse
import io
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# tidepool sets OpenMP's wait policy when imported, before torch loads: the same for all sides.
import tidepool  # noqa: F401

# isort: split
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from corpus import make_corpus  # noqa: E402

VIT_B32 = {
    "vision": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=224,
        patch_size=32,
    ),
    "text": dict(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=8,
        max_position_embeddings=77,
    ),
    "projection_dim": 512,
}
QUICK = {  # --quick: a smoke run (heads of 32 and 64, as the CPU kernel builds)
    "vision": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    ),
    "text": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
    ),
    "projection_dim": 32,
}
SIZES = [(224, 224), (320, 240), (480, 640), (96, 128), (300, 500), (640, 360), (256, 256)]
MODES = ["RGB", "RGB", "RGBA", "L", "RGB", "P", "RGB"]


def make_images(count: int, seed: int = 0) -> list[Image.Image]:
    """`count` PNG-decoded images, sizes and modes cycling through SIZES / MODES, fixed by seed."""
    rng = np.random.RandomState(seed)
    images = []
    for i in range(count):
        w, h = SIZES[i % len(SIZES)]
        yy, xx = np.mgrid[0:h, 0:w]
        pixels = rng.randint(0, 64, size=(h, w, 3)).astype(np.int64)
        pixels[..., i % 3] += (xx * 3 + yy * 5 + 17 * i) % 192  # structure: resizing shows
        image = Image.fromarray(pixels.astype(np.uint8), "RGB").convert(MODES[i % len(MODES)])
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        decoded = Image.open(io.BytesIO(buffer.getvalue()))
        decoded.load()  # decoded here, not inside whichever side's round touches it first
        images.append(decoded)
    return images


def save_tokenizer(folder: Path) -> tuple[int, int, int]:
    """A byte-level BPE with CLIP's <|startoftext|> ... <|endoftext|> template (trained on the
    benchmark corpus: the text tower is loaded, not timed), the two special tokens after the
    trained entries as in CLIP's own vocabulary (49406, 49407): vLLM's CLIP takes id 0 for its
    image placeholder and refuses a tokenizer whose special ids include 0. Returns the vocabulary
    size and the two special ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|startoftext|>", "<|endoftext|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(make_corpus(200), trainer)
    tok.add_special_tokens(special)
    bos, eos = (tok.token_to_id(t) for t in special)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{special[0]} $A {special[1]}",
        special_tokens=[(special[0], bos), (special[1], eos)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=special[0],
        eos_token=special[1],
        pad_token=special[1],
        model_max_length=77,
    )
    fast.save_pretrained(str(folder))
    return len(fast), bos, eos


def build_clip(root: Path, shape: dict, seed: int = 0) -> Path:
    """transformers' CLIPModel of `shape` (random, seeded) → a sentence-transformers folder."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    raw = root / "transformers"
    raw.mkdir()
    vocab, bos, eos = save_tokenizer(raw)
    size = shape["vision"]["image_size"]
    CLIPImageProcessorPil(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    ).save_pretrained(str(raw))
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, **shape["text"]),
        vision_config=shape["vision"],
        projection_dim=shape["projection_dim"],
    )
    torch.manual_seed(seed)
    transformers.CLIPModel(config).eval().save_pretrained(str(raw))
    folder = root / "st"
    SentenceTransformer(str(raw), device="cpu").save(str(folder))
    return folder


def cpu_flags() -> str:
    """The CPU's model and the flags that decide the kernel and GEMM paths (AVX-512, VNNI, AMX:
    tidepool's one reader, kernels/cpu_features.py)."""
    from tidepool.kernels.cpu_features import describe

    return describe()


def image_prompts(images: list[Image.Image]) -> list[dict]:
    return [{"prompt": "", "multi_modal_data": {"image": im}} for im in images]


def tidepool_embed(llm) -> Callable[[list[Image.Image]], torch.Tensor]:
    def run(images: list[Image.Image]) -> torch.Tensor:
        outs = llm.embed(image_prompts(images), use_tqdm=False)
        return torch.tensor([o.outputs.embedding for o in outs])

    return run


def alternate(runs: dict[str, Callable[[], object]], rounds: int, count: int):
    """image_worker.alternate in images/s."""
    from image_worker import alternate as rotate

    return rotate(runs, rounds, count, "images", 1)


def vllm_side(python: str, folder: Path, images: list, tmp: Path):
    """vLLM 0.32 on the plain transformers folder build_clip wrote (its own layout): a worker
    process (image_worker.py) over the same images saved as PNG. Returns (run, None), or (None,
    vLLM's refusal)."""
    from image_worker import ImageWorker, save_pngs

    worker = ImageWorker(python, folder, save_pngs(images, tmp / "vllm-images"), "embed")
    if worker.error:
        return None, worker.error

    def run():
        rows, _, wall, cpu = worker.run()
        return torch.from_numpy(rows), wall, cpu

    run.close = worker.close  # type: ignore[attr-defined]
    return run, None


def variant(
    label: str, folder: Path, images: list, rounds: int, reference: torch.Tensor, **kwargs
) -> str:
    """tidepool with `kwargs` (dtype / quantization): images/s (median) and cosine vs
    `reference` (tidepool float32), or the refusal's message where it does not load or run."""
    from tidepool import LLM

    try:
        llm = LLM(str(folder), device="cpu", **kwargs)
        run = tidepool_embed(llm)
        run(images[:8])  # warm-up
        times, outs = alternate({label: lambda: run(images)}, rounds, len(images))
    except (ValueError, NotImplementedError, TypeError) as e:
        return f"refused: {type(e).__name__}: {e}"
    cos = F.cosine_similarity(outs[label].float(), reference, dim=-1).min()
    return f"{len(images) / statistics.median(times[label]):7.1f} images/s, min cosine vs float32 {float(cos):.6f}"


def compare(
    folder: Path, images: list, rounds: int, batch_size: int, vllm_python: str | None
) -> torch.Tensor:
    """tidepool vs sentence-transformers (and vLLM where `vllm_python`), float32, alternating:
    prints images/s, the ratios and the agreement; returns tidepool's vectors (the reference of
    the variants)."""
    from sentence_transformers import SentenceTransformer

    from tidepool import LLM

    vllm_run, refusal = None, None
    if vllm_python:  # first: its start-up (a minute) is not inside anyone's round
        vllm_run, refusal = vllm_side(
            vllm_python, folder.parent / "transformers", images, folder.parent
        )
    llm = LLM(str(folder), device="cpu", dtype="float32")
    st = SentenceTransformer(str(folder), device="cpu")
    ours = tidepool_embed(llm)

    def theirs() -> torch.Tensor:
        return st.encode(images, batch_size=batch_size, convert_to_tensor=True).float()

    ours(images[:8])  # warm-up both (first calls allocate and pick kernels)
    st.encode(images[:8], batch_size=batch_size)
    runs = {"tidepool": lambda: ours(images), "sentence-transformers": theirs}
    if vllm_run is not None:
        runs["vLLM"] = vllm_run
    try:
        times, outs = alternate(runs, rounds, len(images))
    finally:
        if vllm_run is not None:
            vllm_run.close()
    print()
    for name, walls in times.items():
        print(f"{name:<22} {len(images) / statistics.median(walls):7.1f} images/s (median)")
    for peer in times:
        if peer != "tidepool":
            ratios = [s / t for t, s in zip(times["tidepool"], times[peer], strict=True)]
            cos = F.cosine_similarity(outs["tidepool"], outs[peer], dim=-1).min()
            print(
                f"tidepool / {peer}: {statistics.median(ratios):.2f}x (median of rounds: "
                f"{' '.join(f'{x:.2f}' for x in ratios)}); agreement: min cosine {float(cos):.6f}"
            )
    if refusal:
        print(f"vLLM 0.32: refused: {refusal}")
    preprocessing(folder, images)
    rate = {name: len(images) / statistics.median(walls) for name, walls in times.items()}
    print_roofline(folder, rate)
    return outs["tidepool"]


def print_roofline(folder: Path, rate: dict[str, float]) -> None:
    """The vision tower's float32 ceiling here: images/s if every FLOP (the patch GEMM, the
    layers' linears and attention) ran at the GEMM speed of its shapes (benchmarks/roofline.py),
    preprocessing free; each side's share of it."""
    import transformers
    from roofline import EncoderShape, gemm_gflops

    vision = transformers.AutoConfig.from_pretrained(str(folder)).vision_config
    shape = EncoderShape.from_hf_config(vision)
    patches = (vision.image_size // vision.patch_size) ** 2
    patch_flops = 2 * patches * vision.num_channels * vision.patch_size**2 * vision.hidden_size
    per_image = (patches + 1) * shape.flops_per_token(patches + 1) + patch_flops
    gflops = gemm_gflops(shape, torch.float32)
    ceiling = gflops * 1e9 / per_image
    shares = ", ".join(f"{name} at {100 * r / ceiling:.0f}%" for name, r in rate.items())
    print(
        f"float32 roofline: {gflops:.0f} GFLOP/s at the tower's GEMM shapes, "
        f"{per_image / 1e9:.2f} GFLOP per image = {ceiling:.1f} images/s; {shares}"
    )


def preprocessing(folder: Path, images: list) -> None:
    """The share of the work both sides do the same way: the PIL image processor alone."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    start = time.perf_counter()
    processor(images=images, return_tensors="pt")
    elapsed = time.perf_counter() - start
    print(
        f"of which preprocessing (the PIL {type(processor).__name__} alone, once): "
        f"{1000 * elapsed / len(images):.1f} ms/image, {len(images) / elapsed:.0f} images/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers'")
    parser.add_argument("--quick", action="store_true", help="tiny model, 16 images, 2 rounds")
    parser.add_argument("--no-variants", action="store_true", help="skip bfloat16 and int8")
    parser.add_argument("--vllm-python", default="/work/venv-vllm/bin/python")
    parser.add_argument("--no-vllm", action="store_true", help="no vLLM side")
    args = parser.parse_args()
    if args.quick:
        args.images, args.rounds = min(args.images, 16), min(args.rounds, 2)
    shape = QUICK if args.quick else VIT_B32
    print("reproduce: python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(
        f"threads={torch.get_num_threads()}; CPU: {cpu_flags()}; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    images = make_images(args.images)
    vision = shape["vision"]
    print(
        f"{len(images)} images ({len(SIZES)} sizes, modes {'/'.join(sorted(set(MODES)))}) → "
        f"{vision['image_size']} px, patch {vision['patch_size']}, {vision['num_hidden_layers']} "
        f"layers of {vision['hidden_size']}; float32; sentence-transformers batch {args.batch_size}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_clip(Path(tmp), shape)
        from image_worker import vllm_python_or_none

        vllm = None if args.no_vllm else vllm_python_or_none(args.vllm_python)
        reference = compare(folder, images, args.rounds, args.batch_size, vllm)
        if args.no_variants:
            return
        for label, kwargs in (
            ("tidepool bfloat16", {"dtype": "bfloat16"}),
            ("tidepool int8", {"dtype": "float32", "quantization": "int8"}),
        ):
            print(f"{label:<22} {variant(label, folder, images, args.rounds, reference, **kwargs)}")


if __name__ == "__main__":
    main()
