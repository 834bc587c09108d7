"""A BERT layer's four int8 linears as the model chains them, on tidepool's own GEMM (AMX tiles
where the CPU has AMX-INT8, else the VNNI kernel: AVX-512 VNNI or AVX-VNNI, whichever
kernels/cpu_features.py chose; TIDEPOOL_CPU_ISA caps it) against oneDNN's int8 GEMM +
tidepool's epilogue kernels (TIDEPOOL_INT8_GEMM=onednn), side by side. The header names the CPU's
instruction sets and the kernel each side ran.

Per step size (tokens) and model shape, both variants of the same layers (same weights, same
asymmetric per-token inputs) run alternately; medians of --rounds, milliseconds per call:

  qkv    hidden → 3·hidden, float32 out (the attention reads it)
  o      hidden → hidden, + residual, LayerNorm, the row quantized for FFN up (handoff)
  up     hidden → 4·hidden, GELU, quantized for FFN down; tidepool's GEMM writes no float32
  down   4·hidden → hidden, + residual, LayerNorm, quantized for the next layer's QKV

    python benchmarks/int8_layers.py [--threads 1] [--tokens 1024,4096] [--hidden 384,768]
                                     [--cpu-time]

--cpu-time times each call by the calling thread's CPU time (one thread only): on a loaded
machine it leaves out the time the thread was descheduled, which wall time cannot.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# tidepool sets OpenMP's wait policy when imported, before torch loads: the same for both sides.
import tidepool  # noqa: F401

# isort: split
import torch

from tidepool.kernels import cpu_features
from tidepool.models.layers.linear import Linear
from tidepool.quantization.int8_linear import Int8Linear

VARIANTS = ("onednn", "auto")  # TIDEPOOL_INT8_GEMM values: oneDNN + epilogue kernels, ours


def _linear(k: int, n: int, activation: str | None, variant: str) -> Int8Linear:
    torch.manual_seed(k * 7 + n)
    linear = Linear(k, n, activation=activation)
    with torch.no_grad():
        linear.weight.normal_(0, k**-0.5)
        linear.bias.normal_(0, 0.1)
    os.environ["TIDEPOOL_INT8_GEMM"] = variant
    try:
        return Int8Linear.from_linear(linear, asym=True)
    finally:
        del os.environ["TIDEPOOL_INT8_GEMM"]


def _layer_calls(hidden: int, tokens: int, variant: str) -> dict[str, object]:
    qkv = _linear(hidden, 3 * hidden, None, variant)
    o = _linear(hidden, hidden, None, variant)
    up = _linear(hidden, 4 * hidden, "gelu", variant)
    down = _linear(4 * hidden, hidden, None, variant)
    o.feed(up)
    up.feed(down, exclusive=True)
    norm = torch.nn.LayerNorm(hidden)
    x, residual = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
    state: dict[str, torch.Tensor] = {}

    def run_o() -> None:
        state["h"] = o.forward_norm(x, residual, norm)

    def run_up() -> None:
        state["inner"] = up(state["h"])

    def run_down() -> None:
        down.forward_norm(state["inner"], state["h"], norm)

    return {"qkv": lambda: qkv(x), "o": run_o, "up": run_up, "down": run_down}


def measure(hidden: int, tokens: int, rounds: int, clock=time.perf_counter) -> dict:
    calls = {v: _layer_calls(hidden, tokens, v) for v in VARIANTS}
    times: dict[str, dict[str, list[float]]] = {v: {n: [] for n in calls[v]} for v in VARIANTS}
    for _ in range(rounds):
        for variant in VARIANTS:
            for name, call in calls[variant].items():  # in order: each feeds the next
                start = clock()
                call()
                times[variant][name].append(clock() - start)
    return {v: {n: statistics.median(t[1:]) * 1e3 for n, t in times[v].items()} for v in VARIANTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", default="1024,4096")
    parser.add_argument("--hidden", default="384,768")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--cpu-time", action="store_true", help="thread CPU time (1 thread)")
    args = parser.parse_args()
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time measures the calling thread: it needs --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_features.describe()}")
    kernel = repr(_linear(64, 64, None, "auto")).split("kernels=")[1].rstrip(")")
    print(
        f"{args.threads} thread(s); ms per call ({'CPU' if args.cpu_time else 'wall'} time), "
        f"medians of {args.rounds - 1} (after one warm-up);"
        f" tidepool's GEMM: kernels={kernel}"
    )
    print("| hidden | tokens | linear | oneDNN + epilogues | tidepool | speed-up |")
    print("| ---: | ---: | --- | ---: | ---: | ---: |")
    for hidden in (int(h) for h in args.hidden.split(",")):
        for tokens in (int(t) for t in args.tokens.split(",")):
            res = measure(hidden, tokens, args.rounds, clock)
            total = {v: sum(res[v].values()) for v in VARIANTS}
            for name in [*res["auto"], "all four"]:
                old, new = (res[v].get(name, total[v]) for v in VARIANTS)
                print(
                    f"| {hidden} | {tokens} | {name} | {old:.2f} | {new:.2f} | {old / new:.2f}x |"
                )


if __name__ == "__main__":
    main()
