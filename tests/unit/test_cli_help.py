"""First contact with the `tidepool` command: every flag explains itself and its default,
`--version` answers, `serve` warns before it exposes an unprotected server to the network,
`example-models` builds a usable random-weight cross-encoder."""

from __future__ import annotations

import argparse

import pytest

import tidepool
from tidepool.entrypoints.cli import build_parser, exposure_warning, main


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_every_flag_has_help_with_its_default(command: str) -> None:
    parser = _subparsers()[command]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help, f"tidepool {command} {name} has no help text"
        shown = formatter._expand_help(action)
        assert "default" in shown, f"tidepool {command} {name}: {shown!r} gives no default"


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"tidepool {tidepool.__version__}"


@pytest.mark.parametrize("host", [None, "0.0.0.0", "::"])
def test_serve_warns_on_all_interfaces_without_a_key(host: str | None) -> None:
    warning = exposure_warning(host, None)
    assert warning is not None and "--api-key" in warning and "127.0.0.1" in warning
    assert exposure_warning(host, "secret") is None


def test_serve_does_not_warn_on_one_interface() -> None:
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("localhost", None) is None


def test_example_models_builds_a_cross_encoder(tmp_path, capsys) -> None:
    from tidepool import LLM

    assert main(["example-models", str(tmp_path), "--seed", "1"]) == 0
    path = tmp_path / "cross-encoder-seed1"
    assert str(path) in capsys.readouterr().out
    scores = LLM(str(path)).score("what lives in a tide pool?", ["crabs", "vectors"])
    assert len(scores) == 2 and scores[0].outputs.score != scores[1].outputs.score
    before = (path / "model.safetensors").stat().st_mtime_ns
    assert main(["example-models", str(tmp_path), "--seed", "1"]) == 0  # reused, not rebuilt
    assert (path / "model.safetensors").stat().st_mtime_ns == before
