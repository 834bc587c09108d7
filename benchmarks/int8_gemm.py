"""int8 GEMM candidates against the float32 / bfloat16 GEMMs the encoders run today, side by side.

For each linear shape of a model ([tokens, in] x [in, out]) it times, alternating the sides and
taking medians, in GOP/s (2 x tokens x in x out per call):

  f32         oneDNN float32 with a pre-packed weight and the bias fused (what models/layers/
              linear.py runs today: torch.ops.mkldnn._linear_pointwise)
  bf16        the same in bfloat16 (AMX where the CPU has it)
  int_mm      torch._int_mm, int8 x int8 → int32, the GEMM alone (no scales, no bias)
  qlin        torch.ops.onednn.qlinear_pointwise: int8 activations (one scale per tensor), int8
              weights pre-packed (one scale per output channel), float32 out, bias fused: the
              GEMM with its dequantization
  qlin_i8out  the same with int8 output (a requantizing post-op; what feeds a following int8 GEMM)

and the whole layer as an int8 mode would run it, quantizing its float32 input first:

  dyn_tok     tidepool's Int8Linear (quantization/int8_linear.py): per-token scales (row max,
              one addcmul that rounds, a cast), qlinear with scale 1 and no bias (float32 out),
              then the row scales and the bias in one addcmul
  dyn_tok_mm  the same with torch._int_mm and an eager dequantization
  static      one calibrated scale per tensor: quantize (one pass) + qlin

    python benchmarks/int8_gemm.py [--threads 1] [--tokens 64,256,1024,4096] [--models minilm,bert]
"""

from __future__ import annotations

import argparse
import statistics
import time

# tidepool sets OpenMP's wait policy when imported, before torch loads: the same for all sides.
import tidepool  # noqa: F401

# isort: split
import torch

from tidepool.models.layers.linear import Linear
from tidepool.quantization.int8_linear import Int8Linear, quantize_per_token

MODEL_SHAPES = {
    # (in, out) of one layer's GEMMs: fused QKV, attention output, FFN up, FFN down.
    "minilm": [(384, 1152), (384, 384), (384, 1536), (1536, 384)],
    "bert": [(768, 2304), (768, 768), (768, 3072), (3072, 768)],
}


def _quantize_per_tensor(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.round(x * (1.0 / scale)).clamp_(-127, 127).to(torch.int8)


def _sides(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict[str, object]:
    """Name → a zero-argument callable computing that side's linear of x."""
    tokens, in_f = x.shape
    out_f = w.shape[0]
    onednn = torch.ops.onednn
    w_scale = w.abs().amax(dim=1).div_(127.0)
    qw = torch.round(w / w_scale[:, None]).to(torch.int8)
    qw_t = qw.t().contiguous()
    qw_packed = onednn.qlinear_prepack(qw, [tokens, in_f])
    w_zp = torch.zeros(out_f, dtype=torch.int64)
    x_scale = float(x.abs().max()) / 127.0
    qx = _quantize_per_tensor(x, x_scale)
    qx_tok, tok_scale = quantize_per_token(x)
    f32_packed = torch.ops.mkldnn._reorder_linear_weight(w, 4096)
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    bf16_packed = torch.ops.mkldnn._reorder_linear_weight(wb, 4096)

    def qlin(q, scale, bias, out_dtype=torch.float32, out_scale=1.0):
        return onednn.qlinear_pointwise(
            q, scale, 0, qw_packed, w_scale, w_zp, bias, out_scale, 0, out_dtype, "none", [], ""
        )

    layer = Linear(in_f, out_f)
    layer.weight.data, layer.bias.data = w, b
    int8_layer = Int8Linear.from_linear(layer)

    def dyn_tok_mm():
        q, scale = quantize_per_token(x)
        return torch._int_mm(q, qw_t).float().mul_(scale * w_scale).add_(b)

    return {
        "f32": lambda: torch.ops.mkldnn._linear_pointwise(x, f32_packed, b, "none", [], ""),
        "bf16": lambda: torch.ops.mkldnn._linear_pointwise(xb, bf16_packed, bb, "none", [], ""),
        "int_mm": lambda: torch._int_mm(qx_tok, qw_t),
        "qlin": lambda: qlin(qx, x_scale, b),
        "qlin_i8out": lambda: qlin(qx, x_scale, b, torch.int8, 0.05),
        "dyn_tok": lambda: int8_layer(x),
        "dyn_tok_mm": dyn_tok_mm,
        "static": lambda: qlin(_quantize_per_tensor(x, x_scale), x_scale, b),
        "_scale": tok_scale,
    }


def _time_once(fn, min_seconds: float) -> float:
    """Seconds per call, over enough calls to last `min_seconds`."""
    calls = 0
    start = time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / calls


def measure(tokens: int, in_f: int, out_f: int, rounds: int, min_seconds: float) -> dict:
    torch.manual_seed(0)
    x = torch.randn(tokens, in_f)
    w = torch.randn(out_f, in_f) * in_f**-0.5
    b = torch.randn(out_f) * 0.1
    sides = {k: v for k, v in _sides(x, w, b).items() if not k.startswith("_")}
    for fn in sides.values():
        fn()  # build each primitive once before timing
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            times[name].append(_time_once(fn, min_seconds))
    ops = 2.0 * tokens * in_f * out_f
    return {name: ops / statistics.median(t) / 1e9 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", default="64,256,1024,4096")
    parser.add_argument("--models", default="minilm,bert")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-seconds", type=float, default=0.05)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), GOP/s (medians of {args.rounds})")
    header = None
    for model in args.models.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            for in_f, out_f in MODEL_SHAPES[model]:
                gops = measure(tokens, in_f, out_f, args.rounds, args.min_seconds)
                if header is None:
                    header = f"{'model':7} {'T':>5} {'in->out':>10} " + " ".join(
                        f"{name:>10}" for name in gops
                    )
                    print(header)
                cells = " ".join(f"{v:10.1f}" for v in gops.values())
                ratio = gops["dyn_tok"] / gops["f32"]
                print(
                    f"{model:7} {tokens:5d} {f'{in_f}->{out_f}':>10} {cells}   "
                    f"dyn_tok/f32 {ratio:.2f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
