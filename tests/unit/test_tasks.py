"""Up-front checks: max_model_len must be >= 1; a call the model cannot serve fails before any
work (engine/tasks.py), with the model's architecture and what it supports."""

from __future__ import annotations

import pytest

from tidepool.engine.tasks import check_task_supported, supported_tasks
from tidepool.model_loader.resolve import build_model_config


@pytest.mark.parametrize("bad", [0, -3])
def test_max_model_len_below_one_is_refused(tiny_model_path, bad):
    with pytest.raises(ValueError, match=f"max_model_len must be >= 1, got {bad}"):
        build_model_config(str(tiny_model_path("bert")), device="cpu", max_model_len=bad)
    assert build_model_config(str(tiny_model_path("bert")), max_model_len=1).max_model_len == 1


def test_tasks_of_each_kind(tiny_model_path, tiny_decoder_path):
    embedder = build_model_config(str(tiny_model_path("bert")), device="cpu")
    cross = build_model_config(str(tiny_model_path("bert-cross-encoder")), device="cpu")
    decoder = build_model_config(str(tiny_decoder_path("llama")), device="cpu")
    assert supported_tasks(embedder) == ("embed", "token_embed")
    assert supported_tasks(cross) == ("classify", "score")
    assert supported_tasks(decoder) == ()
    for task in ("embed", "token_embed", "score"):
        check_task_supported(embedder, task)  # score: the cosine of two embeddings
    for task in ("classify", "score"):
        check_task_supported(cross, task)
    with pytest.raises(
        ValueError,
        match=r"classify\(\) needs a model with a classification head \(BertModel is an "
        r"embedding model; it supports embed, token_embed\)",
    ):
        check_task_supported(embedder, "classify")
    with pytest.raises(
        ValueError,
        match=r"embed\(\) needs an embedding model \(BertForSequenceClassification is a "
        r"classification model; it supports classify, score\)",
    ):
        check_task_supported(cross, "embed")
    with pytest.raises(ValueError, match="is a generating model; it serves no pooling task"):
        check_task_supported(decoder, "embed")


def test_pooling_call_on_a_generating_model_names_the_runner(tiny_decoder_path):
    """A *ForCausalLM loaded with runner="auto" generates; embed() / classify() say how to load
    it for pooling instead of only what it is."""
    decoder = build_model_config(str(tiny_decoder_path("llama")), device="cpu")
    with pytest.raises(ValueError, match=r'embed\(\) needs .*; load it with runner="pooling" to '):
        check_task_supported(decoder, "embed")
    with pytest.raises(ValueError, match=r'load it with runner="pooling", convert="classify"'):
        check_task_supported(decoder, "classify")
