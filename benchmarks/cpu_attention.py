"""tidepool's CPU attention kernel vs PyTorch SDPA on the same packed step, in one run.

A MiniLM-shaped step (12 heads of 32, or --heads / --head-dim) of --tokens tokens, sequence
lengths drawn from the benchmark corpus' token lengths (fixed seed), through both of tidepool's
encoder attention paths: the kernel on the packed tokens (csrc/cpu_encoder_attention.cpp) and
SDPA per padded bucket on the padded layout (attention/torch_backend.py). Calls alternate
(A B A B ...); prints each side's median time, GFLOP/s (4 * L^2 * head_dim per head and
sequence) and the median per-pair ratio, and checks the outputs agree. `--matmul` adds the
kernel's reduced-precision modes (cpu_kernels.MATMULS: AMX-bf16, or "bf16" on vdpbf16ps) to the rotation, each with its speed-up over the
kernel's float32 products and its max abs difference to them.

    python benchmarks/cpu_attention.py [--dtype float32|bfloat16] [--threads 2] [--calls 25]
        [--head-dim 64] [--matmul bf16,bf16x3] [--isa avx2]

Prints the CPU's instruction sets and which build of the kernel ran (cpu_features.py: the best
the CPU has, or the one `--isa` caps it to, as TIDEPOOL_CPU_ISA does).

`--e2e N`: end to end instead, all-MiniLM-L6-v2 `LLM.embed` over the corpus' first N texts, one
LLM whose model's attention backend is switched between rounds (the kernel, then SDPA on the
padded buckets) and sentence-transformers float32 (batch 32) as the peer, rounds alternating
(kernel, SDPA, ST); prints tokens/s, the median per-round ratios and the cosine to ST.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# tidepool sets OpenMP's wait policy when imported, before torch loads: the same for all sides.
import tidepool  # noqa: F401

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from corpus import make_corpus  # noqa: E402

from tidepool.attention import cpu_kernels, torch_backend  # noqa: E402
from tidepool.attention.backend import CPU_KERNEL, CpuKernelBackend  # noqa: E402
from tidepool.attention.metadata import build_encoder_metadata, pad_buckets  # noqa: E402
from tidepool.kernels import cpu_features


def step_lengths(num_tokens: int, max_len: int = 256) -> list[int]:
    """Token lengths of corpus texts (MiniLM's tokenizer), longest first, filling one step."""
    from transformers import AutoTokenizer

    from tidepool.checkpoint.loader import resolve_model_path

    path = resolve_model_path("sentence-transformers/all-MiniLM-L6-v2")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    lens = [min(max_len, len(ids)) for ids in tokenizer(make_corpus(400))["input_ids"]]
    out: list[int] = []
    for n in lens:
        if sum(out) + n > num_tokens:
            break
        out.append(n)
    return sorted(out, reverse=True)


def end_to_end(num_texts: int, rounds: int) -> None:
    """tidepool with the kernel vs tidepool with SDPA vs sentence-transformers, one process."""
    from sentence_transformers import SentenceTransformer

    from tidepool import LLM
    from tidepool.attention.backend import BUCKETED_SDPA
    from tidepool.checkpoint.loader import resolve_model_path

    name = "sentence-transformers/all-MiniLM-L6-v2"
    texts = make_corpus(num_texts)
    llm = LLM(name, dtype="float32")
    model = llm.llm_engine.core.model_runner.model
    st = SentenceTransformer(str(resolve_model_path(name)), device="cpu")
    tokens = sum(len(ids) for ids in llm.get_tokenizer()(texts, truncation=True)["input_ids"])

    def embed() -> torch.Tensor:
        outs = llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
        return torch.tensor([o.outputs.embedding for o in outs])

    def with_backend(backend):
        def run() -> torch.Tensor:
            model.set_attention_backend(backend)
            return embed()

        return run

    sides = {
        "kernel": with_backend(CPU_KERNEL),
        "sdpa": with_backend(BUCKETED_SDPA),
        "st": lambda: st.encode(texts, batch_size=32, convert_to_tensor=True).float(),
    }
    outputs = {name: fn() for name, fn in sides.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    print(f"{num_texts} texts, {tokens} tokens, {torch.get_num_threads()} threads, {rounds} rounds")
    for name, ts in times.items():
        cos = torch.nn.functional.cosine_similarity(outputs[name], outputs["st"]).min().item()
        print(
            f"  {name:6s} {tokens / statistics.median(ts):8.0f} tokens/s  cos min vs ST {cos:.6f}"
        )
    for a, b in (("kernel", "sdpa"), ("kernel", "st"), ("sdpa", "st")):
        ratio = statistics.median(y / x for x, y in zip(times[a], times[b], strict=True))
        print(f"  {a} / {b} (median of per-round ratios): {ratio:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--calls", type=int, default=25)
    parser.add_argument("--matmul", default="", help="reduced modes to add: bf16,bf16x3")
    parser.add_argument("--isa", default=None, help="cap the kernel's build (TIDEPOOL_CPU_ISA)")
    parser.add_argument("--e2e", type=int, default=0, help="end to end over this many texts")
    parser.add_argument("--rounds", type=int, default=5, help="--e2e rounds")
    args = parser.parse_args()
    if args.isa:
        os.environ["TIDEPOOL_CPU_ISA"] = args.isa
        cpu_features.reset()
    print(f"CPU: {cpu_features.describe()}; kernel build: {cpu_kernels.chosen_isa()}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.e2e:
        end_to_end(args.e2e, args.rounds)
        return
    dtype = getattr(torch, args.dtype)
    if not cpu_kernels.supports(torch.device("cpu"), dtype, args.head_dim):
        sys.exit("the CPU kernel is not available here (needs AVX2 + FMA and a C++ compiler)")
    lens = step_lengths(args.tokens)
    torch.manual_seed(0)
    qkv = torch.randn(sum(lens), 3, args.heads, args.head_dim).to(dtype)
    scale = args.head_dim**-0.5
    meta = build_encoder_metadata(lens, torch.device("cpu"), num_heads=args.heads, dtype=dtype)
    layout = pad_buckets(meta)
    qkv_slots = qkv.index_select(0, layout.token_index)

    def kernel() -> torch.Tensor:
        return CPU_KERNEL.attend(qkv, meta, scale)

    def sdpa() -> torch.Tensor:
        return torch_backend.encoder_attention(qkv_slots, layout.metadata, scale)

    sides = {"kernel": kernel, "sdpa": sdpa}
    for mode in filter(None, args.matmul.split(",")):
        backend = CpuKernelBackend(mode)
        sides[mode] = lambda backend=backend: backend.attend(qkv, meta, scale)
    base = kernel().float()
    diff = (base - sdpa()[layout.slot_of_token].float()).abs().max().item()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.calls):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    flops = sum(4 * n * n * args.head_dim * args.heads for n in lens)
    print(
        f"{args.dtype}, {len(lens)} sequences, {sum(lens)} tokens (mean {sum(lens) / len(lens):.0f}), "
        f"{args.heads} heads x {args.head_dim}, {torch.get_num_threads()} threads; "
        f"max abs diff kernel vs SDPA {diff:.2e}"
    )
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"  {name:7s} {t * 1e3:7.2f} ms  {flops / t / 1e9:6.1f} GFLOP/s")
    ratio = statistics.median(s / k for k, s in zip(times["kernel"], times["sdpa"], strict=True))
    print(f"  kernel speed-up over SDPA (median of pairs): {ratio:.2f}x")
    for mode in [m for m in sides if m not in ("kernel", "sdpa")]:
        pairs = zip(times["kernel"], times[mode], strict=True)
        gain = statistics.median(k / m for k, m in pairs)
        err = (sides[mode]().float() - base).abs().max().item()
        print(f"  {mode} over the float32 kernel: {gain:.2f}x (max abs diff {err:.2e})")


if __name__ == "__main__":
    main()
