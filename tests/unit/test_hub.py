"""Hub models through huggingface_hub, against the test Hub (tests/hub_server.py): download only
what a load reads, then the cache (also offline), revisions, tokens, and one-line errors."""

from __future__ import annotations

import threading

import huggingface_hub.constants
import pytest
import torch
from hub_server import DECOYS, TOKEN, folder_files

from tidepool import LLM
from tidepool.checkpoint.hub import HubOptions, download, select_files
from tidepool.checkpoint.loader import (
    DEFAULT_MODEL,
    ModelAccessError,
    ModelNotFoundError,
    locate_model,
)
from tidepool.entrypoints.cli import main

TEXTS = ["hi", "The quick brown fox jumps over the lazy dog."]


def _go_offline(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _embed(model, **kwargs) -> torch.Tensor:
    llm = LLM(str(model), device="cpu", dtype="float32", **kwargs)
    return torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])


# ----------------------------------------------------------------------------- which files


def test_select_files_takes_what_the_load_reads():
    repo = [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.txt",
        "sentencepiece.bpe.model",
        "model.safetensors",
        "modules.json",
        "config_sentence_transformers.json",
        "sentence_bert_config.json",
        "1_Pooling/config.json",
        "2_Dense/config.json",
        "2_Dense/model.safetensors",
        "2_Dense/pytorch_model.bin",
        "sparse_linear.pt",
        "colbert_linear.pt",
        "artifact.metadata",
        "preprocessor_config.json",
        "processor_config.json",
        "modeling_x.py",
        ".gitattributes",
        "training_args.bin",
        "onnx/tokenizer.json",
        *DECOYS,
    ]
    expected = [
        "1_Pooling/config.json",
        "2_Dense/config.json",
        "2_Dense/model.safetensors",
        "artifact.metadata",
        "colbert_linear.pt",
        "config.json",
        "config_sentence_transformers.json",
        "model.safetensors",
        "modules.json",
        "preprocessor_config.json",
        "processor_config.json",
        "sentence_bert_config.json",
        "sentencepiece.bpe.model",
        "sparse_linear.pt",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.txt",
    ]
    assert select_files(repo) == expected
    assert select_files(repo, trust_remote_code=True) == sorted([*expected, "modeling_x.py"])


def test_select_files_weights_rules():
    # .bin only when there are no safetensors (also in a module folder), with its index.
    bins = ["config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
    bins += ["pytorch_model.bin.index.json", "2_Dense/config.json", "2_Dense/pytorch_model.bin"]
    assert select_files(bins) == sorted(bins)
    # Sharded safetensors and their index; a consolidated copy beside them is left out.
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    repo = ["config.json", *shards, "model.safetensors.index.json", "consolidated.safetensors"]
    assert select_files(repo) == sorted(["config.json", *shards, "model.safetensors.index.json"])
    # Safetensors with another name are taken when they are the only ones.
    assert select_files(["config.json", "weights.safetensors"]) == [
        "config.json",
        "weights.safetensors",
    ]


# ----------------------------------------------------------------------------- download, cache


def test_download_fetches_only_what_the_load_reads_then_the_cache_serves(
    fake_hub,
    monkeypatch,
    caplog,
):
    hub = fake_hub.hub
    with caplog.at_level("INFO", logger="tidepool"):
        got = _embed("org/tiny-st")
    assert "model org/tiny-st: from the Hub" in caplog.text
    torch.testing.assert_close(got, _embed(fake_hub.models.v2), rtol=0, atol=0)
    served = folder_files(fake_hub.models.v2)
    assert sorted(hub.fetched("org/tiny-st")) == select_files(list(served))
    assert "1_Pooling/config.json" in hub.fetched("org/tiny-st")
    assert not set(hub.touched("org/tiny-st")) & set(DECOYS), "a decoy file was requested"
    location = locate_model("org/tiny-st")
    assert (location.source, location.commit) == ("Hugging Face cache", fake_hub.commits["v2"])
    assert location.path.is_relative_to(fake_hub.cache)

    # Offline with the Hub gone: the cache alone; an id it lacks is named in the error.
    hub.stop()
    _go_offline(monkeypatch)
    caplog.clear()
    with caplog.at_level("INFO", logger="tidepool"):
        torch.testing.assert_close(_embed("org/tiny-st"), got, rtol=0, atol=0)
    assert "model org/tiny-st: from the Hugging Face cache" in caplog.text
    with pytest.raises(ModelNotFoundError) as info:
        LLM("org/not-cached", device="cpu")
    message = str(info.value)
    assert "'org/not-cached' not found" in message and "HF_HUB_OFFLINE=1" in message
    assert "\n" not in message


def test_revisions(fake_hub):
    commits = fake_hub.commits
    assert locate_model("org/tiny-st", revision="v1").commit == commits["v1"]
    assert locate_model("org/tiny-st", revision=commits["v2"]).commit == commits["v2"]
    torch.testing.assert_close(
        _embed("org/tiny-st", revision="v1"), _embed(fake_hub.models.v1), rtol=0, atol=0
    )
    llm = LLM("org/tiny-st", revision="v1", device="cpu")
    config = llm.model_config
    assert (config.revision, config.commit, config.source) == (
        "v1",
        commits["v1"],
        "Hugging Face cache",
    )
    with pytest.raises(ModelNotFoundError, match="revision 'nope' of 'org/tiny-st' not found on"):
        locate_model("org/tiny-st", revision="nope")


def test_download_dir(fake_hub, tmp_path):
    cache = tmp_path / "models"
    location = locate_model("org/tiny-st", download_dir=str(cache))
    assert location.path.is_relative_to(cache) and location.source == "Hub"
    assert not fake_hub.cache.exists() or not any(fake_hub.cache.glob("models--*/snapshots/*"))
    assert locate_model("org/tiny-st", download_dir=str(cache)).source == "Hugging Face cache"


def test_private_repo_needs_the_token(fake_hub, monkeypatch):
    with pytest.raises(ModelNotFoundError) as info:
        locate_model("org/private-st")
    message = str(info.value)
    assert "'org/private-st' not found on http://127.0.0.1" in message
    assert "a private repo needs a token" in message and "\n" not in message
    with pytest.raises(ModelAccessError, match=r"refused the token for 'org/private-st' \(401"):
        locate_model("org/private-st", hf_token="hf_wrong")
    with pytest.raises(ModelAccessError, match="hf_token=True asks for the token saved by"):
        locate_model("org/private-st", hf_token=True)  # nothing saved in this HF_HOME
    assert locate_model("org/private-st", hf_token=TOKEN).source == "Hub"
    # HF_TOKEN is read when no token is given (here: the snapshot is cached already, so a fresh
    # cache dir makes it download again).
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    other = fake_hub.home / "other-cache"
    assert locate_model("org/private-st", download_dir=str(other)).source == "Hub"


def test_gated_repo_is_one_line(fake_hub):
    with pytest.raises(ModelAccessError) as info:
        locate_model("org/gated-st")
    message = str(info.value)
    assert "'org/gated-st' on http://127.0.0.1" in message and "is gated" in message
    assert "hf_token" in message and "\n" not in message
    assert locate_model("org/gated-st", hf_token=TOKEN).source == "Hub"


def test_not_found_and_hub_down(fake_hub, minilm_path, monkeypatch):
    with pytest.raises(ModelNotFoundError) as info:
        locate_model("org/nope")
    message = str(info.value)
    assert f"model 'org/nope' not found on {fake_hub.hub.url}" in message
    assert "Tried: local folder org/nope (does not exist)" in message and "\n" not in message
    # The Hub out of reach: one line naming its address; the bundled default model still loads
    # from its package.
    url = fake_hub.hub.url
    fake_hub.hub.stop()
    with pytest.raises(ModelNotFoundError) as info:
        locate_model("org/tiny-st")
    message = str(info.value)
    assert f"cannot reach the Hub at {url}" in message and "\n" not in message
    assert "tidepool download org/tiny-st" in message
    assert locate_model(DEFAULT_MODEL).path == minilm_path.resolve()


def test_bin_weights_only_when_there_are_no_safetensors(fake_hub):
    torch.testing.assert_close(
        _embed("org/tiny-bin"), _embed(fake_hub.models.bin_only), rtol=0, atol=0
    )
    fetched = fake_hub.hub.fetched("org/tiny-bin")
    assert "pytorch_model.bin" in fetched and "tf_model.h5" not in fake_hub.hub.touched(
        "org/tiny-bin"
    )


def test_partial_cache_is_completed_online_and_named_offline(fake_hub, monkeypatch):
    location = locate_model("org/tiny-st")
    pooling = location.path / "1_Pooling" / "config.json"
    pooling.resolve().unlink()  # its blob, as after an interrupted download
    pooling.unlink()
    _go_offline(monkeypatch)
    with pytest.raises(ModelNotFoundError, match=r"lacks 1_Pooling/config.json"):
        locate_model("org/tiny-st")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    before = len(fake_hub.hub.fetched("org/tiny-st"))
    assert locate_model("org/tiny-st").source == "Hub"
    assert fake_hub.hub.fetched("org/tiny-st")[before:] == ["1_Pooling/config.json"]
    assert pooling.is_file()


def test_concurrent_loads_download_once(fake_hub):
    """Engines starting together on one node (Ray actors) download the model once: the others
    wait on the repo's lock, then find the cache complete."""
    results = []
    options = HubOptions()
    threads = [
        threading.Thread(target=lambda: results.append(download("org/tiny-st", options)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 4 and len({r.path for r in results}) == 1
    fetched = fake_hub.hub.fetched("org/tiny-st")
    assert sorted(fetched) == sorted(set(fetched)), "a file was downloaded twice"
    infos = [
        p for m, p in fake_hub.hub.requests if p.startswith("/api/models/org/tiny-st/revision")
    ]
    assert len(infos) <= 2  # model_info, and snapshot_download's own: by one engine only


# ----------------------------------------------------------------------------- the CLI


def test_cli_download(fake_hub, capsys, monkeypatch):
    assert main(["download", "org/tiny-st", "--revision", "v1"]) == 0
    path = capsys.readouterr().out.strip()
    assert path.endswith(fake_hub.commits["v1"]) and path.startswith(str(fake_hub.cache))
    assert not set(fake_hub.hub.touched("org/tiny-st")) & set(DECOYS)
    # Online, a second run asks the Hub what the revision is now (a moved branch is updated);
    # the files it has already are not fetched again.
    fetched = len(fake_hub.hub.fetched("org/tiny-st"))
    infos = len([p for _, p in fake_hub.hub.requests if p.startswith("/api/models/org/tiny-st")])
    assert main(["download", "org/tiny-st", "--revision", "v1"]) == 0
    assert capsys.readouterr().out.strip() == path
    assert len(fake_hub.hub.fetched("org/tiny-st")) == fetched
    assert len([p for _, p in fake_hub.hub.requests if p.startswith("/api/models/org/")]) > infos
    # Then offline: the load finds it.
    fake_hub.hub.stop()
    _go_offline(monkeypatch)
    assert locate_model("org/tiny-st", revision="v1").source == "Hugging Face cache"
    assert main(["download", "org/tiny-st", "--revision", "v1"]) == 0
    assert main(["download", "org/not-cached"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model 'org/not-cached' is not in the Hugging Face cache")
    assert err.count("\n") == 1


def test_cli_hub_errors_are_one_line(fake_hub, capsys):
    assert main(["download", "org/gated-st"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 'org/gated-st' on ") and err.count("\n") == 1
    assert main(["download", "org/private-st", "--hf-token", TOKEN]) == 0


def test_ray_job_downloads_on_the_driver_and_pins_the_commit(fake_hub, tmp_path, monkeypatch):
    """`tidepool embed --ray`: the driver resolves (and downloads) the model once; every actor
    gets the commit it saw, so all nodes load the same snapshot even if `main` moves."""
    pytest.importorskip("ray")
    import tidepool.jobs.ray_runner as ray_runner

    jobs = []

    def run(job, address):  # the cluster part is tests/e2e/test_ray.py's
        jobs.append(job)
        return ray_runner.JobSummary(num_shards=1, num_skipped=0, num_rows=2, num_errors=0)

    monkeypatch.setattr(ray_runner, "run_ray_embed_job", run)
    (tmp_path / "in.txt").write_text("a\nb\n")
    args = ["embed", "org/tiny-st", "--ray", "local", "-i", str(tmp_path / "in.txt")]
    assert main([*args, "-o", str(tmp_path / "out")]) == 0
    assert jobs[0].engine_kwargs["revision"] == fake_hub.commits["v2"]
    assert jobs[0].model == "org/tiny-st"
    assert locate_model("org/tiny-st").source == "Hugging Face cache"


def test_the_older_sentence_transformers_clip_layout_is_recognised_by_its_listing():
    from tidepool.checkpoint.legacy_clip import listed_module_config

    legacy = ["modules.json", "0_CLIPModel/config.json", "0_CLIPModel/model.safetensors"]
    assert listed_module_config(select_files(legacy)) == "0_CLIPModel/config.json"
    assert "0_CLIPModel/model.safetensors" in select_files(legacy)
    assert listed_module_config(["modules.json", "0_Transformer/config.json"]) is None
    assert listed_module_config(["config.json", *legacy]) is None  # a normal folder
    assert listed_module_config(legacy[1:]) is None  # no modules.json
