"""Issue 26's smaller holes, each closed: an API key that is empty or has whitespace around it
is refused at start (it served every route unauthenticated, or could never match); messages
name the field the client sent (Cohere's output_dimension / max_tokens, not the engine's
dimensions / truncate_prompt_tokens)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tidepool.entrypoints.cli import build_parser, cmd_serve
from tidepool.entrypoints.cli_parts import serve_api_key
from tidepool.entrypoints.openai.server import ServerArgs, build_app


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [
        ("", None, "--api-key is empty"),
        ("   ", None, "--api-key is empty"),
        (None, "", "TIDEPOOL_API_KEY is empty"),
        (" sk-1", None, "--api-key has whitespace around it (1 before, 0 after)"),
        (None, "sk-1\n", "TIDEPOOL_API_KEY has whitespace around it (0 before, 1 after)"),
    ],
)
def test_unusable_api_keys_are_refused(monkeypatch, flag, env, expected) -> None:
    if env is None:
        monkeypatch.delenv("TIDEPOOL_API_KEY", raising=False)
    else:
        monkeypatch.setenv("TIDEPOOL_API_KEY", env)
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        serve_api_key(flag)


def test_serve_refuses_an_empty_key_before_loading(monkeypatch, capsys) -> None:
    from tidepool.entrypoints import cli

    monkeypatch.setenv("TIDEPOOL_API_KEY", "")
    args = build_parser().parse_args(["serve", "/nowhere"])
    with pytest.raises(ValueError, match="TIDEPOOL_API_KEY is empty"):
        cmd_serve(args)  # /nowhere was never looked at: the key is checked first
    assert cli.main(["serve", "/nowhere"]) == 2
    assert capsys.readouterr().err.startswith("error: TIDEPOOL_API_KEY is empty")


def test_good_keys(monkeypatch) -> None:
    monkeypatch.setenv("TIDEPOOL_API_KEY", "from-env")
    assert serve_api_key(None) == "from-env"
    assert serve_api_key("sk 1") == "sk 1"  # inside spaces are the client's to send
    monkeypatch.delenv("TIDEPOOL_API_KEY")
    assert serve_api_key(None) is None


@pytest.fixture(scope="module")
def client(tiny_model_path):
    from tidepool.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_args(str(tiny_model_path("bert")), device="cpu", dtype="float32")
    with TestClient(build_app(engine, ServerArgs(api_key="sk-1"))) as test_client:
        yield test_client


def test_build_app_refuses_an_empty_key(tiny_model_path) -> None:
    from tidepool.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_args(str(tiny_model_path("bert")), device="cpu")
    with pytest.raises(ValueError, match="api_key is empty"):
        build_app(engine, ServerArgs(api_key=""))


AUTH = {"Authorization": "Bearer sk-1"}


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [("output_dimension", 0, "output_dimension must be >= 1"), ("max_tokens", 0, "max_tokens")],
)
def test_cohere_messages_name_cohere_fields(client, field, value, named) -> None:
    answer = client.post("/v2/embed", json={"texts": ["a"], field: value}, headers=AUTH)
    assert answer.status_code == 400, answer.text
    message = answer.json()["message"]
    assert named in message and "dimensions" not in message.replace("output_dimension", "")
    assert "truncate_prompt_tokens" not in message


def test_cohere_output_dimension_too_large_names_it(client) -> None:
    answer = client.post("/v2/embed", json={"texts": ["a"], "output_dimension": 1000}, headers=AUTH)
    assert answer.status_code == 400, answer.text
    assert "output_dimension" in answer.json()["message"]


def test_keys_are_checked(client) -> None:
    assert client.post("/v1/embeddings", json={"input": "a"}).status_code == 401
    assert client.post("/v1/embeddings", json={"input": "a"}, headers=AUTH).status_code == 200


@pytest.mark.parametrize(
    ("flags", "max_bytes", "max_entries"),
    [
        ([], 0, None),
        (["--embedding-cache-size", "100"], 256 << 20, 100),
        (["--embedding-cache-bytes", "512MiB"], 512 << 20, None),
        (["--embedding-cache-bytes", "2GB", "--embedding-cache-size", "10"], 2 * 10**9, 10),
        (["--embedding-cache-bytes", "1048576"], 1 << 20, None),
        (["--embedding-cache-bytes", "0", "--embedding-cache-size", "10"], 0, 10),
    ],
)
def test_cache_flags(flags, max_bytes, max_entries) -> None:
    from tidepool.entrypoints.cli_parts import shared_work_options

    options = shared_work_options(build_parser().parse_args(["serve", *flags]))
    assert (options.max_cache_bytes, options.max_cache_entries) == (max_bytes, max_entries)


def test_a_bad_cache_size_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--embedding-cache-bytes", "lots"])
    assert "'lots' is not a size" in capsys.readouterr().err
