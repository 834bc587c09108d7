"""trust_remote_code: a model whose code ships with its snapshot (config.json auto_map →
configuration_*.py / modeling_*.py), served by the test Hub (tests/hub_server.py). Refused
without the flag (naming it and the files; its *.py not even fetched); with it, the snapshot's
own code runs, on the transformers backend or the fallback, and matches transformers running the
same code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_SIZES, TINY_TEXTS, copy_bert_tokenizer, write_st_pooling
from hub_server import folder_files

from tidepool import LLM

# A BERT with one more layer after the encoder: transformers' attention interface, so the
# transformers backend runs it with tidepool's attention.
_BERT_CONFIG = """
from transformers import BertConfig


class TinyXConfig(BertConfig):
    model_type = "tiny-x"
"""
_BERT_MODELING = """
import torch
from transformers import BertModel
from transformers.modeling_outputs import BaseModelOutput

from .configuration_tiny_x import TinyXConfig


class TinyXModel(BertModel):
    config_class = TinyXConfig

    def __init__(self, config, add_pooling_layer=True):
        super().__init__(config, add_pooling_layer=add_pooling_layer)
        self.post = torch.nn.Linear(config.hidden_size, config.hidden_size)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None,
                position_ids=None, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids, position_ids=position_ids, **kwargs)
        return BaseModelOutput(last_hidden_state=torch.tanh(self.post(out.last_hidden_state)))
"""
# Its own token mixing (no attention layers at all): only the fallback can run it.
_MIX_CONFIG = """
from transformers import PretrainedConfig


class TinyMixConfig(PretrainedConfig):
    model_type = "tiny-mix"

    def __init__(self, vocab_size=30522, hidden_size=32, max_position_embeddings=128,
                 num_attention_heads=4, pad_token_id=0, initializer_range=0.2, **kwargs):
        super().__init__(pad_token_id=pad_token_id, **kwargs)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.max_position_embeddings = max_position_embeddings
        self.num_attention_heads = num_attention_heads
        self.initializer_range = initializer_range
"""
_MIX_MODELING = """
import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

from .configuration_tiny_mix import TinyMixConfig


class TinyMixModel(PreTrainedModel):
    config_class = TinyMixConfig
    base_model_prefix = "tinymix"

    def __init__(self, config):
        super().__init__(config)
        self.tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.mix = nn.Linear(config.hidden_size, config.hidden_size)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        length = input_ids.shape[1]
        hidden = self.tokens(input_ids) + self.positions(torch.arange(length))[None]
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        mask = mask[..., None].to(hidden.dtype)
        context = (hidden * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True)
        return BaseModelOutput(last_hidden_state=torch.tanh(self.mix(hidden + context)))
"""

MODELS = {
    # repo id: (module suffix, configuration code, modeling code, config keys, the impl it runs on)
    "org/remote-bert": (
        "tiny_x",
        _BERT_CONFIG,
        _BERT_MODELING,
        {
            "model_type": "tiny-x",
            "architectures": ["TinyXModel"],
            "vocab_size": 30522,
            **TINY_SIZES,
        },
        "transformers",
    ),
    "org/remote-mix": (
        "tiny_mix",
        _MIX_CONFIG,
        _MIX_MODELING,
        {"model_type": "tiny-mix", "architectures": ["TinyMixModel"], "hidden_size": 32},
        "fallback",
    ),
}


def _class_name(config_keys: dict) -> str:
    return config_keys["architectures"][0]


def _build(folder: Path, minilm_path: Path, repo_id: str) -> Path:
    from transformers import AutoConfig, AutoModel

    suffix, config_code, modeling_code, keys, _ = MODELS[repo_id]
    folder.mkdir(parents=True)
    (folder / f"configuration_{suffix}.py").write_text(config_code)
    (folder / f"modeling_{suffix}.py").write_text(modeling_code)
    name = _class_name(keys)
    auto_map = {
        "AutoConfig": f"configuration_{suffix}.{name.replace('Model', 'Config')}",
        "AutoModel": f"modeling_{suffix}.{name}",
    }
    (folder / "config.json").write_text(json.dumps({**keys, "auto_map": auto_map}))
    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=True)
    torch.manual_seed(7)
    AutoModel.from_config(config, trust_remote_code=True).save_pretrained(str(folder))
    copy_bert_tokenizer(minilm_path, folder)
    write_st_pooling(folder, "mean")
    return folder


@pytest.fixture(scope="session")
def remote_folders(tmp_path_factory, minilm_path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("remote_code")
    return {repo: _build(root / repo.split("/")[1], minilm_path, repo) for repo in MODELS}


def _reference(folder: Path, texts: list[str]) -> torch.Tensor:
    """transformers running the folder's own code: mean pooling over the mask, normalized."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(folder), trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    batch = tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.inference_mode():
        states = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    return F.normalize((states * mask).sum(1) / mask.sum(1), dim=-1)


@pytest.mark.parametrize("repo_id", list(MODELS))
def test_remote_code_from_the_hub(fake_hub, remote_folders, repo_id):
    folder = remote_folders[repo_id]
    suffix, _, _, keys, impl = MODELS[repo_id]
    fake_hub.hub.add(repo_id, folder_files(folder))
    code = [f"configuration_{suffix}.py", f"modeling_{suffix}.py"]

    # Without the flag: refused, naming the flag, the auto_map entry and the files; the code was
    # not even downloaded.
    with pytest.raises(ValueError) as info:
        LLM(repo_id, device="cpu")
    message = str(info.value)
    assert "trust_remote_code=True" in message and "--trust-remote-code" in message
    assert "auto_map" in message and all(name in message for name in code)
    assert not set(fake_hub.hub.touched(repo_id)) & set(code)

    llm = LLM(repo_id, device="cpu", dtype="float32", trust_remote_code=True)
    assert set(code) <= set(fake_hub.hub.fetched(repo_id))
    assert llm.model_config.model_impl == impl
    texts = list(TINY_TEXTS)
    got = F.normalize(torch.tensor([o.outputs.embedding for o in llm.embed(texts)]), dim=-1)
    # Unit vectors of float32 sums over <= 128 tokens x 32 dims: rounding stays ~1e-6.
    torch.testing.assert_close(got, _reference(folder, texts), rtol=0, atol=1e-5)
