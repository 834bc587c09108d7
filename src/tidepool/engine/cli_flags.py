"""The engine's flags, generated from `EngineArgs`' fields (tidepool.utils.argparse_utils), and
vLLM's engine flags tidepool does not have (engine/vllm_args.py), parsed so that they can be
refused or warned about by name instead of stopping the parser with "unrecognized arguments"."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from typing import Any

from tidepool.engine.vllm_args import FLAG_ALIASES, VLLM_ARGS, VllmArg
from tidepool.utils.argparse_utils import dataclass_arguments, flag_of

# vLLM flags engine_args_from_vllm reads itself: the deprecated --task (as runner / convert) and
# --gpu-memory-utilization (the KV cache's share of a GPU).
_SPECIAL = {
    "task": VllmArg("task", "special", ""),
    "gpu_memory_utilization": VllmArg("gpu_memory_utilization", "special", ""),
}


def _taken(parser: argparse.ArgumentParser, flags: list[str]) -> bool:
    return any(flag in parser._option_string_actions for flag in flags)


def _loose_value(value: str) -> Any:
    """A vLLM-only flag's value: JSON where it reads as JSON (`-tp 1` → 1), else the text."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def add_engine_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    include_model: bool = True,
    skip: frozenset[str] | set[str] = frozenset(),
) -> argparse.ArgumentParser:
    """A flag per field of `cls` (its type, default and docstring's first sentence: the help),
    with vLLM's names and short aliases; then vLLM's other engine flags (hidden from --help),
    which only record what was given. Flags the parser has already are left alone."""
    group = parser.add_argument_group("engine arguments (EngineArgs)")
    names = [f.name for f in fields(cls) if include_model or f.name != "model"]
    for name, kwargs in dataclass_arguments(cls, names):
        flags = [flag_of(name), *FLAG_ALIASES.get(name, ())]
        if not _taken(parser, flags):
            group.add_argument(*flags, dest=name, **kwargs)
    for name, arg in VLLM_ARGS.items() | _SPECIAL.items():
        flags = [flag_of(name), *FLAG_ALIASES.get(name, ())]
        if name in names or name in skip or _taken(parser, flags):
            continue
        if arg.switch:
            parser.add_argument(
                *flags,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )
        else:
            parser.add_argument(
                *flags,
                dest=name,
                type=_loose_value,
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )
    return parser


def engine_kwargs_of(
    args: argparse.Namespace, cls: type, *, include_model: bool = True
) -> dict[str, Any]:
    """The engine keywords of parsed flags: each field's value, and the vLLM-only flags given."""
    out = {
        f.name: getattr(args, f.name)
        for f in fields(cls)
        if hasattr(args, f.name) and (include_model or f.name != "model")
    }
    out.update({name: getattr(args, name) for name in VLLM_ARGS | _SPECIAL if hasattr(args, name)})
    return out
