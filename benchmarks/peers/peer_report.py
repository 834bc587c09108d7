"""How peers.py judges and prints what it measured: agreement with the reference, one block per
section, issue 17's table, and the summary."""

from __future__ import annotations

import numpy as np

# engine → (short name for round lines and the summary)
ENGINE_NAMES = {
    "tidepool": "tidepool",
    "tidepool-int8": "tidepool int8",
    "st": "sentence-transformers",
    "st-openvino": "ST + OpenVINO",
    "st-onnx": "ST + ONNX Runtime",
    "st-onnx-int8": "ST + ORT dyn. int8",
    "st-openvino-int8": "ST + OpenVINO int8",
    "vllm": "vLLM",
}
# engine → the name issue 17's table gives it
ISSUE_NAMES = {
    "tidepool": "tidepool",
    "tidepool-int8": "tidepool int8",
    "st": "sentence-transformers (torch)",
    "st-openvino": "sentence-transformers + OpenVINO",
    "st-onnx": "sentence-transformers + ONNX Runtime",
    "st-onnx-int8": "sentence-transformers + ONNX Runtime dynamic int8 (avx512_vnni)",
    "st-openvino-int8": "sentence-transformers + OpenVINO static int8",
    "vllm": "vLLM (CPU build)",
}
# The bar each kind of engine is held to: float32 / bfloat16 min cosine, int8 (min, mean) from
# issue 17 item 3.
COSINE_MIN = {"float32": 0.99999, "bfloat16": 0.999}
INT8_COSINE = (0.99, 0.995)


def agreement(out: np.ndarray, ref: np.ndarray, task: str, kind: str, cos_texts: int) -> dict:
    """Embeddings: min / mean cosine to the reference over the first cos_texts rows (0: all);
    scores: max abs difference and Pearson r over all."""
    if task == "embed":
        rows = slice(None) if cos_texts <= 0 else slice(0, cos_texts)
        a = out[rows] / np.linalg.norm(out[rows], axis=1, keepdims=True)
        b = ref[rows] / np.linalg.norm(ref[rows], axis=1, keepdims=True)
        cos = (a * b).sum(axis=1)
        low, mean = float(cos.min()), float(cos.mean())
        if kind == "int8":
            ok = low >= INT8_COSINE[0] and mean >= INT8_COSINE[1]
            bar = f"min >= {INT8_COSINE[0]}, mean >= {INT8_COSINE[1]}"
        else:
            ok = low >= COSINE_MIN[kind]
            bar = f">= {COSINE_MIN[kind]}"
        return {
            "min_cosine": low,
            "mean_cosine": mean,
            "cos_rows": len(cos),
            "agrees": ok,
            "agreement": f"cos min {low:.6f} mean {mean:.6f} ({len(cos)} rows) "
            f"{'ok' if ok else 'FAIL'} ({bar})",
        }
    out, ref = out.reshape(-1), ref.reshape(-1)
    diff = float(np.abs(out - ref).max())
    r = float(np.corrcoef(out, ref)[0, 1])
    return {"max_abs_diff": diff, "pearson": r, "agreement": f"max abs diff {diff:.2e}, r {r:.6f}"}


def print_section(section: str, dtype: str, res: dict) -> None:
    samples = res["gemm_samples"]
    line = (
        f"  mean {res['mean_len']:.1f} tokens/input; roofline "
        f"{res['roofline_tokens_s']:,.0f} tokens/s ({dtype}; GEMM GFLOP/s samples "
        f"{', '.join(f'{g:.0f}' for g in samples[dtype])})"
    )
    if res.get("int8_roofline_tokens_s"):
        line += (
            f"; int8 roofline {res['int8_roofline_tokens_s']:,.0f} tokens/s (torch._int_mm "
            f"GOP/s {', '.join(f'{g:.0f}' for g in samples['int8'])})"
        )
    print(line)
    for name, e in res["engines"].items():
        line = (
            f"  {ENGINE_NAMES[name]:22s} {e['tokens_s']:9,.0f} tokens/s "
            f"{e['items_s']:8.1f} inputs/s  {e['tokens_per_cpu_s']:8,.0f} tokens/CPU-s  "
            f"roofline {e['roofline_share']:5.1%}"
        )
        if "int8_roofline_share" in e:
            line += f" (int8 {e['int8_roofline_share']:5.1%})"
        if "tidepool_ratio" in e:
            line += f"  tidepool/{ENGINE_NAMES[name]} {e['tidepool_ratio']:.2f}x"
        line += f"  {e['agreement']}"
        print(line, flush=True)
    for name, lat in res.get("latency", {}).items():
        print(
            f"  latency {ENGINE_NAMES[name]:22s} p50 {lat['p50_ms']:6.2f} ms  "
            f"p99 {lat['p99_ms']:6.2f} ms  ({lat['calls']} calls)",
            flush=True,
        )


def print_issue_table(section: str, dtype: str, res: dict) -> None:
    """Issue 17's table: tokens/s, throughput relative to tidepool, cosine to the reference."""
    ref_name = "tidepool" if "tidepool" in res["engines"] else None
    num_rounds = len(next(iter(res["engines"].values()))["seconds"])
    print(
        f"\n  {section} {dtype}: {res['num_inputs']} inputs, {res['num_tokens']:,} tokens "
        f"(mean {res['mean_len']:.0f}), medians of {num_rounds}"
    )
    agree = "cos to ST float32 (min / mean)" if res["task"] == "embed" else "vs ST float32"
    print(f"  | engine | tokens/s | vs tidepool {dtype} | {agree} | roofline | tokens / CPU-s |")
    print("  | --- | ---: | ---: | --- | ---: | ---: |")
    for name, e in res["engines"].items():
        ratio = "1.00x" if name == ref_name else (
            f"{e['vs_tidepool']:.2f}x" if "vs_tidepool" in e else "—"
        )  # fmt: skip
        cos = (
            f"{e['min_cosine']:.7f} / {e['mean_cosine']:.7f}"
            if "min_cosine" in e
            else f"max abs diff {e['max_abs_diff']:.1e}, r {e['pearson']:.6f}"
        )
        roof = f"{e['roofline_share']:.0%}"
        if "int8_roofline_share" in e:
            roof += f" (int8: {e['int8_roofline_share']:.0%})"
        print(
            f"  | {ISSUE_NAMES[name]} | {e['tokens_s']:,.0f} | {ratio} | {cos} | {roof} "
            f"| {e['tokens_per_cpu_s']:,.0f} |"
        )
    print(flush=True)


def print_summary(results: dict) -> None:
    print("\n## Summary (medians over rounds; ratio = tidepool throughput / peer's)\n")
    print(f"CPU: {results.get('cpu', '?')}; load average at start {results.get('load', '?')}\n")
    print(
        "| section | dtype | engine | tokens/s | inputs/s | tidepool / engine | roofline | agreement |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | --- |")
    for section, by_dtype in results["sections"].items():
        for dtype, res in by_dtype.items():
            for name, e in res["engines"].items():
                ratio = f"{e['tidepool_ratio']:.2f}x" if "tidepool_ratio" in e else "—"
                roof = f"{e['roofline_share']:.1%}"
                if "int8_roofline_share" in e:
                    roof += f" (int8 {e['int8_roofline_share']:.1%})"
                print(
                    f"| {section} | {dtype} | {ENGINE_NAMES[name]} | {e['tokens_s']:,.0f} | "
                    f"{e['items_s']:.1f} | {ratio} | {roof} | {e['agreement']} |"
                )
    lat_rows = [
        (dtype, name, lat)
        for dtype, res in results["sections"].get("embed", {}).items()
        for name, lat in res.get("latency", {}).items()
    ]
    if lat_rows:
        tokens = results.get("latency_tokens", "?")
        print(f"\n| latency, one {tokens}-token text | dtype | p50 ms | p99 ms |")
        print("| --- | --- | ---: | ---: |")
        for dtype, name, lat in lat_rows:
            print(f"| {ENGINE_NAMES[name]} | {dtype} | {lat['p50_ms']:.2f} | {lat['p99_ms']:.2f} |")
    for skipped in results.get("skipped", []):
        print(f"\nskipped: {skipped}")
