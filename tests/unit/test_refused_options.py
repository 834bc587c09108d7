"""Config options and sentence-transformers modules a native model does not implement are refused
at load, naming them, instead of running with wrong numbers (found by the sweep, tests/sweep/;
the sweep's "refuse" cases check the same through LLM(...) end to end)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from tidepool.checkpoint.loader import load_sentence_transformers_meta
from tidepool.models.bert import BertModel, RobertaModel
from tidepool.models.llama import LlamaModel, Qwen3Model

TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)


@pytest.mark.parametrize(
    "config_cls,model_cls",
    [(transformers.BertConfig, BertModel), (transformers.RobertaConfig, RobertaModel)],
)
def test_encoder_with_is_decoder_is_refused(config_cls, model_cls):
    # transformers runs a BertModel / RobertaModel with is_decoder=True causally.
    with torch.device("meta"):
        model_cls(config_cls(vocab_size=100, **TINY))  # the plain encoder builds
        with pytest.raises(ValueError, match="is_decoder=True"):
            model_cls(config_cls(vocab_size=100, is_decoder=True, **TINY))


@pytest.mark.parametrize(
    "config_cls,model_cls",
    [(transformers.LlamaConfig, LlamaModel), (transformers.Qwen3Config, Qwen3Model)],
)
def test_partial_rotary_factor_is_refused(config_cls, model_cls):
    # transformers' default RoPE for these rotates the whole head; vLLM rotates the fraction.
    sizes = dict(TINY, num_key_value_heads=2, head_dim=16)
    with torch.device("meta"):
        model_cls(config_cls(vocab_size=100, **sizes))
        with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
            model_cls(config_cls(vocab_size=100, partial_rotary_factor=0.5, **sizes))


def _pipeline(folder: Path, *types: str) -> Path:
    modules = [{"idx": i, "name": str(i), "path": "", "type": t} for i, t in enumerate(types)]
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


def test_sentence_transformers_modules_tidepool_does_not_run_are_refused(tmp_path):
    ok = _pipeline(
        tmp_path,
        "sentence_transformers.models.Transformer",
        "sentence_transformers.base.modules.dropout.Dropout",
        "sentence_transformers.models.Normalize",
    )
    assert load_sentence_transformers_meta(ok).normalize
    for module in (
        "sentence_transformers.models.LayerNorm",
        "sentence_transformers.models.WeightedLayerPooling",
        "sentence_transformers.base.modules.router.Router",
    ):
        folder = tmp_path / module.rsplit(".", 1)[-1]
        folder.mkdir()
        _pipeline(folder, "sentence_transformers.models.Transformer", module)
        with pytest.raises(ValueError, match=module.replace(".", r"\.")):
            load_sentence_transformers_meta(folder)
