"""Where tidepool's embedding time goes: torch.profiler over one `LLM.embed` pass of the corpus.

Ops are grouped by self CPU time (on the calling thread, which waits for its OpenMP workers
inside each op) into GEMM, attention, layer norm, activations / element-wise, copies and layout,
pooling, other ops; whatever wall time no op covers is Python and framework overhead between ops
(tokenization, scheduling, metadata, output objects), of which tokenization is timed separately.
The profiler adds a few microseconds per op, so the unprofiled wall time of the same pass is
printed too.

    python benchmarks/profile_embed.py [--dtype float32|bfloat16] [--quantization int8]
                                       [--texts 1000] [--top 25] [--shapes]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from corpus import make_corpus  # noqa: E402

# First matching rule wins: the op's name, or the name followed by '_' or '.' (add_, index_select).
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    (
        "GEMM (linear)",
        (
            "mkldnn::_linear_pointwise",
            "aten::addmm",
            "aten::mm",
            "aten::linear",
            "aten::matmul",
            "aten::mkldnn_linear",
            "aten::_mkldnn",
            "onednn::qlinear_pointwise",
            "tidepool_int8_amx::linear",
            "tidepool_int8_vnni_avx512_vnni::linear",
            "tidepool_int8_vnni_avx2_vnni::linear",
        ),
    ),
    (
        "int8 quantizer / epilogue kernels",
        (
            "tidepool_int8::quantize_rows",
            "tidepool_int8::dequant_",
            "tidepool_int8::dequant_norm_",
            "tidepool_int8_avx2::quantize_rows",
            "tidepool_int8_avx2::dequant_",
            "tidepool_int8_avx2::dequant_norm_",
        ),
    ),
    (
        "attention",
        (
            "tidepool_cpu::encoder_attention",
            "aten::_scaled_dot_product",
            "aten::scaled_dot_product",
            "aten::bmm",
            "aten::baddbmm",
            "aten::_softmax",
            "aten::softmax",
        ),
    ),
    ("layer norm", ("aten::native_layer_norm", "aten::layer_norm")),
    (
        "activation / element-wise",
        (
            "aten::gelu",
            "aten::tanh",
            "aten::add",
            "aten::mul",
            "aten::div",
            "aten::sub",
            "aten::sigmoid",
            "aten::where",
            "aten::masked_fill",
            "aten::rsub",
        ),
    ),
    (
        "pooling / normalize",
        (
            "aten::sum",
            "aten::mean",
            "aten::norm",
            "aten::linalg_vector_norm",
            "aten::clamp",
            "aten::segment_reduce",
            "aten::index_add",
            "aten::scatter_add",
            "aten::cumsum",
        ),
    ),
    (
        "copies / gather / layout",
        (
            "aten::copy_",
            "aten::cat",
            "aten::index",
            "aten::embedding",
            "aten::contiguous",
            "aten::clone",
            "aten::to",
            "aten::_to_copy",
            "aten::pad",
            "aten::constant_pad_nd",
            "aten::stack",
            "aten::split",
            "aten::narrow",
            "aten::slice",
            "aten::view",
            "aten::reshape",
            "aten::_reshape",
            "aten::transpose",
            "aten::permute",
            "aten::select",
            "aten::as_strided",
            "aten::unbind",
            "aten::chunk",
            "aten::expand",
            "aten::unsqueeze",
            "aten::squeeze",
            "aten::flatten",
            "aten::t",
            "aten::alias",
            "aten::detach",
            "aten::empty",
            "aten::zeros",
            "aten::ones",
            "aten::full",
            "aten::fill_",
            "aten::zero_",
            "aten::new_empty",
            "aten::new_zeros",
            "aten::resize_",
            "aten::arange",
            "aten::lift",
            "aten::tensor",
            "aten::scalar_tensor",
            "aten::item",
            "aten::_local_scalar_dense",
            "aten::tolist",
            "aten::repeat",
            "aten::masked_select",
            "aten::nonzero",
        ),
    ),
]


def category(name: str) -> str:
    for cat, prefixes in CATEGORIES:
        if any(name == p or name.startswith((p + "_", p + ".")) for p in prefixes):
            return cat
    return "other ops"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", default=None, choices=["int8"])
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--shapes", action="store_true", help="also the top ops by input shape")
    args = parser.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from tidepool import LLM

    texts = make_corpus(4000)[: args.texts]
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    tokenizer = llm.get_tokenizer()
    max_len = llm.model_config.max_model_len
    enc = tokenizer(texts, truncation=True, max_length=max_len)
    num_tokens = sum(len(ids) for ids in enc["input_ids"])

    def embed() -> float:
        start = time.perf_counter()
        llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
        return time.perf_counter() - start

    embed()  # warm-up
    plain = min(embed(), embed())
    start = time.perf_counter()
    tokenizer(texts, truncation=True, max_length=max_len, return_attention_mask=False)
    tok_s = time.perf_counter() - start

    with profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes) as prof:
        profiled = embed()
    events = prof.key_averages()
    by_cat: dict[str, float] = defaultdict(float)
    rows = []
    for e in events:
        self_s = e.self_cpu_time_total / 1e6
        if self_s <= 0:
            continue
        cat = category(e.key)
        by_cat[cat] += self_s
        rows.append((self_s, e.key, e.count, cat))
    in_ops = sum(by_cat.values())
    outside = max(profiled - in_ops, 0.0)

    print(
        f"tidepool {args.dtype} {args.quantization or ''}: {len(texts)} texts, {num_tokens} tokens, "
        f"threads={torch.get_num_threads()}\n"
        f"wall without profiler {plain:.2f}s ({num_tokens / plain:,.0f} tokens/s); "
        f"with profiler {profiled:.2f}s; tokenizer alone {tok_s:.2f}s"
    )
    print(f"\n| where ({args.dtype}) | seconds | share of profiled wall |")
    print("| --- | ---: | ---: |")
    for cat, secs in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"| {cat} | {secs:.2f} | {secs / profiled:.1%} |")
    print(
        f"| outside ops (Python, scheduler, tokenizer {tok_s:.2f}s) | {outside:.2f} | "
        f"{outside / profiled:.1%} |"
    )
    print("\n| op | calls | self CPU s | share | category |\n| --- | ---: | ---: | ---: | --- |")
    for self_s, key, count, cat in sorted(rows, reverse=True)[: args.top]:
        print(f"| {key} | {count} | {self_s:.3f} | {self_s / profiled:.1%} | {cat} |")
    if args.shapes:
        print("\n| op | input shapes (first 3) | calls | self CPU s | share |")
        print("| --- | --- | ---: | ---: | ---: |")
        shaped = sorted(
            prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total
        )
        for e in shaped[: args.top]:
            shapes = str(e.input_shapes[:3]).replace("|", "/")
            self_s = e.self_cpu_time_total / 1e6
            print(f"| {e.key} | {shapes} | {e.count} | {self_s:.3f} | {self_s / profiled:.1%} |")
    stats = llm.engine.stats
    print(f"\nengine: {stats.num_steps} steps in total so far")


if __name__ == "__main__":
    main()
