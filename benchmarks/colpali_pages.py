"""ColPali page embedding: tidepool vs transformers' ColPaliForRetrieval and vLLM, pages/s.

The model has colpali-v1.3's shape with random weights (fixed seed): a ColPaliConfig over a
PaliGemmaConfig, its vision tower SigLIP So400m's (hidden 1152, 16 heads of 72, MLP 4304, patch
14, 448 px images: 1024 patches, no pooling head), its text model Gemma 2B's (hidden 2048, 8
query heads and 1 KV head of 256, GeGLU MLP 16384), the projection to 128. The full depth is 27
vision and 18 text layers, ~3B parameters (12 GB in float32, twice over for two sides): by
default the towers are cut to 6 and 4 layers (`--layers-vision`, `--layers-text`), each layer
doing the full model's work, so a run takes minutes on a few cores; a full-depth page's work is
estimated from the per-layer FLOPs and printed. The tokenizer is the tiny ColPali builder's
(tests/paligemma_models.py: byte-level BPE, <pad> <eos> <bos> <image>, 320 entries instead of
Gemma's 257,216: the embedding table is read, not multiplied), saved with the PIL SigLIP image
processor at 448 px (image_seq_length 1024).

Pages are PNG-decoded page-like images (a white sheet, a title bar, lines of word-like strokes, a
figure box; sizes from 612x792 to 1700x2200, portrait and landscape), so resizing to 448 px is
part of the work timed on both sides. tidepool runs `LLM.encode(pages, pooling_task=
"token_embed")` on `{"prompt": "", "multi_modal_data": {"image": page}}` (the page prompt:
1024 <image> + "<bos>Describe the image.\\n"); transformers runs `ColPaliForRetrieval(
**ColPaliProcessor.process_images(batch)).embeddings` in batches under torch.inference_mode,
its per-token vectors at the unpadded tokens. Both in this process, float32, the same thread
count. Sides take turns for `--rounds` rounds, the order rotating (A B C, B C A, ...); the
figures are medians, a ratio the median of the per-round ratios; tidepool's and transformers'
vectors are checked to agree (min per-token cosine) so both figures are the same work. `--queries
N` times N query texts the same way, tidepool vs transformers only (tidepool: plain texts, which
it puts in process_queries' format; transformers: process_queries batches).

The third side is vLLM 0.32's CPU build (--vllm-python, /work/venv-vllm; --no-vllm leaves it out)
in its own process (image_worker.py, peers.py's CPU environment for vLLM; its wall and CPU seconds
are that process's): `vllm.LLM(model=..., runner="pooling", dtype="float32")`, prefix caching and
its multimodal processor cache off, `LLM.encode(pooling_task="token_embed")` on `{"prompt":
"Describe the image.", "multi_modal_data": {"image": page}}`, from lossless PNG copies of the same
decoded pages, opened once before its rounds. Its PaliGemma processor makes that 1024 <image> +
<bos> + the text + "\n", the same 1034 tokens as process_images. Three things let it load the
model, none changing the work: (1) the tokenizer gets "\n" as a piece of its own, as Gemma's has
(vLLM's processor looks `vocab["\n"]` up: KeyError on the byte-level builder's), for all sides;
(2) vLLM reads a copy of the folder with the vision tower's weights under the Hub's names
(`vlm.vision_tower.vision_model.*`: transformers 5 saves `vlm.vision_tower.*`, which vLLM 0.32
does not map); (3) without torchvision in its venv (peer_venvs.sh removes PyPI's CUDA build),
vLLM's vision.py cannot import its Pixtral module, so the worker stubs the one transformers name it
takes from there, used by Pixtral alone (image_worker.stub_pixtral_processor). A model or layout
vLLM refuses anyway prints its error in place of its figures (--quick's tokenizer, for one).

vLLM's ColPali runs the Gemma causally (docs/multimodal.md, ColPali), where transformers and
tidepool attend over the whole prompt (PaliGemma's prefix), so its per-token vectors are other
vectors: the min / mean cosine vs tidepool printed measure that difference, not an error. The
last token sees the whole prompt under both masks: with one text layer its cosine is 1.000000
(checked: --layers-text 1), deeper it drifts as the earlier tokens' states feed it.

    python benchmarks/colpali_pages.py [--pages 8] [--rounds 3] [--batch-size 4]
        [--layers-vision 6] [--layers-text 4] [--queries 0] [--quick]
        [--vllm-python PATH] [--no-vllm]
"""

from __future__ import annotations

import argparse
import io
import os
import random
import shlex
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

# tidepool sets OpenMP's wait policy when imported, before torch loads: the same for both sides.
import tidepool  # noqa: F401

# isort: split
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the tiny ColPali builder, reused

import paligemma_models as tiny  # noqa: E402

IMAGE_SIZE, PATCH_SIZE = 448, 14
SO400M = dict(  # SigLIP So400m/14 at 448 px, PaliGemma's tower (no pooling head)
    hidden_size=1152,
    intermediate_size=4304,
    num_hidden_layers=27,
    num_attention_heads=16,
    image_size=IMAGE_SIZE,
    patch_size=PATCH_SIZE,
    vision_use_head=False,
)
GEMMA_2B = dict(
    tiny.TEXT,  # the builder's ids, activation and norm epsilon; Gemma 2B's sizes below
    hidden_size=2048,
    intermediate_size=16384,
    num_hidden_layers=18,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=256,
    max_position_embeddings=8192,
)
EMBEDDING_DIM = 128
PAGE_SIZES = [(612, 792), (850, 1100), (1100, 850), (1240, 1754), (1700, 2200), (792, 612)]
WORDS = "revenue chart table figure quarter growth page report total year market share".split()


def make_pages(count: int, seed: int = 0) -> list[Image.Image]:
    """`count` PNG-decoded page-like RGB images, sizes cycling through PAGE_SIZES, fixed by seed."""
    rng = random.Random(seed)
    pages = []
    for i in range(count):
        w, h = PAGE_SIZES[i % len(PAGE_SIZES)]
        page = Image.new("RGB", (w, h), (255, 255, 255))
        draw = ImageDraw.Draw(page)
        margin, line = w // 12, max(h // 60, 8)
        draw.rectangle([margin, margin, w - margin, margin + 2 * line], fill=(30, 60, 120))
        y = margin + 4 * line
        figure_at = rng.randrange(y, h - h // 3)
        while y < h - margin - line:
            if abs(y - figure_at) < line:  # a figure: a box with bars in it
                box = [margin, y, w // 2, y + h // 5]
                draw.rectangle(box, outline=(0, 0, 0), width=2)
                for b in range(6):
                    top = y + rng.randrange(line, h // 5 - line)
                    x = margin + line + b * (w // 2 - margin) // 7
                    draw.rectangle([x, top, x + line, y + h // 5 - 2], fill=(200, 80, 40))
                y += h // 5 + line
                continue
            x = margin
            while x < w - margin - 2 * line:  # a line of word-like strokes
                word = rng.randrange(2, 8) * line // 2
                grey = rng.randrange(0, 90)
                draw.rectangle([x, y, min(x + word, w - margin), y + line // 2], fill=(grey,) * 3)
                x += word + line // 2
            y += line
        buffer = io.BytesIO()
        page.save(buffer, format="PNG")
        decoded = Image.open(io.BytesIO(buffer.getvalue()))
        decoded.load()  # decoded here, not inside whichever side's round touches it first
        pages.append(decoded)
    return pages


def make_queries(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        "what is the " + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 12))) + "?"
        for _ in range(count)
    ]


def build_colpali(folder: Path, layers_vision: int, layers_text: int, seed: int = 0) -> Path:
    """A random ColPali of SO400M / GEMMA_2B's shape at the given depths, built as the tiny
    builder builds (its tokenizer, Gemma's norms given some spread), with the 448 px processor."""
    from transformers import ColPaliConfig, ColPaliForRetrieval, PaliGemmaConfig
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    folder.mkdir(parents=True)
    tokenizer = tiny.save_tokenizer(folder)
    tokenizer.add_tokens(["\n"])  # a piece of its own, as in Gemma's: vLLM's PaliGemma looks it up
    tokenizer.save_pretrained(str(folder))
    vocab = len(tokenizer)
    text = dict(GEMMA_2B, num_hidden_layers=layers_text, model_type="gemma", vocab_size=vocab)
    vision = dict(SO400M, num_hidden_layers=layers_vision, model_type="siglip_vision_model")
    vlm = PaliGemmaConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=tiny.IMAGE,
        vocab_size=vocab,
        projection_dim=text["hidden_size"],
        hidden_size=text["hidden_size"],
    )
    config = ColPaliConfig(vlm_config=vlm.to_dict(), embedding_dim=EMBEDDING_DIM)
    config.architectures = ["ColPaliForRetrieval"]
    torch.manual_seed(seed)
    model = ColPaliForRetrieval(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(str(folder))
    processor = SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor.image_seq_length = (IMAGE_SIZE // PATCH_SIZE) ** 2
    processor.save_pretrained(str(folder))
    return folder


def reference_processor(folder: Path):
    """transformers' ColPaliProcessor over the folder's tokenizer and image processor."""
    from transformers import AutoTokenizer, ColPaliProcessor
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    return ColPaliProcessor(
        image_processor=SiglipImageProcessorPil.from_pretrained(str(folder)),
        tokenizer=AutoTokenizer.from_pretrained(str(folder)),
    )


def layer_flops(config, tokens: int) -> tuple[float, float]:
    """Multiply-add FLOPs of one vision layer (over the patches) and one text layer (over
    `tokens`) of one prompt: the linear layers and the attention products."""
    v, t = config.vlm_config.vision_config, config.vlm_config.text_config
    n = (v.image_size // v.patch_size) ** 2
    vision = 2 * n * (4 * v.hidden_size**2 + 2 * v.hidden_size * v.intermediate_size)
    vision += 4 * n * n * v.hidden_size
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    text = 2 * tokens * (t.hidden_size * (2 * q + 2 * kv) + 3 * t.hidden_size * t.intermediate_size)
    text += 4 * tokens * tokens * q
    return float(vision), float(text)


def tidepool_side(llm) -> Callable[[list], list[torch.Tensor]]:
    def run(prompts: list) -> list[torch.Tensor]:
        outs = llm.encode(prompts, pooling_task="token_embed", use_tqdm=False)
        return [o.outputs.data.float() for o in outs]

    return run


def transformers_side(model, make_inputs, batch_size: int) -> Callable[[list], list[torch.Tensor]]:
    def run(items: list) -> list[torch.Tensor]:
        rows = []
        with torch.inference_mode():
            for start in range(0, len(items), batch_size):
                inputs = make_inputs(items[start : start + batch_size])
                vectors = model(**inputs).embeddings
                mask = inputs["attention_mask"].bool()
                rows += [e[m] for e, m in zip(vectors, mask, strict=True)]
        return rows

    return run


def alternate(runs: dict[str, Callable[[], object]], rounds: int, count: int, unit: str):
    """image_worker.alternate in `unit`/s."""
    from image_worker import alternate as rotate

    return rotate(runs, rounds, count, unit, 3)


def agreement(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> str:
    """Min and mean per-token cosine, and the last token's min (under a causal mask the last
    token still sees the whole prompt); where the token counts differ, over each page's last
    min(n, m) tokens (the image tokens come first, the text last), and says so."""
    note = ""
    if any(len(a) != len(b) for a, b in zip(ours, theirs, strict=True)):
        note = f"; token counts differ ({len(ours[0])} vs {len(theirs[0])} on page 0), last aligned"
    cosines = [
        F.cosine_similarity(a[-min(len(a), len(b)) :], b[-min(len(a), len(b)) :], dim=-1)
        for a, b in zip(ours, theirs, strict=True)
    ]
    low = min(float(c.min()) for c in cosines)
    mean = float(torch.cat(cosines).mean())
    last = min(float(c[-1]) for c in cosines)
    tokens = sum(len(a) for a in ours) / len(ours)
    return (
        f"min per-token cosine {low:.6f} (1 - {1 - low:.1e}), mean {mean:.6f}, last token's min "
        f"{last:.6f}, over {len(ours)} x {tokens:.0f} token vectors{note}"
    )


def compare(
    label: str, inputs: tuple[list, list], ours, theirs, rounds: int, unit: str, vllm=None
) -> float:
    """Warm-up (one item each), alternating rounds, medians, the ratios and the agreement.
    `inputs`: the same items as each side takes them; `vllm`: vLLM's side (already warm) or
    None. Returns tidepool's median rate."""
    print(f"\n{label}:")
    mine, yours = inputs
    ours(mine[:1])  # warm-up both (first calls allocate and pick kernels)
    theirs(yours[:1])
    runs = {"tidepool": lambda: ours(mine), "transformers": lambda: theirs(yours)}
    if vllm is not None:
        runs["vLLM"] = vllm
    items = mine
    times, outs = alternate(runs, rounds, len(items), unit)
    shapes = all(
        a.shape == b.shape for a, b in zip(outs["tidepool"], outs["transformers"], strict=True)
    )
    if not shapes:
        raise SystemExit("the two sides gave different token counts: not the same work")
    for name, walls in times.items():
        print(f"{name:<13} {len(items) / statistics.median(walls):7.3f} {unit}/s (median)")
    for peer in times:
        if peer == "tidepool":
            continue
        ratios = [s / t for t, s in zip(times["tidepool"], times[peer], strict=True)]
        print(
            f"tidepool / {peer}: {statistics.median(ratios):.2f}x (median of rounds: "
            f"{' '.join(f'{x:.2f}' for x in ratios)}); agreement: "
            f"{agreement(outs['tidepool'], outs[peer])}"
        )
    return len(items) / statistics.median(times["tidepool"])


def describe_run(args, config, folder: Path) -> tuple[float, float]:
    """Prints the shape; returns (this run's, the full depth's) per-page FLOPs."""
    from tidepool.kernels.cpu_features import describe

    v, t = config.vlm_config.vision_config, config.vlm_config.text_config
    tokens = len(reference_processor(folder).process_images(make_pages(1))["input_ids"][0])
    vision, text = layer_flops(config, tokens)
    ours = args.layers_vision * vision + args.layers_text * text
    full = SO400M["num_hidden_layers"] * vision + GEMMA_2B["num_hidden_layers"] * text
    print(
        f"threads={torch.get_num_threads()}; CPU: {describe()}; load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(
        f"vision: {v.num_hidden_layers} layers of {v.hidden_size} ({v.num_attention_heads} heads, "
        f"MLP {v.intermediate_size}), {v.image_size} px / {v.patch_size}; text: "
        f"{t.num_hidden_layers} layers of {t.hidden_size} ({t.num_attention_heads} heads / "
        f"{t.num_key_value_heads} KV of {t.head_dim}, MLP {t.intermediate_size}); {tokens} tokens "
        f"a page; float32; transformers batch {args.batch_size}"
    )
    if not args.quick:
        print(
            f"reduced depth: each layer is the full model's; a page is {ours / 1e12:.2f} TFLOP "
            f"here, {full / 1e12:.2f} TFLOP at full depth (27 + 18 layers, {full / ours:.1f}x)"
        )
    return ours, full


def print_roofline(config, processor, rate: float) -> None:
    """The float32 ceiling here: pages/s if every FLOP ran at the GEMM speed of its tower's
    linear shapes (benchmarks/roofline.py), preprocessing free; tidepool's share of it."""
    from roofline import DecoderShape, EncoderShape, gemm_gflops

    v, t = config.vlm_config.vision_config, config.vlm_config.text_config
    tokens = len(processor.process_images(make_pages(1))["input_ids"][0])
    vision, text = layer_flops(config, tokens)
    rates = (
        gemm_gflops(EncoderShape.from_hf_config(v), torch.float32),
        gemm_gflops(DecoderShape.from_hf_config(t), torch.float32),
    )
    seconds = (
        v.num_hidden_layers * vision / rates[0] + t.num_hidden_layers * text / rates[1]
    ) / 1e9
    print(
        f"float32 roofline: vision GEMMs {rates[0]:.0f}, text GEMMs {rates[1]:.0f} GFLOP/s = "
        f"{1 / seconds:.3f} pages/s; tidepool at {100 * rate * seconds:.0f}%"
    )


def hub_layout(folder: Path, dest: Path) -> Path:
    """A copy of the ColPali folder with its weights under the Hub's names (vidore/colpali-v1.3-hf:
    `vlm.vision_tower.vision_model.*`), the same tensors: transformers 5 saves the tower as
    `vlm.vision_tower.*`, which vLLM 0.32's ColPali does not map ("no module or parameter named
    'vision_tower.embeddings'")."""
    import shutil

    from safetensors.torch import load_file, save_file

    dest.mkdir()
    for file in folder.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, dest / file.name)
            continue
        prefix = "vlm.vision_tower."
        renamed = {
            (prefix + "vision_model." + k[len(prefix) :] if k.startswith(prefix) else k): v
            for k, v in load_file(str(file)).items()
        }
        save_file(renamed, str(dest / file.name), metadata={"format": "pt"})
    return dest


def vllm_side(python: str, folder: Path, pages: list, tmp: Path):
    """vLLM 0.32's ColPali (image_worker.py, `token_embed`) on the Hub-layout copy, the same
    pages saved as PNG, the prompt "Describe the image." (vLLM's PaliGemma processor puts the
    image tokens and <bos> before it and "\n" after). Returns (run, None), or (None, vLLM's
    refusal)."""
    from image_worker import ImageWorker, save_pngs

    model = hub_layout(folder, tmp / "colpali-vllm")
    images = save_pngs(pages, tmp / "vllm-pages")
    worker = ImageWorker(python, model, images, "token_embed", "Describe the image.")
    if worker.error:
        return None, worker.error
    print(f"vLLM worker: {worker.info}")

    def run():
        rows, lengths, wall, cpu = worker.run()
        vectors = torch.from_numpy(rows).split(lengths)
        return list(vectors), wall, cpu

    run.close = worker.close  # type: ignore[attr-defined]
    return run, None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4, help="transformers'")
    parser.add_argument("--layers-vision", type=int, default=6, help="of 27")
    parser.add_argument("--layers-text", type=int, default=4, help="of 18")
    parser.add_argument("--queries", type=int, default=0, help="also time N query texts")
    parser.add_argument("--quick", action="store_true", help="the tiny test model, 2 pages")
    parser.add_argument("--vllm-python", default="/work/venv-vllm/bin/python")
    parser.add_argument("--no-vllm", action="store_true", help="no vLLM side")
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error("--rounds: at least 3 (the median of alternating rounds)")
    if args.quick:
        args.pages = min(args.pages, 2)
        args.layers_vision = tiny.VISION["num_hidden_layers"]
        args.layers_text = tiny.TEXT["num_hidden_layers"]
    return args


def main() -> None:
    from transformers import AutoConfig, ColPaliForRetrieval

    from tidepool import LLM

    args = parse_args()
    print("reproduce: python " + " ".join(shlex.quote(a) for a in sys.argv))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "colpali"
        if args.quick:
            tiny.build_colpali(folder)
        else:
            build_colpali(folder, args.layers_vision, args.layers_text)
        ours_flops, full_flops = describe_run(args, AutoConfig.from_pretrained(str(folder)), folder)
        pages = make_pages(args.pages)
        vllm, refusal = None, None
        from image_worker import vllm_python_or_none

        if not args.no_vllm and vllm_python_or_none(args.vllm_python):  # start-up: untimed
            vllm, refusal = vllm_side(args.vllm_python, folder, pages, Path(tmp))
        llm = LLM(str(folder), device="cpu", dtype="float32")
        model = ColPaliForRetrieval.from_pretrained(str(folder), dtype=torch.float32).eval()
        processor = reference_processor(folder)
        ours, size = tidepool_side(llm), sorted({im.size for im in pages})
        print(f"{len(pages)} pages, PNG-decoded, sizes {size}")
        prompts = [{"prompt": "", "multi_modal_data": {"image": im}} for im in pages]
        try:
            rate = compare(
                "pages",
                (prompts, pages),
                ours,
                transformers_side(model, processor.process_images, args.batch_size),
                args.rounds,
                "pages",
                vllm,
            )
        finally:
            if vllm is not None:
                vllm.close()
        if refusal:
            print(f"vLLM 0.32: refused: {refusal}")
        if not args.quick:
            print(
                f"tidepool at full depth, estimated from FLOPs: {rate * ours_flops / full_flops:.3f} pages/s"
            )
            print_roofline(AutoConfig.from_pretrained(str(folder)), processor, rate)
        if args.queries:
            queries = make_queries(args.queries)
            compare(
                "queries",
                (queries, queries),
                ours,
                transformers_side(model, processor.process_queries, args.batch_size),
                args.rounds,
                "queries",
            )


if __name__ == "__main__":
    main()
