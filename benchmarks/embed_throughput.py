"""Embedding throughput: tidepool vs sentence-transformers on the same corpus, same dtype, one run.

Both sides run alternately (A B A B ...) so the machine's noise hits both; the ratio quoted is the
median of the per-round ratios. Outputs are checked to agree (cosine), and the GEMM roofline of
the machine is measured in the same run so the figure says how close to the limit it is.

    python benchmarks/embed_throughput.py [--dtype float32|bfloat16] [--texts 2000] [--rounds 3]
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
from roofline import EncoderShape, roofline  # noqa: E402


def run_tidepool(llm, texts: list[str]) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    outs = llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, torch.tensor([o.outputs.embedding for o in outs])


def run_st(model, texts: list[str], batch_size: int) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    emb = model.encode(texts, batch_size=batch_size, convert_to_tensor=True)
    elapsed = time.perf_counter() - start
    return elapsed, emb.float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--st-batch-size", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--no-st", action="store_true", help="tidepool only (profiling)")
    args = parser.parse_args()

    from tidepool import LLM

    dtype = getattr(torch, args.dtype)
    texts = make_corpus(args.texts)
    llm = LLM(args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens)
    tokenizer = llm.get_tokenizer()
    max_len = llm.model_config.max_model_len
    num_tokens = sum(min(len(ids), max_len) for ids in tokenizer(texts)["input_ids"])
    mean_len = num_tokens / len(texts)
    print(
        f"corpus: {len(texts)} texts, {num_tokens} tokens (mean {mean_len:.1f}); "
        f"dtype={args.dtype} threads={torch.get_num_threads()}"
    )

    st_model = None
    if not args.no_st:
        from sentence_transformers import SentenceTransformer

        st_model = SentenceTransformer(str(llm.model_config.path), device="cpu")
        st_model = st_model.to(dtype)

    # Warm-up both (first calls allocate and tune kernels).
    run_tidepool(llm, texts[:200])
    if st_model is not None:
        run_st(st_model, texts[:200], args.st_batch_size)

    tp_times, st_times, ratios = [], [], []
    tp_emb = st_emb = None
    for r in range(args.rounds):
        t_tp, tp_emb = run_tidepool(llm, texts)
        tp_times.append(t_tp)
        line = f"round {r}: tidepool {num_tokens / t_tp:9,.0f} tok/s"
        if st_model is not None:
            t_st, st_emb = run_st(st_model, texts, args.st_batch_size)
            st_times.append(t_st)
            ratios.append(t_st / t_tp)
            line += f" | sentence-transformers {num_tokens / t_st:9,.0f} tok/s | ratio {t_st / t_tp:.2f}x"
        print(line, flush=True)

    t_tp = statistics.median(tp_times)
    print(
        f"\ntidepool:              {len(texts) / t_tp:8.1f} texts/s {num_tokens / t_tp:9,.0f} tokens/s"
    )
    if st_model is not None:
        t_st = statistics.median(st_times)
        print(
            f"sentence-transformers: {len(texts) / t_st:8.1f} texts/s {num_tokens / t_st:9,.0f} tokens/s"
        )
        cos = torch.nn.functional.cosine_similarity(tp_emb, st_emb, dim=1)
        print(
            f"ratio (median of rounds): {statistics.median(ratios):.2f}x   "
            f"agreement: min cosine {cos.min().item():.6f}"
        )
    shape = EncoderShape.from_hf_config(llm.model_config.hf_config)
    roof = roofline(shape, dtype, mean_len)
    print(
        f"roofline ({args.dtype}): GEMM {roof['gemm_gflops']:.0f} GFLOP/s, "
        f"{roof['mflop_per_token']:.1f} MFLOP/token → {roof['tokens_per_s']:,.0f} tokens/s; "
        f"tidepool reaches {num_tokens / t_tp / roof['tokens_per_s']:.0%}"
    )
    stats = llm.engine.stats
    print(f"engine: {stats.num_steps} steps, time in model runner {stats.model_seconds:.1f}s")


if __name__ == "__main__":
    main()
