"""The flags `tidepool serve` and `tidepool embed` share (the engine's, generated from
`EngineArgs` with `vllm serve`'s names), their argparse types, and turning them into `LLM` /
`AsyncEngine` arguments. `serve`'s vLLM frontend flags: entrypoints/frontend_args.py."""

from __future__ import annotations

import argparse
import logging
from dataclasses import fields
from typing import Any

from tidepool.checkpoint.loader import DEFAULT_MODEL
from tidepool.engine.args import EngineArgs, engine_args_from_vllm
from tidepool.engine.cli_flags import add_engine_flags, engine_kwargs_of
from tidepool.entrypoints.frontend_args import FRONTEND_DESTS

logger = logging.getLogger("tidepool")


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, shared by `serve` and `embed`: MODEL / --model (several for `serve`),
    then one flag per EngineArgs field with vLLM's names (generated: engine/cli_flags.py), and
    vLLM's engine flags tidepool does not implement, refused or warned about when given."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help=f"model folder or id (default: the bundled {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help="the model, as a flag (same as MODEL); `serve` takes it more than once to serve "
        "several models, each on its own engine (default: MODEL)",
    )
    # `serve` has its own --served-model-name (one per model): not vLLM's engine-argument one.
    # serve implements --shutdown-timeout itself (its graceful drain, as vLLM's flag means);
    # the frontend flags vLLM also has as engine arguments are frontend_args.py's.
    skip = {"served_model_name", "shutdown_timeout", *FRONTEND_DESTS}
    add_engine_flags(parser, EngineArgs, include_model=False, skip=skip)


def add_hub_args(parser: argparse.ArgumentParser) -> None:
    """Where a model id comes from (EngineArgs' revision, download_dir, hf_token)."""
    parser.add_argument(
        "--revision",
        default=None,
        help="Hub revision of a model id: a branch, tag or commit (default: the default branch)",
    )
    parser.add_argument(
        "--download-dir",
        default=None,
        help="Hugging Face cache to look in and download to (default: HF_HUB_CACHE, else "
        "$HF_HOME/hub, else ~/.cache/huggingface/hub)",
    )
    parser.add_argument(
        "--hf-token",
        nargs="?",
        const=True,
        default=None,
        metavar="TOKEN",
        help="Hub token for private or gated models; alone: the one saved by `hf auth login` "
        "(default: HF_TOKEN, else that one)",
    )


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments of parsed flags (EngineArgs' fields but the model), after vLLM's
    flags were checked: ValueError naming a refused one, a warning for a harmless one."""
    engine_args = engine_args_from_vllm(engine_kwargs_of(args, EngineArgs, include_model=False))
    kwargs = {f.name: getattr(engine_args, f.name) for f in fields(engine_args)}
    kwargs.pop("model")
    return kwargs


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _model_args(args: argparse.Namespace) -> list[str]:
    """MODEL, then each --model, in order (MODEL repeated as the first --model counts once)."""
    flags = list(args.model or [])
    if args.model_tag and flags and flags[0] == args.model_tag:
        flags = flags[1:]
    models = ([args.model_tag] if args.model_tag else []) + flags
    repeated = sorted({m for m in models if models.count(m) > 1})
    if repeated:
        raise SystemExit(f"error: the model {repeated[0]!r} is given twice")
    return models or [DEFAULT_MODEL]


def _model_arg(args: argparse.Namespace) -> str:
    models = _model_args(args)
    if len(models) > 1:
        raise SystemExit(f"error: two models given: {' and '.join(map(repr, models))}")
    return models[0]


# ---------------------------------------------------------------------- serve


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return number


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"{port} is not a TCP port: give 1-65535 (or 0 for a free one)"
        )
    return port
