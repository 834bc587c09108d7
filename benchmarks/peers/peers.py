"""tidepool vs its peers (sentence-transformers on torch and on its exported OpenVINO / ONNX Runtime
backends, float32 and int8, and vLLM's CPU build), each engine in its own process, on the same
fixed-seed corpus, rounds alternating between engines.

Sections (--sections, all by default):
  embed    all-MiniLM-L6-v2 over the corpus (default 4,000 texts of corpus.py): tokens/s, texts/s,
           ratios tidepool / peer (median of per-round ratios), share of the GEMM roofline
           (roofline.py; int8 engines also against torch._int_mm's int8 roofline) at the corpus'
           mean length, and agreement with sentence-transformers float32 (min / mean cosine over
           the first --cos-texts texts; >= 0.99999 in float32, >= 0.999 in bfloat16; int8 held to
           issue 17's bar, min >= 0.99 and mean >= 0.995). Prints issue 17's table.
  latency  one 32-token text through `embed`, warm, p50 / p99 over --latency-calls calls.
  cross    a MiniLM-L6-shaped BertForSequenceClassification (random weights, fixed seed,
           num_labels=1, MiniLM tokenizer): tidepool `LLM.score` vs sentence-transformers
           `CrossEncoder.predict` over (query, passage) pairs.
  base     a BERT-base-shaped embedder (768 hidden, 12 layers, random weights, MiniLM tokenizer,
           mean pooling + normalize) vs sentence-transformers on fewer texts.
  decoder  a Qwen3-Embedding-0.6B-shaped decoder embedder (hidden 1024, 16 / 8 heads of 128, MLP
           3072, 8 layers, random weights, LAST pooling) over --decoder-texts texts, prefix caching
           off on both sides so compute is compared: tidepool vs vLLM (issue 17 item 6); the
           roofline is the decoder's GEMMs (~252 MFLOP / token).

Peers (--peers, float32 only; in embed / cross / base, and tidepool-int8 in decoder too):
  st-openvino, st-onnx            sentence-transformers' OpenVINO / ONNX Runtime float32 exports
  st-onnx-int8                    ONNX Runtime dynamic int8 (`export_dynamic_quantized_onnx_model`,
                                  avx512_vnni config)
  st-openvino-int8                OpenVINO static int8 (`export_static_quantized_openvino_model`'s
                                  recipe, calibrated on --calibration-texts local texts, corpus seed 4)
  tidepool-int8                   `LLM(..., quantization="int8")`; skipped, with the reason printed,
                                  when the installed tidepool rejects it
Exports are made offline on first use and cached under --model-dir/exports (peer_exports.py).

Every engine runs in a worker process (peer_worker.py) under its own venv's python: tidepool and
sentence-transformers under this python (or --python), the exported backends under --ov-python
(/work/venv-ov), vLLM under --vllm-python (/work/venv-vllm) with its CPU environment; both venvs
come from benchmarks/peers/peer_venvs.sh. Each worker loads and warms up once, then the driver asks each
in turn (A B C, B C A, ...) to time one pass over all inputs; figures are medians over rounds.

    python benchmarks/peers/peers.py [--texts 4000] [--rounds 3] [--dtypes float32,bfloat16]
        [--sections embed,latency,cross,base,decoder] [--peers st-openvino,st-openvino-int8,...]
        [--vllm-python /work/venv-vllm/bin/python] [--ov-python /work/venv-ov/bin/python]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # the single-purpose scripts' corpus.py and roofline.py

from corpus import make_corpus  # noqa: E402
from peer_models import (  # noqa: E402
    make_bert_base,
    make_cross_encoder,
    make_decoder_embedder,
    minilm_path,
)
from peer_report import (  # noqa: E402
    ENGINE_NAMES,
    agreement,
    print_issue_table,
    print_section,
    print_summary,
)
from roofline import DecoderShape, EncoderShape, gemm_gflops, int8_gemm_gops  # noqa: E402

WORKER = HERE / "peer_worker.py"
EXPORT_ENGINES = ("st-openvino", "st-onnx", "st-onnx-int8", "st-openvino-int8")
INT8_ENGINES = ("tidepool-int8", "st-onnx-int8", "st-openvino-int8")
REQUIRED_ENGINES = ("tidepool", "st")  # the others are skipped, with the reason, if they fail
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
DEFAULT_OV_PYTHON = "/work/venv-ov/bin/python"
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}


def vllm_preload(vllm_python: str) -> str:
    """What vLLM itself puts in LD_PRELOAD for its engine process (its own multiprocessing
    does it; with VLLM_ENABLE_V1_MULTIPROCESSING=0 nobody would): tcmalloc, and torch's
    libgomp (without it, thread binding leaves one core idle — vLLM issue 27369)."""
    out = subprocess.run(
        [
            vllm_python,
            "-c",
            "import glob, os, torch; d = os.path.dirname(torch.__file__); "
            "print((glob.glob(d + '/lib/libgomp*.so*') + "
            "glob.glob(os.path.dirname(d) + '/torch.libs/libgomp*.so*') + [''])[0])",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    libs = []
    for cand in (
        "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
        "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    ):
        if os.path.exists(cand):
            libs.append(cand)
            break
    gomp = out.stdout.strip()
    if gomp:
        libs.append(gomp)
    return ":".join(libs)


def cpu_flags() -> str:
    """The CPU's model and the instruction sets that decide the kernel and GEMM paths
    (tidepool's kernels/cpu_features.py: AVX2 / AVX-512 builds; VNNI: int8; AVX512-BF16 /
    AMX: bf16), with TIDEPOOL_CPU_ISA's cap when set."""
    try:
        from tidepool.kernels import cpu_features
    except ImportError:  # a tidepool without the module: the flags alone
        flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
        have = " ".join(f for f in CPU_FLAGS if f in flags) or "none of " + " ".join(CPU_FLAGS)
        return f"{os.cpu_count()} cores; {have}"
    return f"{cpu_features.describe()}; {os.cpu_count()} cores"


def kernel_paths() -> str:
    """Which of tidepool's CPU kernels its workers take on this machine (the same environment:
    the choice is the CPU's and TIDEPOOL_CPU_ISA's / TIDEPOOL_CPU_ATTENTION's / TIDEPOOL_INT8_GEMM's,
    made the same way in every process): the encoders' attention, the decoders' element-wise
    kernels, and the int8 linears' GEMM and epilogues. Nothing is built here."""
    try:
        from tidepool import envs
        from tidepool.attention import cpu_kernels
        from tidepool.kernels import cpu_features
        from tidepool.quantization import int8_ops
    except ImportError as e:
        return f"unknown ({e})"
    if envs.cpu_attention() == "sdpa":
        return "TIDEPOOL_CPU_ATTENTION=sdpa: attention PyTorch SDPA, no tidepool kernels"
    isa = cpu_kernels.chosen_isa()
    attention = f"tidepool kernel, {isa} build" if isa else "PyTorch SDPA"
    if isa and cpu_features.usable("amx"):
        attention += " (+ AMX-bf16 products for bfloat16 / int8)"
    elif isa == "avx512" and cpu_features.usable("avx512_bf16"):
        attention += " (+ bf16 products on avx512_bf16 vdpbf16ps for bfloat16 / int8)"
    # oneDNN's bfloat16 GEMM (its own ISA ladder; ONEDNN_MAX_CPU_ISA caps it, not ours).
    flags = cpu_features.cpu_flags()
    bf16_gemm = (
        "AMX-bf16" if "amx_bf16" in flags
        else "avx512_bf16" if "avx512_bf16" in flags
        else "no bf16 instructions: converted to float32"
    )  # fmt: skip
    from tidepool.quantization.int8_linear import int8_gemm_available, onednn_int8_saturates

    int8_isa = int8_ops.chosen_isa()
    amx = cpu_features.usable("amx") and envs.int8_gemm() == "auto"
    vnni = getattr(int8_ops, "vnni_isa", lambda: None)() if envs.int8_gemm() == "auto" else None
    gemm = "tidepool AMX GEMM (K % 64, N % 32; else oneDNN)" if amx else "oneDNN int8 GEMM"
    if not amx and vnni and int8_isa:
        gemm = f"tidepool VNNI GEMM, {vnni} build (K % 4, N % 16; else oneDNN)"
    epilogues = f"tidepool epilogues, {int8_isa} build" if int8_isa else "torch-op epilogues"
    if not amx and not vnni and int8_gemm_available() and onednn_int8_saturates():
        gemm, epilogues = "oneDNN int8 GEMM as two 7-bit GEMMs (no VNNI)", "torch-op epilogues"
    return (
        f"encoder attention: {attention}; bfloat16 linears: oneDNN, {bf16_gemm}; "
        f"decoder ops: {isa or 'torch ops'}; "
        f"int8 linears: {gemm} + {epilogues}"
    )


# ---------------------------------------------------------------------------------------- inputs


def count_tokens(tokenizer, texts, max_len: int, pairs=None) -> list[int]:
    if pairs is not None:
        enc = tokenizer(
            [q for q, _ in pairs], [p for _, p in pairs], truncation=True, max_length=max_len
        )
    else:
        enc = tokenizer(texts, truncation=True, max_length=max_len)
    return [len(ids) for ids in enc["input_ids"]]


def latency_text(tokenizer, words: list[str], num_tokens: int) -> str:
    """A text that tokenizes to exactly num_tokens tokens ([CLS] and [SEP] included)."""
    for n in range(1, len(words) + 1):
        text = " ".join(words[:n])
        got = len(tokenizer(text)["input_ids"])
        if got == num_tokens:
            return text
        if got > num_tokens:
            break
    raise ValueError(f"no prefix of the words tokenizes to {num_tokens} tokens")


def make_pairs(num_pairs: int, seed: int = 1) -> list[tuple[str, str]]:
    """(query, passage): queries are 3-12 word heads of one corpus (seed + 1), passages another
    (seed)."""
    passages = make_corpus(num_pairs, seed=seed)
    heads = make_corpus(num_pairs, seed=seed + 1)
    queries = []
    for i, text in enumerate(heads):
        words = text.rstrip(".").split()
        queries.append(" ".join(words[: 3 + i % 10]).rstrip(",.;?!:") + "?")
    return list(zip(queries, passages, strict=True))


# ---------------------------------------------------------------------------------------- workers


class Worker:
    """One engine in its own process; see peer_worker.py for the protocol."""

    def __init__(self, engine: str, python: str, env: dict, argv: list[str], log: Path) -> None:
        self.engine = engine
        self.log_path = log
        self.log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [python, str(WORKER), "--engine", engine, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            cwd=str(HERE),
        )
        self.ready: dict | None = None

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(
                f"{self.engine} worker exited (rc={self.proc.returncode}); log {self.log_path}:\n"
                + self.tail()
            )
        return json.loads(line)

    def tail(self, lines: int = 25) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self) -> dict:
        if self.ready is None:
            self.ready = self._read()
            if not self.ready.get("ready"):
                raise RuntimeError(
                    f"{self.engine} worker failed: {self.ready.get('error')}\n{self.tail()}"
                )
        return self.ready

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        if not out.get("ok"):
            raise RuntimeError(f"{self.engine}: {out.get('error')}\n{self.tail()}")
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask(cmd="quit")
            except (RuntimeError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@dataclass(frozen=True)
class Section:
    """One comparison: its model, its inputs, and how the workers run it."""

    name: str
    """embed, cross, base, decoder."""
    task: str
    """The worker's task: embed or score."""
    model: Path
    """The model folder every engine loads."""
    shape: EncoderShape | DecoderShape
    """The model's GEMM shapes, for the roofline."""
    items: list
    """Texts (embed) or (query, passage) pairs (score)."""
    num_tokens: int
    """Tokens over all items after truncation to max_len (what every engine should see)."""
    max_len: int
    """Truncation length and max_model_len."""
    extra_inputs: dict = field(default_factory=dict)
    """More of the workers' inputs.json: latency_text, calibration."""
    worker_flags: tuple[str, ...] = ()
    """More worker arguments, e.g. --runner pooling --no-prefix-caching."""


class Driver:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.results: dict = {"sections": {}, "skipped": []}
        self.references: dict[str, np.ndarray] = {}  # section → sentence-transformers float32
        self.gflops: dict[tuple, list[float]] = {}  # (shape, float32 | bfloat16 | int8) → samples

    def python_for(self, engine: str) -> str | None:
        if engine == "vllm":
            return self.args.vllm_python
        if engine in EXPORT_ENGINES:
            return self.args.ov_python
        return self.args.python

    def env_for(self, engine: str) -> dict:
        env = dict(os.environ)
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
        if engine == "vllm":
            env.update(VLLM_ENV)
            preload = self.vllm_preload()
            if preload:
                env["LD_PRELOAD"] = preload
        return env

    def vllm_preload(self) -> str:
        if self.args.vllm_preload != "auto":
            return "" if self.args.vllm_preload == "none" else self.args.vllm_preload
        return vllm_preload(self.args.vllm_python)

    def skip(self, engine: str, section: str, reason: str) -> None:
        first = reason.strip().splitlines()[0] if reason.strip() else "?"
        print(f"  {ENGINE_NAMES[engine]:22s} skipped: {first}", flush=True)
        self.results["skipped"].append(f"{section}: {ENGINE_NAMES[engine]}: {first}")

    def worker_argv(
        self, engine: str, section: Section, dtype: str, inputs: Path, warmup: int
    ) -> list[str]:
        args = self.args
        argv = [
            "--task", section.task, "--model", str(section.model), "--dtype", dtype,
            "--inputs", str(inputs), "--max-len", str(section.max_len),
            "--batch-size", str(args.st_batch_size), "--warmup", str(warmup),
            *section.worker_flags,
        ]  # fmt: skip
        if engine.startswith("tidepool") and args.max_num_batched_tokens:
            argv += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        if engine in EXPORT_ENGINES:
            # One export folder per model and calibration size: the static int8 depends on both.
            num_cal = len(section.extra_inputs.get("calibration", ()))
            folder = f"{section.name}-{section.model.name}-cal{num_cal}"
            argv += ["--export-dir", str(Path(args.model_dir) / "exports" / folder)]
            argv += ["--ov-precision", args.ov_precision]
        return argv

    def start(self, engines, section: Section, dtype: str, inputs: dict, tag: str, warmup=None):
        path = self.workdir / f"inputs-{tag}.json"
        path.write_text(json.dumps(inputs))
        workers: dict[str, Worker] = {}
        for engine in engines:
            python = self.python_for(engine)
            if not python or not Path(python).exists():
                self.skip(engine, section.name, f"no python for it ({python!r})")
                continue
            warmup = self.args.warmup if warmup is None else warmup
            argv = self.worker_argv(engine, section, dtype, path, warmup)
            log = self.workdir / f"{tag}-{engine}.log"
            # One at a time: loads, exports and warm-ups do not fight over the cores.
            w = Worker(engine, python, self.env_for(engine), argv, log)
            try:
                ready = w.wait_ready()
            except RuntimeError as e:
                w.close()
                if engine in REQUIRED_ENGINES:
                    raise
                self.skip(engine, section.name, str(e))
                continue
            print(
                f"  {ENGINE_NAMES[engine]:22s} loaded in {ready['load_s']:.1f}s, warm-up "
                f"{ready['warmup_s']:.1f}s  {ready['info']}",
                flush=True,
            )
            workers[engine] = w
        return workers

    def measure_gemm(self, shape, kinds: list[str]) -> None:
        """One more sample of each roofline (taken between rounds: the load changes)."""
        import torch

        for kind in kinds:
            if kind == "int8":
                gops = int8_gemm_gops(shape)
            else:
                gops = gemm_gflops(shape, getattr(torch, kind))
            self.gflops.setdefault((shape, kind), []).append(gops)

    def roofline_tokens_s(self, shape, kind: str, mean_len: float) -> float:
        if (shape, kind) not in self.gflops:
            self.measure_gemm(shape, [kind])
        return statistics.median(self.gflops[(shape, kind)]) * 1e9 / shape.flops_per_token(mean_len)

    def rounds(self, workers: dict[str, Worker], tag: str, num_rounds: int, between) -> dict:
        """Each round times every engine once, the order rotating (A B C, B C A, ...), then calls
        between() (a roofline sample); the last round also dumps the outputs."""
        names = list(workers)
        times: dict[str, list] = {n: [] for n in names}
        cpu: dict[str, list] = {n: [] for n in names}
        tokens: dict[str, int | None] = {}
        for r in range(num_rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            parts = []
            for name in order:
                dump = self.workdir / f"{tag}-{name}.npy" if r == num_rounds - 1 else None
                time.sleep(0.5)  # idle OpenMP threads of the previous engine go to sleep
                out = workers[name].ask(cmd="run", dump=str(dump) if dump else None)
                times[name].append(out["seconds"])
                cpu[name].append(out["cpu_seconds"])
                tokens[name] = out["tokens"]
                parts.append(
                    f"{ENGINE_NAMES[name]} {out['seconds']:.2f}s (cpu {out['cpu_seconds']:.1f}s)"
                )
            print(f"  round {r}: " + " | ".join(parts), flush=True)
            between()
        return {"times": times, "cpu": cpu, "tokens": tokens}

    def reference(self, section: Section, inputs: dict) -> np.ndarray:
        """sentence-transformers float32 outputs for the section (untimed)."""
        if section.name not in self.references:
            print("  (sentence-transformers float32 reference)", flush=True)
            tag = f"{section.name}-ref"
            w = self.start(["st"], section, "float32", inputs, tag, warmup=0)["st"]
            try:
                dump = self.workdir / f"{tag}.npy"
                w.ask(cmd="run", dump=str(dump))
                self.references[section.name] = np.load(dump)
            finally:
                w.close()
        return self.references[section.name]

    # ------------------------------------------------------------------------------ sections

    def throughput_section(self, section: Section, engines: list[str], dtype: str) -> dict | None:
        args = self.args
        key = "texts" if section.task == "embed" else "pairs"
        inputs = {key: section.items, **section.extra_inputs}
        tag = f"{section.name}-{dtype}"
        print(
            f"\n[{section.name} {dtype}] {len(section.items)} inputs, {section.num_tokens} tokens",
            flush=True,
        )
        workers = self.start(engines, section, dtype, inputs, tag)
        if not workers:
            return None
        kinds = [dtype] + (["int8"] if any(n in INT8_ENGINES for n in workers) else [])
        try:
            run = self.rounds(
                workers, tag, args.rounds, lambda: self.measure_gemm(section.shape, kinds)
            )
            latency = None
            if section.name == "embed" and "latency" in args.sections:
                latency = self.latency(workers)
        finally:
            for w in workers.values():
                w.close()
        res = self.tabulate(section, dtype, kinds, run, inputs)
        if latency is not None:
            res["latency"] = latency
        print_section(section.name, dtype, res)
        print_issue_table(section.name, dtype, res)
        self.results["sections"].setdefault(section.name, {})[dtype] = res
        return res

    def tabulate(self, section: Section, dtype: str, kinds: list[str], run: dict, inputs) -> dict:
        """Medians, ratios to tidepool, roofline shares and agreement, per engine."""
        times, tag = run["times"], f"{section.name}-{dtype}"
        num_items, num_tokens = len(section.items), section.num_tokens
        for name, seen in run["tokens"].items():
            if seen is not None and seen != num_tokens:
                print(f"  WARNING: {ENGINE_NAMES[name]} saw {seen} tokens, expected {num_tokens}")
        mean_len = num_tokens / num_items
        roof = {k: self.roofline_tokens_s(section.shape, k, mean_len) for k in kinds}
        outputs = {n: np.load(self.workdir / f"{tag}-{n}.npy") for n in times}
        if dtype == "float32" and "st" in outputs:
            self.references.setdefault(section.name, outputs["st"])
        ref = self.reference(section, inputs)
        res: dict = {"task": section.task, "num_inputs": num_items, "num_tokens": num_tokens}
        res["mean_len"] = mean_len
        res["roofline_tokens_s"] = roof[dtype]
        res["int8_roofline_tokens_s"] = roof.get("int8")
        res["gemm_samples"] = {k: self.gflops[(section.shape, k)] for k in kinds}
        res["engines"] = {}
        for name, ts in times.items():
            t = statistics.median(ts)
            e = {
                "seconds": ts,
                "tokens_s": num_tokens / t,
                "items_s": num_items / t,
                "roofline_share": num_tokens / t / roof[dtype],
                "cpu_seconds": run["cpu"][name],
                # Throughput per CPU-second of the engine's process: what a loaded machine
                # blurs least (an engine that spins idle threads pays for them here).
                "tokens_per_cpu_s": num_tokens / statistics.median(run["cpu"][name]),
            }
            if name in INT8_ENGINES and "int8" in roof:
                e["int8_roofline_share"] = num_tokens / t / roof["int8"]
            if name != "tidepool" and "tidepool" in times:
                pairs = list(zip(ts, times["tidepool"], strict=True))
                e["tidepool_ratio"] = statistics.median(a / b for a, b in pairs)
                e["vs_tidepool"] = statistics.median(b / a for a, b in pairs)
            kind = "int8" if name in INT8_ENGINES else dtype
            e.update(agreement(outputs[name], ref, section.task, kind, self.args.cos_texts))
            res["engines"][name] = e
        return res

    def latency(self, workers: dict[str, Worker]) -> dict:
        calls = self.args.latency_calls
        per_round = math.ceil(calls / self.args.rounds)
        times: dict[str, list] = {n: [] for n in workers}
        names = list(workers)
        for r in range(self.args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                time.sleep(0.5)
                n = min(per_round, calls - len(times[name]))
                if n > 0:
                    times[name] += workers[name].ask(cmd="latency", calls=n)["times"]
        out = {}
        for name, ts in times.items():
            arr = np.asarray(ts) * 1e3
            out[name] = {
                "p50_ms": float(np.percentile(arr, 50)),
                "p99_ms": float(np.percentile(arr, 99)),
                "calls": len(ts),
            }
        return out


# ------------------------------------------------------------------------------------------ main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--texts", type=int, default=4000, help="embed corpus size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--sections", default="embed,latency,cross,base,decoder")
    parser.add_argument(
        "--peers",
        default=",".join(("tidepool-int8", *EXPORT_ENGINES)),
        help="float32-only engines besides tidepool and sentence-transformers (empty: none)",
    )
    parser.add_argument("--peer-sections", default="embed,cross,base,decoder")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    parser.add_argument(
        "--vllm-sections",
        default="embed,latency,decoder",
        help="sections vLLM joins when --vllm-python is given (embed,latency,cross,base,decoder)",
    )
    parser.add_argument(
        "--vllm-preload",
        default="auto",
        help="LD_PRELOAD for the vLLM worker: auto (what vLLM sets for its own engine process: "
        "tcmalloc if installed + torch's libgomp), none, or a value",
    )
    parser.add_argument("--python", default=sys.executable, help="python for tidepool and ST")
    parser.add_argument(
        "--ov-python",
        default=DEFAULT_OV_PYTHON if Path(DEFAULT_OV_PYTHON).exists() else None,
        help="python of the venv with sentence-transformers' OpenVINO / ONNX backends",
    )
    parser.add_argument(
        "--ov-precision",
        default="f32",
        help="OpenVINO's INFERENCE_PRECISION_HINT for its timed models: f32 (float32 rows stay "
        "float32), bf16, or default (OpenVINO's choice: bf16 where the CPU has it)",
    )
    parser.add_argument("--calibration-texts", type=int, default=300, help="static int8 export")
    parser.add_argument("--cos-texts", type=int, default=200, help="rows for cosine (0: all)")
    parser.add_argument("--cross-pairs", type=int, default=2000)
    parser.add_argument("--base-texts", type=int, default=500)
    parser.add_argument("--decoder-texts", type=int, default=300)
    parser.add_argument("--decoder-layers", type=int, default=8)
    parser.add_argument("--decoder-max-len", type=int, default=512)
    parser.add_argument("--latency-calls", type=int, default=200)
    parser.add_argument("--latency-tokens", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--st-batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=64, help="inputs per warm-up pass")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="tidepool")
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "peers-models"))
    parser.add_argument("--json", default=None, help="write all results here")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, dumps)")
    args = parser.parse_args()
    for name in ("sections", "vllm_sections", "peers", "peer_sections"):
        setattr(args, name, [s for s in getattr(args, name).split(",") if s])
    return args


def make_sections(args: argparse.Namespace, tokenizer) -> list[Section]:
    """The sections asked for, models built (cached) and inputs counted."""
    from transformers import AutoConfig

    def encoder(path: Path) -> EncoderShape:
        return EncoderShape.from_hf_config(AutoConfig.from_pretrained(path))

    def calibration(pairs: bool) -> dict:
        num = args.calibration_texts
        return {"calibration": make_pairs(num, seed=5) if pairs else make_corpus(num, seed=4)}

    sections = []
    if "embed" in args.sections:
        texts = make_corpus(args.texts)
        words = " ".join(make_corpus(5, seed=3)).split()
        extra = {"latency_text": latency_text(tokenizer, words, args.latency_tokens)}
        mini = minilm_path()
        sections.append(
            Section(
                "embed", "embed", mini, encoder(mini), texts,
                sum(count_tokens(tokenizer, texts, args.max_len)), args.max_len,
                {**extra, **calibration(False)},
            )
        )  # fmt: skip
    if "cross" in args.sections:
        model = make_cross_encoder(Path(args.model_dir) / "minilm-l6-cross-encoder")
        pairs = make_pairs(args.cross_pairs)
        sections.append(
            Section(
                "cross", "score", model, encoder(model), pairs,
                sum(count_tokens(tokenizer, None, args.max_len, pairs=pairs)), args.max_len,
                calibration(True),
            )
        )  # fmt: skip
    if "base" in args.sections:
        model = make_bert_base(Path(args.model_dir) / "bert-base-random")
        texts = make_corpus(args.base_texts)
        sections.append(
            Section(
                "base", "embed", model, encoder(model), texts,
                sum(count_tokens(tokenizer, texts, args.max_len)), args.max_len,
                calibration(False),
            )
        )  # fmt: skip
    if "decoder" in args.sections:
        folder = f"qwen3-embedding-shaped-l{args.decoder_layers}"
        model = make_decoder_embedder(Path(args.model_dir) / folder, args.decoder_layers)
        texts = make_corpus(args.decoder_texts)
        shape = DecoderShape.from_hf_config(AutoConfig.from_pretrained(model))
        sections.append(
            Section(
                "decoder", "embed", model, shape, texts,
                sum(count_tokens(tokenizer, texts, args.decoder_max_len)), args.decoder_max_len,
                worker_flags=("--runner", "pooling", "--no-prefix-caching"),
            )
        )  # fmt: skip
    return sections


def engines_for(args: argparse.Namespace, section: str, dtype: str) -> list[str]:
    """tidepool first (the ratios' base); sentence-transformers on torch in the encoder sections
    (the decoder's reference runs once, untimed); the float32-only peers; vLLM when given."""
    out = ["tidepool"] if section == "decoder" else ["tidepool", "st"]
    if dtype == "float32" and section in args.peer_sections:
        peers = [p for p in args.peers if section != "decoder" or p == "tidepool-int8"]
        out += peers
    if args.vllm_python and section in args.vllm_sections:
        out.append("vllm")
    return out


def main() -> None:
    args = parse_args()
    dtypes = sorted((d for d in args.dtypes.split(",") if d), key=lambda d: d != "float32")
    if "latency" in args.vllm_sections and "embed" not in args.vllm_sections:
        args.vllm_sections.append("embed")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    workdir = Path(tempfile.mkdtemp(prefix="peers-"))
    driver = Driver(args, workdir)
    driver.results["latency_tokens"] = args.latency_tokens
    driver.results["cpu"] = cpu_flags()
    driver.results["load"] = f"{os.getloadavg()[0]:.1f}"
    print(f"work dir {workdir}; python {args.python}; OpenVINO / ONNX python {args.ov_python}")
    driver.results["kernels"] = kernel_paths()
    print(f"vLLM python {args.vllm_python}; CPU: {driver.results['cpu']}")
    print(f"tidepool's kernels here: {driver.results['kernels']}")
    if args.vllm_python:
        print(f"vLLM env {VLLM_ENV} LD_PRELOAD={driver.vllm_preload()!r}")
    import torch

    print(
        f"driver torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"{driver.results['load']}",
        flush=True,
    )
    try:
        for section in make_sections(args, tokenizer):
            for dtype in dtypes:
                driver.throughput_section(section, engines_for(args, section.name, dtype), dtype)
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(driver.results, indent=2, default=str))
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print_summary(driver.results)


if __name__ == "__main__":
    main()
