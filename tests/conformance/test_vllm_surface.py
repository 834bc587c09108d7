"""Every name of vLLM 0.32's surface, as the installed vLLM itself lists it
(vllm_surface.json, written by record_vllm_surface.py), is implemented or refused by name in
tidepool: never a bare TypeError / "unrecognized arguments", never accepted and ignored."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from tidepool.engine.args import AsyncEngineArgs, engine_args_from_vllm
from tidepool.engine.vllm_args import VLLM_ARGS
from tidepool.entrypoints.cli import build_parser
from tidepool.entrypoints.openai import protocol as p
from tidepool.params import PoolingParams, SamplingParams

SURFACE = json.loads(Path(__file__).with_name("vllm_surface.json").read_text(encoding="utf-8"))
# engine_args_from_vllm reads these two itself: the deprecated task, the GPU memory share.
SPECIAL = {"task", "gpu_memory_utilization"}
REQUESTS = {
    "EmbeddingCompletionRequest": p.EmbeddingRequest,
    "EmbeddingChatRequest": p.EmbeddingRequest,
    "ClassificationCompletionRequest": p.ClassificationRequest,
    "ClassificationChatRequest": p.ClassificationRequest,
    "PoolingCompletionRequest": p.PoolingRequest,
    "PoolingChatRequest": p.PoolingRequest,
    "ScoreQueriesDocumentsRequest": p.ScoreRequest,
    "ScoreQueriesItemsRequest": p.ScoreRequest,
    "ScoreTextRequest": p.ScoreRequest,
    "ScoreDataRequest": p.ScoreRequest,
    "RerankRequest": p.RerankRequest,
    "TokenizeCompletionRequest": p.TokenizeRequest,
    "TokenizeChatRequest": p.TokenizeRequest,
}


def test_the_recording_is_vllm_032() -> None:
    assert SURFACE["vllm_version"].startswith("0.32")
    assert set(SURFACE["requests"]) == set(REQUESTS)


@pytest.mark.parametrize("kind", ["llm_init", "engine_args"])
def test_every_engine_argument_is_a_field_or_known_by_name(kind: str) -> None:
    fields = set(AsyncEngineArgs.__dataclass_fields__)
    missing = [n for n in SURFACE[kind] if n not in fields | VLLM_ARGS.keys() | SPECIAL]
    assert missing == []


def test_vllm_only_engine_arguments_refuse_or_warn_when_set() -> None:
    fields = set(AsyncEngineArgs.__dataclass_fields__)
    for name in sorted(set(SURFACE["engine_args"]) - fields - SPECIAL):
        arg = VLLM_ARGS[name]
        value = True if arg.switch else "some-value"
        if value in arg.unset:  # a switch on by default in vLLM: on and off change nothing
            continue
        if arg.policy == "refuse":
            with pytest.raises(ValueError, match=name):
                engine_args_from_vllm({name: value})
        else:
            engine_args_from_vllm({name: value})  # a warning, no error
        engine_args_from_vllm({name: None})  # unset: changes nothing


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["serve"]


def test_every_vllm_serve_flag_is_parsed() -> None:
    """Parsed: implemented, or refused / warned about by name when given (test_cli.py)."""
    actions = _serve_parser()._option_string_actions
    assert [flag for flag in SURFACE["serve_flags"] if flag not in actions] == []


def test_every_params_field_exists() -> None:
    """A field: implemented, or refused by name in __post_init__ when set."""
    for cls, kind in ((PoolingParams, "pooling_params"), (SamplingParams, "sampling_params")):
        names = {f.name for f in dataclasses.fields(cls)}
        assert [n for n in SURFACE[kind] if n not in names] == [], kind


@pytest.mark.parametrize(
    ("name", "value"),
    [("logit_bias", {1: 2.0}), ("structured_outputs", {"json": {}}), ("prompt_logprobs", 1)],
)
def test_sampling_fields_without_a_sampler_counterpart_are_refused(name: str, value) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("model", sorted(REQUESTS))
def test_every_request_field_is_a_declared_field(model: str) -> None:
    """Declared: honoured or refused by the route (an undeclared one would be taken as an
    extra and ignored)."""
    declared = REQUESTS[model].model_fields
    assert [f for f in SURFACE["requests"][model] if f not in declared] == []
