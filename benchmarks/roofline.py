"""The machine's GEMM roofline for an encoder, so a throughput figure can say how close it gets.

Measures GFLOP/s of the model's own linear shapes ([tokens, in] x [in, out], all cores) in float32
and bfloat16 with the fastest GEMM torch offers here (oneDNN through F.linear on CPU), and the
model's FLOPs per token (linear layers: 2 x weights; attention: 4 x seq_len x hidden per layer).
The roofline in tokens/s is what the model would reach if every FLOP ran at GEMM speed.

    python benchmarks/roofline.py [--model sentence-transformers/all-MiniLM-L6-v2] [--seq-len 81]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

# tidepool sets OpenMP's wait policy when imported, before torch loads: the same for all sides.
import tidepool  # noqa: F401

# isort: split
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class EncoderShape:
    hidden: int
    intermediate: int
    num_layers: int

    @classmethod
    def from_hf_config(cls, config) -> EncoderShape:
        # T5 names them d_ff / num_layers (its config aliases hidden_size to d_model)
        intermediate = getattr(config, "intermediate_size", None) or config.d_ff
        return cls(config.hidden_size, intermediate, config.num_hidden_layers)

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of one layer's GEMMs: fused QKV, attention output, FFN up, FFN down."""
        h, i = self.hidden, self.intermediate
        return [(h, 3 * h), (h, h), (h, i), (i, h)]

    def flops_per_token(self, seq_len: float) -> float:
        linear = sum(2 * a * b for a, b in self.linear_shapes())
        attention = 4 * seq_len * self.hidden  # QK^T and PV
        return self.num_layers * (linear + attention)


@dataclass(frozen=True)
class DecoderShape:
    """A Llama / Qwen3-style decoder body: grouped-query attention, SwiGLU MLP."""

    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, config) -> DecoderShape:
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            config.hidden_size,
            config.intermediate_size,
            config.num_hidden_layers,
            num_heads,
            config.num_key_value_heads,
            head_dim,
        )

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out): fused QKV, attention output, fused gate + up, down."""
        h, i = self.hidden, self.intermediate
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]

    def flops_per_token(self, seq_len: float) -> float:
        """Worked example, Qwen3-Embedding-0.6B's body (1024, 16 / 8 heads of 128, MLP 3072):
        linear 2 x (1024 x 4096 + 2048 x 1024 + 1024 x 6144 + 3072 x 1024) = 31.5 MFLOP per
        layer, x 8 layers = 252 MFLOP; causal attention adds 4 x (seq_len / 2) x 2048 per layer."""
        linear = sum(2 * a * b for a, b in self.linear_shapes())
        attention = 4 * (seq_len / 2) * self.num_heads * self.head_dim
        return self.num_layers * (linear + attention)


def _median_time(fn, reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gemm_candidates(w: torch.Tensor, b: torch.Tensor):
    """The GEMMs torch offers here: F.linear, and oneDNN with a pre-packed weight on CPU."""
    yield lambda x: F.linear(x, w, b)
    if w.device.type == "cpu" and torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 4096)
        yield lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


def gemm_gflops(shape: EncoderShape, dtype: torch.dtype, num_tokens: int = 4096) -> float:
    """GFLOP/s over one layer's GEMMs at the model's shapes (weighted by their FLOPs), each shape
    with the fastest GEMM available."""
    total_flops = 0.0
    total_time = 0.0
    for in_f, out_f in shape.linear_shapes():
        x = torch.randn(num_tokens, in_f, dtype=dtype)
        w = torch.randn(out_f, in_f, dtype=dtype)
        b = torch.randn(out_f, dtype=dtype)
        total_time += min(
            _median_time(lambda gemm=gemm, x=x: gemm(x)) for gemm in _gemm_candidates(w, b)
        )
        total_flops += 2.0 * num_tokens * in_f * out_f
    return total_flops / total_time / 1e9


def int8_gemm_gops(shape, num_tokens: int = 4096) -> float:
    """GOP/s of `torch._int_mm` (int8 x int8 -> int32) over the model's linear shapes: the int8
    roofline an int8 engine can be held up against (no dequantize, no bias: the bare GEMM)."""
    total_ops = 0.0
    total_time = 0.0
    for in_f, out_f in shape.linear_shapes():
        x = torch.randint(-128, 128, (num_tokens, in_f), dtype=torch.int8)
        w = torch.randint(-128, 128, (out_f, in_f), dtype=torch.int8).t()  # [in, out], as a weight
        total_time += _median_time(lambda x=x, w=w: torch._int_mm(x, w))
        total_ops += 2.0 * num_tokens * in_f * out_f
    return total_ops / total_time / 1e9


def roofline(shape: EncoderShape, dtype: torch.dtype, seq_len: float) -> dict[str, float]:
    gflops = gemm_gflops(shape, dtype)
    per_token = shape.flops_per_token(seq_len)
    return {
        "gemm_gflops": gflops,
        "mflop_per_token": per_token / 1e6,
        "tokens_per_s": gflops * 1e9 / per_token,
    }


def main() -> None:
    from transformers import AutoConfig

    from tidepool.checkpoint.loader import DEFAULT_MODEL, resolve_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--seq-len", type=float, default=81.0, help="mean tokens per text")
    args = parser.parse_args()
    shape = EncoderShape.from_hf_config(AutoConfig.from_pretrained(resolve_model_path(args.model)))
    print(f"threads={torch.get_num_threads()} model={args.model} {shape}")
    for dtype in (torch.float32, torch.bfloat16):
        r = roofline(shape, dtype, args.seq_len)
        print(
            f"{str(dtype):15s} GEMM {r['gemm_gflops']:7.0f} GFLOP/s | "
            f"{r['mflop_per_token']:.1f} MFLOP/token | roofline {r['tokens_per_s']:9,.0f} tokens/s"
        )


if __name__ == "__main__":
    main()
