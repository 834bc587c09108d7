"""One engine in its own process, driven by `peers.py` over stdin / a private stdout.

Runs under the python of the engine's own venv (vLLM's CPU build lives in a separate venv), so it
imports nothing from tidepool or the benchmarks at module level: only the standard library and
numpy, then the engine's library once told which one.

    python peer_worker.py --engine ENGINE --task embed|score --model PATH
                          --dtype float32|bfloat16 --inputs inputs.json [--max-len 256]

Engines (ENGINES): tidepool, tidepool-int8 (`quantization="int8"`), st (sentence-transformers on
torch), st-onnx / st-onnx-int8 / st-openvino / st-openvino-int8 (its exported backends, made and
cached by peer_exports.py in --export-dir), vllm.

inputs.json: {"texts": [...]} for embed, {"pairs": [[query, passage], ...]} for score, and
optionally "latency_text" and "calibration" (texts or pairs for the static int8 export). The
worker loads the model, warms up, and answers one JSON line per command read from stdin:
{"cmd": "run", "dump": path-or-null, "reset_prefix_cache": bool} times the engine over all inputs
(emptying the prefix cache first, untimed, when asked); {"cmd": "latency", "calls": N} times N
single-text `embed` calls; {"cmd": "quit"}. Everything the libraries print goes to stderr, so the
protocol channel carries nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import numpy as np


class Engine:
    """The same three calls over each library: run(all inputs), one(text), and info."""

    def __init__(self, args: argparse.Namespace, inputs: dict) -> None:
        self.args = args
        self.inputs = inputs
        self.items = inputs["texts"] if args.task == "embed" else inputs["pairs"]

    def run(self, items) -> tuple[float, np.ndarray, int | None]:
        """(seconds, outputs as float32 array, tokens the engine saw or None)."""
        raise NotImplementedError

    def one(self, text: str) -> None:
        raise NotImplementedError

    def info(self) -> dict:
        return {}

    def reset_prefix_cache(self) -> None:
        raise NotImplementedError(f"{self.args.engine} has no prefix cache to reset")


class Tidepool(Engine):
    engine_kwargs: dict = {}

    def __init__(self, args, inputs) -> None:
        super().__init__(args, inputs)
        import torch

        from tidepool import LLM

        kwargs = dict(self.engine_kwargs)
        if args.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
        if args.runner:
            kwargs["runner"] = args.runner
        if args.no_prefix_caching:
            kwargs["enable_prefix_caching"] = False
        self.llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_len, **kwargs)
        self.torch = torch

    def run(self, items):
        if self.args.task == "embed":
            start = time.perf_counter()
            outs = self.llm.embed(items, truncate_prompt_tokens=-1, use_tqdm=False)
            elapsed = time.perf_counter() - start
            data = np.asarray([o.outputs.embedding for o in outs], dtype=np.float32)
        else:
            first = [q for q, _ in items]
            second = [p for _, p in items]
            start = time.perf_counter()
            outs = self.llm.score(first, second, truncate_prompt_tokens=-1, use_tqdm=False)
            elapsed = time.perf_counter() - start
            data = np.asarray([o.outputs.score for o in outs], dtype=np.float32)
        return elapsed, data, sum(len(o.prompt_token_ids) for o in outs)

    def one(self, text):
        self.llm.embed([text], use_tqdm=False)

    def info(self):
        import tidepool

        return {
            "version": getattr(tidepool, "__version__", "?"),
            "torch": self.torch.__version__,
            "threads": self.torch.get_num_threads(),
            **self.engine_kwargs,
        }


class TidepoolInt8(Tidepool):
    """tidepool's int8 mode (issue 17): an installed tidepool without it raises at LLM(), and the
    driver prints that reason and skips the row."""

    engine_kwargs = {"quantization": "int8"}


class SentenceTransformers(Engine):
    def __init__(self, args, inputs) -> None:
        super().__init__(args, inputs)
        import torch

        self.torch = torch
        self.model = self.load()
        self.model.eval()

    def load(self):
        dtype = getattr(self.torch, self.args.dtype)
        if self.args.task == "embed":
            from sentence_transformers import SentenceTransformer

            model = SentenceTransformer(self.args.model, device="cpu")
            model.max_seq_length = self.args.max_len
        else:
            from sentence_transformers import CrossEncoder

            model = CrossEncoder(self.args.model, device="cpu", max_length=self.args.max_len)
        return model.to(dtype)

    def run(self, items):
        bs = self.args.batch_size
        start = time.perf_counter()
        if self.args.task == "embed":
            out = self.model.encode(items, batch_size=bs, convert_to_tensor=True)
        else:
            out = self.model.predict(
                [tuple(p) for p in items], batch_size=bs, convert_to_tensor=True
            )
        elapsed = time.perf_counter() - start
        return elapsed, out.float().cpu().numpy(), None

    def one(self, text):
        self.model.encode([text], convert_to_tensor=True)

    def info(self):
        import sentence_transformers

        return {
            "version": sentence_transformers.__version__,
            "torch": self.torch.__version__,
            "threads": self.torch.get_num_threads(),
            "batch_size": self.args.batch_size,
        }


class SentenceTransformersExport(SentenceTransformers):
    """sentence-transformers on one of its exported backends (OpenVINO / ONNX Runtime, float32 or
    int8), exported on first use into --export-dir and loaded from there afterwards."""

    def load(self):
        from pathlib import Path

        import peer_exports

        if self.args.dtype != "float32":
            raise ValueError(f"{self.args.engine} runs its own export, float32 only")
        calibration = self.inputs.get("calibration") or self.items[:300]
        export_dir = Path(self.args.export_dir)
        peer_exports.prepare(
            self.args.engine,
            self.args.task,
            Path(self.args.model),
            export_dir,
            calibration,
            self.args.max_len,
        )
        return peer_exports.load(
            self.args.engine, self.args.task, export_dir, self.args.max_len, self.args.ov_precision
        )

    def info(self):
        import peer_exports

        info = super().info()
        spec = peer_exports.EXPORTS[self.args.engine]
        info["file"] = spec.file_name
        if spec.backend == "openvino":
            info["ov_precision"] = self.args.ov_precision
        for module in ("openvino", "onnxruntime"):
            try:
                info[module] = __import__(module).__version__
            except ImportError:
                pass
        return info


class VLLM(Engine):
    def __init__(self, args, inputs) -> None:
        super().__init__(args, inputs)
        import torch
        import vllm

        self.torch = torch
        self.vllm = vllm
        kwargs: dict = {"hf_overrides": json.loads(args.hf_overrides)} if args.hf_overrides else {}
        if args.no_prefix_caching or args.prefix_caching:
            kwargs["enable_prefix_caching"] = args.prefix_caching
        self.llm = vllm.LLM(
            model=args.model,
            runner="pooling",
            dtype=args.dtype,
            max_model_len=args.max_len,
            seed=0,
            **kwargs,
        )
        # vLLM 0.32: truncation goes through tokenization_kwargs. Without `truncation_side` the
        # tokenizer truncates (right side, [SEP] kept), exactly as sentence-transformers does.
        self.tok_kwargs = {"truncate_prompt_tokens": args.max_len}

    def run(self, items):
        start = time.perf_counter()
        if self.args.task == "embed":
            outs = self.llm.embed(items, use_tqdm=False, tokenization_kwargs=self.tok_kwargs)
            elapsed = time.perf_counter() - start
            data = np.asarray([o.outputs.embedding for o in outs], dtype=np.float32)
        else:
            outs = self.llm.score(
                [q for q, _ in items],
                [p for _, p in items],
                use_tqdm=False,
                tokenization_kwargs=self.tok_kwargs,
            )
            elapsed = time.perf_counter() - start
            data = np.asarray([o.outputs.score for o in outs], dtype=np.float32)
        return elapsed, data, sum(len(o.prompt_token_ids) for o in outs)

    def one(self, text):
        self.llm.embed([text], use_tqdm=False, tokenization_kwargs=self.tok_kwargs)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def info(self):
        return {
            "version": self.vllm.__version__,
            "torch": self.torch.__version__,
            "threads": self.torch.get_num_threads(),
            "ld_preload": os.environ.get("LD_PRELOAD", ""),
        }


def _cpu_seconds() -> float:
    """CPU time of this process, all threads (to tell a slow engine from a starved one)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


ENGINES = {
    "tidepool": Tidepool,
    "tidepool-int8": TidepoolInt8,
    "st": SentenceTransformers,
    "st-onnx": SentenceTransformersExport,
    "st-onnx-int8": SentenceTransformersExport,
    "st-openvino": SentenceTransformersExport,
    "st-openvino-int8": SentenceTransformersExport,
    "vllm": VLLM,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", required=True, choices=sorted(ENGINES))
    parser.add_argument("--task", default="embed", choices=["embed", "score"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="tidepool")
    parser.add_argument("--runner", default=None, help="tidepool: e.g. pooling for a *ForCausalLM")
    parser.add_argument(
        "--no-prefix-caching", action="store_true", help="tidepool and vLLM: compute every token"
    )
    parser.add_argument(
        "--prefix-caching", action="store_true", help="vLLM: enable it (default: vLLM's choice)"
    )
    parser.add_argument(
        "--hf-overrides", default=None, help="vLLM: hf_overrides as JSON (e.g. a reranker's)"
    )
    parser.add_argument("--export-dir", default=None, help="st-onnx*, st-openvino*: export cache")
    parser.add_argument(
        "--ov-precision", default="f32", help="st-openvino*: INFERENCE_PRECISION_HINT or default"
    )
    parser.add_argument(
        "--warmup", type=int, default=64, help="inputs per warm-up pass (2 passes; 0: none)"
    )
    args = parser.parse_args()

    # The protocol gets a private copy of stdout; fd 1 then points at stderr, so library prints
    # and logs never mix with the replies.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(**kw) -> None:
        proto.write(json.dumps(kw) + "\n")
        proto.flush()

    try:
        with open(args.inputs, encoding="utf-8") as f:
            inputs = json.load(f)
        start = time.perf_counter()
        engine = ENGINES[args.engine](args, inputs)
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        # Warm-up: a slice of the real inputs, longest ones included (shapes, kernel choice,
        # compilation), then single texts.
        items = engine.items
        by_len = sorted(items, key=lambda x: -len(x if isinstance(x, str) else x[0] + x[1]))
        warm = by_len[: args.warmup // 2] + items[: args.warmup - args.warmup // 2]
        if warm:  # --warmup 0: an untimed reference run needs none
            engine.run(warm)
            engine.run(warm)
        if warm and args.task == "embed":
            for _ in range(5):
                engine.one(inputs.get("latency_text") or items[0])
        warm_s = time.perf_counter() - start
        reply(ready=True, load_s=load_s, warmup_s=warm_s, info=engine.info())
    except Exception as e:  # noqa: BLE001 - reported to the driver, which prints it
        import traceback

        traceback.print_exc()
        reply(ready=False, error=f"{type(e).__name__}: {e}")
        return

    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "quit":
                reply(ok=True)
                break
            if cmd["cmd"] == "run":
                if cmd.get("reset_prefix_cache"):  # untimed: the run pays for its prefix once
                    engine.reset_prefix_cache()
                cpu = _cpu_seconds()
                elapsed, data, tokens = engine.run(engine.items)
                cpu = _cpu_seconds() - cpu
                if cmd.get("dump"):
                    np.save(cmd["dump"], data)
                reply(ok=True, seconds=elapsed, cpu_seconds=cpu, tokens=tokens, count=len(data))
            elif cmd["cmd"] == "latency":
                text = inputs["latency_text"]
                times = []
                for _ in range(int(cmd["calls"])):
                    start = time.perf_counter()
                    engine.one(text)
                    times.append(time.perf_counter() - start)
                reply(ok=True, times=times)
            else:
                reply(ok=False, error=f"unknown command {cmd['cmd']!r}")
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            reply(ok=False, error=f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
