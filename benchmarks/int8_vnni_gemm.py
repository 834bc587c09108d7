"""The VNNI int8 GEMM's speed per shape against the int8 roofline, one thread, CPU time.

For each of a BERT layer's four shapes (QKV, attention output, FFN up, FFN down at a hidden
size) the op (csrc/cpu_int8_vnni.cpp, the build kernels/cpu_features.py chose, or --isa) runs
one- and two-part, asymmetric uint8 inputs, with each layer's own epilogue (bias; GELU on FFN
up), against `torch._int_mm` on the same integers (int32 out, no epilogue: oneDNN's GEMM, the
roofline benchmarks/roofline.py quotes). GOP/s = 2·T·K·N / time (two-part: the useful product
counted once, so its GOP/s is half of what the kernel executes); rounds alternate the sides,
medians; the thread's CPU time leaves out time descheduled on a loaded machine.

    python benchmarks/int8_vnni_gemm.py [--tokens 4096] [--hidden 384,768] [--rounds 5]
                                        [--isa avx512_vnni|avx2_vnni]
"""

from __future__ import annotations

import argparse
import statistics
import time

import tidepool  # noqa: F401  (OpenMP's wait policy before torch loads)

# isort: split
import torch

from tidepool.kernels import cpu_features
from tidepool.quantization import int8_ops


def _cpu_time(fn, min_seconds: float = 0.05) -> float:
    fn()
    calls, start = 0, time.thread_time()
    while True:
        fn()
        calls += 1
        spent = time.thread_time() - start
        if spent >= min_seconds:
            return spent / calls


def _case(ops, t: int, k: int, n: int, two_part: bool, gelu: bool):
    g = torch.Generator().manual_seed(k * 31 + n)
    q = torch.randint(0, 256, (t, k), generator=g, dtype=torch.int32).to(torch.uint8)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int32).to(torch.int8)
    packed, comp = int8_ops.pack_weight_vnni(w)
    lo, comp_lo = int8_ops.pack_weight_vnni(w) if two_part else (None, None)
    w_scale, bias = torch.rand(n) * 1e-3, torch.randn(n)
    scale, zero = torch.rand(t, 1) * 1e-2, torch.rand(t, 1)
    wsum = w_scale * w.sum(1).float()
    out = torch.empty(t, n)
    args = (q, packed, lo, comp, comp_lo, w_scale, scale, zero, wsum, bias, 1 if gelu else 0,
            None, None, None, None, 1e-12, None, None, None, None, out, True)  # fmt: skip
    qs, wt = (q.to(torch.int16) - 128).to(torch.int8), w.t().contiguous()
    return (lambda: ops.linear(*args)), (lambda: torch._int_mm(qs, wt))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="4096")
    parser.add_argument("--hidden", default="384,768")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--isa", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    isa = args.isa or int8_ops.vnni_isa()
    ops = int8_ops.load_vnni(isa)
    print(f"CPU: {cpu_features.describe()}")
    print(f"VNNI build {isa}; 1 thread, CPU time, medians of {args.rounds} alternating rounds")
    print(
        "| T | K → N | layer | one-part GOP/s | two-part GOP/s (useful) | _int_mm GOP/s | one / _int_mm |"
    )
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for t in (int(v) for v in args.tokens.split(",")):
        for h in (int(v) for v in args.hidden.split(",")):
            for name, k, n in (
                ("qkv", h, 3 * h),
                ("o", h, h),
                ("up", h, 4 * h),
                ("down", 4 * h, h),
            ):
                one, ref = _case(ops, t, k, n, False, name == "up")
                two, _ = _case(ops, t, k, n, True, name == "up")
                times: dict[str, list[float]] = {"one": [], "two": [], "ref": []}
                for _ in range(args.rounds):
                    for key, fn in (("one", one), ("two", two), ("ref", ref)):
                        times[key].append(_cpu_time(fn))
                gops = {key: 2 * t * k * n / statistics.median(v) / 1e9 for key, v in times.items()}
                print(
                    f"| {t} | {k} → {n} | {name} | {gops['one']:.0f} | {gops['two']:.0f} | "
                    f"{gops['ref']:.0f} | {gops['one'] / gops['ref']:.2f} |"
                )


if __name__ == "__main__":
    main()
