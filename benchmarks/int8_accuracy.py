"""How close `quantization="int8"` stays to float32: cosine per text and top-10 retrieval overlap.

On the fixed corpus (benchmarks/corpus.py, seed 0), each text embedded by tidepool in float32
and in int8 (and bfloat16 for scale): the min / mean cosine of a text's int8 vector to its float32
one, and the top-10 nearest-neighbour overlap: for each text as a query against all the others,
the share of its 10 nearest neighbours (cosine) under int8 that are also its 10 nearest under
float32. Issue 17's targets on all-MiniLM-L6-v2: cos mean >= 0.995, min >= 0.99, overlap >= 0.95.

    python benchmarks/int8_accuracy.py [--model PATH] [--texts 1000] [--bf16]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from corpus import make_corpus  # noqa: E402

from tidepool import LLM  # noqa: E402


@dataclass(frozen=True)
class Agreement:
    """One mode's vectors against float32's."""

    min_cosine: float
    """Lowest cosine of a text's vector to its float32 vector."""
    mean_cosine: float
    """Mean of those cosines."""
    top10_overlap: float
    """Mean share of each text's 10 nearest neighbours that float32 also ranks in its top 10."""


def embed(llm: LLM, texts: list[str]) -> torch.Tensor:
    outputs = llm.embed(
        texts, use_tqdm=False, truncate_prompt_tokens=llm.model_config.max_model_len
    )
    return torch.stack([torch.as_tensor(o.outputs.embedding, dtype=torch.float32) for o in outputs])


def _top_neighbours(vectors: torch.Tensor, k: int) -> torch.Tensor:
    unit = torch.nn.functional.normalize(vectors, dim=1)
    sims = unit @ unit.T
    sims.fill_diagonal_(-2.0)  # a text is not its own neighbour
    return sims.topk(k, dim=1).indices


def agreement(vectors: torch.Tensor, reference: torch.Tensor, k: int = 10) -> Agreement:
    cos = torch.nn.functional.cosine_similarity(vectors, reference)
    ours, theirs = _top_neighbours(vectors, k), _top_neighbours(reference, k)
    shared = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ours, theirs, strict=True))
    return Agreement(float(cos.min()), float(cos.mean()), shared / ours.numel())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--bf16", action="store_true", help="also bfloat16, for scale")
    args = parser.parse_args()
    texts = make_corpus(args.texts)
    reference = embed(LLM(model=args.model), texts)
    modes = {"int8": {"quantization": "int8"}}
    if args.bf16:
        modes["bfloat16"] = {"dtype": "bfloat16"}
    print(f"{args.model}, {len(texts)} corpus texts, against tidepool float32")
    print(f"{'mode':10} {'cos min':>9} {'cos mean':>9} {'top-10 overlap':>15}")
    for name, kwargs in modes.items():
        result = agreement(embed(LLM(model=args.model, **kwargs), texts), reference)
        print(
            f"{name:10} {result.min_cosine:9.5f} {result.mean_cosine:9.5f} "
            f"{result.top10_overlap:15.4f}"
        )


if __name__ == "__main__":
    main()
