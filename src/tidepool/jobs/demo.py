"""`tidepool embed --demo`: a generated sample corpus, embedded offline, with its throughput."""

from __future__ import annotations

import random
import time

from tidepool.ray.pooling import OfflineLLM

_SUBJECTS = [
    "The engine",
    "A small model",
    "Our server",
    "The scheduler",
    "Every request",
    "The cat",
    "A sailor",
    "The market",
    "My neighbour",
    "The river",
    "A student",
    "The old library",
]
_VERBS = [
    "computes",
    "batches",
    "embeds",
    "ranks",
    "reads",
    "watches",
    "crosses",
    "sells",
    "finds",
    "explains",
    "carries",
    "remembers",
]
_OBJECTS = [
    "sentences of every length",
    "the morning tide",
    "thousands of documents",
    "a quiet song",
    "fresh bread and cheese",
    "the shortest path home",
    "vectors on the CPU",
    "stormy weather",
    "a forgotten letter",
    "the latest search results",
    "tokens without padding",
    "stories about the sea",
]
_TAILS = [
    "",
    " before noon",
    " with great care",
    " in one step",
    " every single day",
    " for a friend",
    " under the bright moon",
    " faster than expected",
]


def demo_corpus(num_texts: int = 300, seed: int = 0) -> list[str]:
    """Generated sentences (fixed seed): varied, offline, no data set needed."""
    rng = random.Random(seed)
    return [
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_TAILS)}."
        for _ in range(num_texts)
    ]


def run_demo(llm: OfflineLLM, num_texts: int = 300) -> None:
    texts = demo_corpus(num_texts)
    llm.embed(texts[:8], use_tqdm=False)  # warm-up: first-call allocations are not throughput
    start = time.perf_counter()
    outputs = llm.embed(texts, use_tqdm=True)
    seconds = time.perf_counter() - start
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    print(f"model: {llm.model_config.model}")
    print(
        f"embedded {len(texts)} texts ({num_tokens} tokens) in {seconds:.2f} s: "
        f"{len(texts) / seconds:.1f} texts/s, {num_tokens / seconds:.0f} tokens/s"
    )
    for text, out in list(zip(texts, outputs, strict=True))[:2]:
        values = ", ".join(f"{v:+.4f}" for v in out.outputs.embedding[:6])
        print(f"  {text!r:60} dim={len(out.outputs.embedding)} [{values}, ...]")
