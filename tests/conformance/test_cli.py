"""`vllm serve`'s flags on `tidepool serve`: generated from EngineArgs (each field a flag with its
type, default and docstring), implemented, refused with a message, or accepted with a warning;
never "unrecognized arguments" and never accepted and ignored."""

from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest

from tidepool.engine.args import EngineArgs
from tidepool.entrypoints.cli import build_parser, main
from tidepool.entrypoints.cli_args import _engine_kwargs
from tidepool.entrypoints.frontend_args import check_frontend_args
from tidepool.utils.argparse_utils import field_docs, first_sentence, flag_of


def _serve(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "MODEL", *flags])


def test_every_engine_args_field_is_a_flag_with_its_docstring() -> None:
    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    actions = {a.dest: a for a in serve.choices["serve"]._actions}
    docs = field_docs(EngineArgs)
    for field in dataclasses.fields(EngineArgs):
        if field.name == "model":  # MODEL / --model (several models) are serve's own
            continue
        action = actions[field.name]
        assert flag_of(field.name) in action.option_strings
        assert action.default == field.default
        assert first_sentence(docs[field.name]).replace("%", "%%") in action.help


@pytest.mark.parametrize(
    ("flags", "name", "value"),
    [
        (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
        (["--enable-prefix-caching"], "enable_prefix_caching", True),
        (["--block-size", "32"], "block_size", 32),
        (["--model-impl", "transformers"], "model_impl", "transformers"),
        (["--tokenizer", "/some/folder"], "tokenizer", "/some/folder"),
        (["--tokenizer-mode", "hf"], "tokenizer_mode", "hf"),
        (["--chat-template", "{{ messages }}"], "chat_template", "{{ messages }}"),
        (["--pooler-config", '{"pooling_type": "CLS"}'], "pooler_config", {"pooling_type": "CLS"}),
        (["-q", "int8"], "quantization", "int8"),
        (["-tp", "1"], "device", None),  # a parallel size of 1 is what runs: accepted
    ],
)
def test_engine_flags_are_implemented(flags: list[str], name: str, value) -> None:
    assert _engine_kwargs(_serve(*flags))[name] == value


@pytest.mark.parametrize(
    ("flags", "name"),
    [
        (["-tp", "2"], "tensor_parallel_size"),
        (["--skip-tokenizer-init"], "skip_tokenizer_init"),
        (["--enable-lora"], "enable_lora"),
        (["--kv-cache-dtype", "fp8"], "kv_cache_dtype"),
        (["--speculative-config", '{"method": "ngram"}'], "speculative_config"),
        (["--tokenizer-mode", "mistral"], "tokenizer_mode"),
    ],
)
def test_unimplemented_engine_flags_are_refused_by_name(flags: list[str], name: str, capsys):
    """Refused before any model is loaded, in one line (exit status 2)."""
    assert main(["serve", "MODEL", *flags]) == 2
    err = capsys.readouterr().err
    assert "not supported" in err and name in err


def test_harmless_flags_warn(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="tidepool"):
        kwargs = _engine_kwargs(_serve("--enforce-eager", "--disable-log-stats"))
    assert kwargs == _engine_kwargs(_serve())
    assert "enforce_eager" in caplog.text and "no effect" in caplog.text


@pytest.mark.parametrize(
    ("flags", "name", "value"),
    [
        (["--root-path", "/api"], "root_path", "/api"),
        (["--allowed-origins", '["https://a.example"]'], "allowed_origins", ["https://a.example"]),
        (["--disable-fastapi-docs"], "disable_fastapi_docs", True),
        (["--enable-log-requests"], "enable_log_requests", True),
        (["--max-log-len", "100"], "max_log_len", 100),
    ],
)
def test_frontend_flags_are_implemented(flags: list[str], name: str, value) -> None:
    args = _serve(*flags)
    check_frontend_args(args)
    assert getattr(args, name) == value


def test_unimplemented_frontend_flags_are_refused() -> None:
    with pytest.raises(SystemExit, match="--enable-auto-tool-choice"):
        check_frontend_args(_serve("--enable-auto-tool-choice"))
    with pytest.raises(SystemExit, match="--lora-modules"):
        check_frontend_args(_serve("--lora-modules", "a=b"))


def test_root_path_cors_and_docs_reach_the_app(tiny_model_path) -> None:
    from fastapi.testclient import TestClient

    from tidepool.engine.async_engine import AsyncEngine
    from tidepool.entrypoints.openai.server import ServerArgs, build_app

    engine = AsyncEngine.from_args(str(tiny_model_path("bert")), device="cpu", dtype="float32")
    args = ServerArgs(
        root_path="/api", allowed_origins=["https://a.example"], disable_fastapi_docs=True
    )
    with TestClient(build_app(engine, args)) as client:
        assert client.get("/docs").status_code == 404
        response = client.get("/health", headers={"Origin": "https://a.example"})
        assert response.headers["access-control-allow-origin"] == "https://a.example"
        assert client.app.root_path == "/api"
