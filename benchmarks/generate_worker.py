"""One generating engine in its own process, driven by `generate_vs_vllm.py` over stdin / stdout.

Runs under the python of the engine's own venv (vLLM's CPU build lives in /work/venv-vllm), so it
imports only the standard library at module level, then the engine's library once told which.

    python generate_worker.py --engine tidepool|vllm --model PATH --prompts prompts.json
                              --new-tokens N [--max-model-len 2048] [--max-num-seqs 256]
                              [--max-num-batched-tokens 8192]

prompts.json: a list of token-id lists. Greedy, EOS ignored, prefix caching off, float32. Each
{"cmd": "run"} line generates for every prompt and answers one JSON line: wall seconds, the
output tokens, CPU seconds (the process and its children: on a shared machine the engines'
shares of the cores differ), time to first token and inter-token latencies (p50 / p99), and the
outputs' token ids; {"cmd": "quit"} ends. Token times are taken where the engine core hands a step's new
tokens to output processing (tidepool: the scheduler's update; vLLM: its output processor's
process_outputs), the same point in both engines' step, before detokenization.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def _tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` and its live descendants (vLLM's engine core
    is a child process), from /proc; 0 where /proc cannot be read."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                total += sum(_tree_cpu_seconds(int(c)) for c in f.read().split())
    except (OSError, ValueError, IndexError):
        pass
    return total


class TokenClock:
    """Arrival time of each request's tokens (request id → [times])."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    def saw(self, request_id: str, num_tokens: int) -> None:
        now = time.perf_counter()
        self.times.setdefault(request_id, []).extend([now] * num_tokens)

    def summary(self, start: float) -> dict:
        ttft = [t[0] - start for t in self.times.values() if t]
        gaps = [b - a for t in self.times.values() for a, b in zip(t, t[1:], strict=False)]
        return {
            "ttft_p50": _percentile(ttft, 0.5),
            "ttft_p99": _percentile(ttft, 0.99),
            "itl_p50": _percentile(gaps, 0.5),
            "itl_p99": _percentile(gaps, 0.99),
        }


def kv_bytes(args) -> dict:
    """The KV-cache budget in bytes where --kv-cache-memory-bytes gives one (both engines take
    `kv_cache_memory_bytes`; vLLM's CPU worker uses it instead of VLLM_CPU_KVCACHE_SPACE)."""
    return (
        {"kv_cache_memory_bytes": args.kv_cache_memory_bytes} if args.kv_cache_memory_bytes else {}
    )


class Tidepool:
    def __init__(self, args) -> None:
        import tidepool  # noqa: F401  (OpenMP defaults before torch)
        from tidepool import LLM, SamplingParams

        self.llm = LLM(
            args.model,
            dtype="float32",
            enable_prefix_caching=False,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            **kv_bytes(args),
        )
        self.params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        self.clock = TokenClock()
        scheduler = self.llm.engine.scheduler
        update = scheduler.update

        def timed_update(*a, **k):
            outputs = update(*a, **k)
            for out in outputs:
                new = getattr(out, "new_token_ids", None)
                if new:
                    self.clock.saw(out.request_id, len(new))
            return outputs

        scheduler.update = timed_update

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], self.params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    def info(self) -> dict:
        import torch

        import tidepool

        return {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "tidepool": os.path.dirname(tidepool.__file__),
        }


class VLLM:
    def __init__(self, args) -> None:
        import vllm

        self.vllm = vllm
        self.llm = vllm.LLM(
            model=args.model,
            dtype="float32",
            enable_prefix_caching=False,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            seed=0,
            **kv_bytes(args),
        )
        self.params = vllm.SamplingParams(
            temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True
        )
        self.clock = TokenClock()
        processor = self.llm.llm_engine.output_processor
        process = processor.process_outputs

        def timed_process(engine_core_outputs, *a, **k):
            for out in engine_core_outputs:
                if out.new_token_ids:
                    self.clock.saw(out.request_id, len(out.new_token_ids))
            return process(engine_core_outputs, *a, **k)

        processor.process_outputs = timed_process

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], self.params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    def info(self) -> dict:
        import torch

        return {
            "vllm": self.vllm.__version__,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", required=True, choices=["tidepool", "vllm"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    args = parser.parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # everything the libraries print goes to stderr
    engine = (Tidepool if args.engine == "tidepool" else VLLM)(args)
    engine.generate(prompts[:2])  # warm-up
    protocol.write(json.dumps({"ready": True, **engine.info()}) + "\n")
    protocol.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        engine.clock.times.clear()
        cpu_start = _tree_cpu_seconds(os.getpid())
        start = time.perf_counter()
        outputs = engine.generate(prompts)
        seconds = time.perf_counter() - start
        result = {
            "seconds": seconds,
            "cpu_seconds": _tree_cpu_seconds(os.getpid()) - cpu_start,
            "tokens": sum(len(o) for o in outputs),
            **engine.clock.summary(start),
            "outputs": outputs,
        }
        protocol.write(json.dumps(result) + "\n")
        protocol.flush()


if __name__ == "__main__":
    main()
