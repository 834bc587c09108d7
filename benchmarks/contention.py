"""Throughput with one core taken by another process, against the same engine quiet (issue 27).

For each OpenMP policy (--policies; each in a fresh process, since OpenMP reads its variables
when torch loads), one `LLM` embeds the corpus' first --texts texts in rounds; each round runs
one pass quiet and one pass with a busy-loop process pinned to CPU 0 (the order alternating by
round), so both regimes see the same background. Prints each pass's tokens/s, each regime's
median, and the median of the per-round ratios busy / quiet: a lost core alone explains 0.5x on
2 cores; OpenMP threads waiting on a descheduled peer show as far less.

    python benchmarks/contention.py [--quantization int8] [--dtype float32] [--texts 300]
        [--rounds 3] [--policies tidepool,active,spin0,threads1]

Policies: tidepool (its default: PASSIVE with GOMP_SPINCOUNT=envs.SPIN_COUNT), active
(OMP_WAIT_POLICY=ACTIVE: libgomp spins without bound), spin0 (PASSIVE, GOMP_SPINCOUNT=0),
spinN (PASSIVE, GOMP_SPINCOUNT=N), threads1 (tidepool's default on one thread), libgomp
(no OMP_WAIT_POLICY at all: libgomp's own default spin, 300k rounds; what a user who imports
torch before tidepool gets). Prints the CPU's flags; the machine's load is printed per pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_BURN = "import os\nos.sched_setaffinity(0, {0})\nwhile True:\n    pass\n"


def policy_env(policy: str) -> dict[str, str]:
    """The environment of one policy's child (on top of ours, without OpenMP variables)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "TIDEPOOL_NUM_THREADS")
    }
    if policy == "active":
        env["OMP_WAIT_POLICY"] = "ACTIVE"
    elif policy == "libgomp":
        env["TIDEPOOL_NO_OMP_DEFAULTS"] = "1"  # the child imports torch before tidepool
    elif policy.startswith("spin"):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
        env["GOMP_SPINCOUNT"] = policy[4:]
    elif policy == "threads1":
        env["TIDEPOOL_NUM_THREADS"] = "1"
    elif policy != "tidepool":
        raise SystemExit(f"unknown policy {policy!r}")
    return env


def child(args: argparse.Namespace) -> None:
    if os.environ.get("TIDEPOOL_NO_OMP_DEFAULTS"):
        import torch  # noqa: F401  (before tidepool: libgomp keeps its own defaults)
    import tidepool  # noqa: F401

    sys.path.insert(0, _HERE)
    import torch
    from corpus import make_corpus

    from tidepool import LLM

    texts = make_corpus(args.texts)
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization)
    tokenizer = llm.get_tokenizer()
    max_len = llm.model_config.max_model_len
    num_tokens = sum(min(len(ids), max_len) for ids in tokenizer(texts)["input_ids"])

    def one_pass() -> float:
        start = time.perf_counter()
        llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
        return num_tokens / (time.perf_counter() - start)

    llm.embed(texts[:64], truncate_prompt_tokens=-1, use_tqdm=False)  # warm-up
    rows = []
    for r in range(args.rounds):
        order = ("quiet", "busy") if r % 2 == 0 else ("busy", "quiet")
        got = {}
        for regime in order:
            burner = None
            if regime == "busy":
                burner = subprocess.Popen([sys.executable, "-c", _BURN])
                time.sleep(0.5)
            try:
                got[regime] = one_pass()
            finally:
                if burner is not None:
                    burner.kill()
                    burner.wait()
            got[f"load_{regime}"] = os.getloadavg()[0]
        rows.append(got)
        print(json.dumps(got), file=sys.stderr, flush=True)
    print(json.dumps({"threads": torch.get_num_threads(), "tokens": num_tokens, "rounds": rows}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--texts", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--policies", default="tidepool,active,spin0,threads1")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    sys.path.insert(0, os.path.join(_HERE, "..", "src"))
    from tidepool.kernels import cpu_features

    print(f"CPU: {cpu_features.describe()}; {os.cpu_count()} CPUs")
    mode = args.quantization or args.dtype
    print(
        f"{args.model} {mode}, {args.texts} texts, {args.rounds} rounds (quiet / busy alternating)"
    )
    summary = []
    for policy in args.policies.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model]
        cmd += ["--dtype", args.dtype, "--texts", str(args.texts), "--rounds", str(args.rounds)]
        if args.quantization:
            cmd += ["--quantization", args.quantization]
        out = subprocess.run(cmd, env=policy_env(policy), capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{policy}: failed\n{out.stderr[-2000:]}")
            continue
        result = json.loads(out.stdout.strip().splitlines()[-1])
        rounds = result["rounds"]
        quiet = statistics.median(r["quiet"] for r in rounds)
        busy = statistics.median(r["busy"] for r in rounds)
        ratio = statistics.median(r["busy"] / r["quiet"] for r in rounds)
        passes = " ".join(f"{r['quiet']:,.0f}/{r['busy']:,.0f}" for r in rounds)
        loads = " ".join(f"{r['load_quiet']:.1f}/{r['load_busy']:.1f}" for r in rounds)
        print(
            f"{policy:>9} ({result['threads']} threads): quiet {quiet:9,.0f} tok/s, busy "
            f"{busy:9,.0f} tok/s, busy/quiet {ratio:.2f}x  [passes quiet/busy: {passes}; "
            f"load {loads}]",
            flush=True,
        )
        summary.append({"policy": policy, "quiet": quiet, "busy": busy, "ratio": ratio})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
