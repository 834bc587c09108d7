"""End to end, one `LLM`: the attention kernel's reduced-precision products on vs off (issue 27).

One bfloat16 (or --quantization int8) all-MiniLM-L6-v2 embeds the corpus' first --texts texts in
rounds alternating between the kernel's "bf16" products (on vdpbf16ps or AMX, whichever the CPU
has) and its float32 products, switched between rounds through the TIDEPOOL_CPU_ISA cap
(=avx512 keeps the float32 products; the kernel reads the cap at each call). Prints wall and
process CPU seconds per pass, the median per-pair ratios, and the cosine between the two sides'
embeddings. Process CPU time is the steadier measure on a loaded machine.

    python benchmarks/bf16_products.py [--texts 500] [--rounds 5] [--quantization int8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import tidepool  # noqa: F401  (OpenMP defaults before torch)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from corpus import make_corpus  # noqa: E402


def main() -> None:
    from tidepool import LLM
    from tidepool.attention import cpu_kernels
    from tidepool.kernels import cpu_features

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--texts", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quantization", default=None)
    args = parser.parse_args()
    dtype = "float32" if args.quantization else "bfloat16"
    llm = LLM(args.model, dtype=dtype, quantization=args.quantization)
    texts = make_corpus(args.texts)
    print(
        f"CPU: {cpu_features.describe()}; {torch.get_num_threads()} threads; load {os.getloadavg()[0]:.1f}"
    )
    sides = {"reduced": os.environ.get("TIDEPOOL_CPU_ISA", "auto"), "float32": "avx512"}

    def run(side: str) -> tuple[float, float, torch.Tensor]:
        os.environ["TIDEPOOL_CPU_ISA"] = sides[side]
        cpu_features.reset()
        wall, cpu = time.perf_counter(), time.process_time()
        outs = llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return wall, cpu, torch.stack([torch.as_tensor(o.outputs.embedding) for o in outs])

    for side in sides:
        os.environ["TIDEPOOL_CPU_ISA"] = sides[side]
        cpu_features.reset()
        print(f"{side}: products {cpu_kernels.products('bf16')}")
    run("reduced")  # warm-up
    times: dict[str, list[tuple[float, float]]] = {s: [] for s in sides}
    emb = {}
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else reversed(list(sides)):
            wall, cpu, emb[side] = run(side)
            times[side].append((wall, cpu))
            print(f"round {r} {side:>8}: {wall:7.2f} s wall, {cpu:7.2f} s CPU", flush=True)
    wall_ratio = statistics.median(
        f[0] / r[0] for f, r in zip(times["float32"], times["reduced"], strict=True)
    )
    cpu_ratio = statistics.median(
        f[1] / r[1] for f, r in zip(times["float32"], times["reduced"], strict=True)
    )
    cos = torch.nn.functional.cosine_similarity(emb["reduced"].float(), emb["float32"].float())
    print(
        f"reduced products over float32 products: {wall_ratio:.2f}x wall, {cpu_ratio:.2f}x CPU "
        f"(medians of per-round ratios); cosine min {cos.min():.6f} mean {cos.mean():.6f}; "
        f"load {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
