"""argparse from dataclasses: each field's type, default and docstring become a flag and its
help (as vLLM's `EngineArgs.add_cli_args` does), and vLLM's `FlexibleArgumentParser`.

A field's docstring is the string literal right after it in the class body (read with `ast`);
its first sentence is the help. Types map as vLLM maps them: bool → `--x / --no-x`, Literal →
choices, int / float / str, dict or a config dataclass → JSON, `bool | str` → an optional value
(`--hf-token` alone means True).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import textwrap
import types
import typing
from functools import cache
from typing import Any, Literal


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's parser: `--max_model_len` is read as `--max-model-len` (underscores in a flag's
    name are dashes), and `--flag=value` works as usual."""

    def parse_known_args(self, args=None, namespace=None):
        import sys

        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args([_dashed(a) for a in argv], namespace)


def _dashed(arg: str) -> str:
    if not arg.startswith("--") or arg == "--":
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name → its docstring (the string literal after the field in the class body), for
    `cls` and its dataclass bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
        for node, after in zip(body, body[1:] + [None], strict=True):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def first_sentence(doc: str) -> str:
    """The help line of a docstring: its first sentence, on one line."""
    text = " ".join(doc.split())
    start = 0
    while (cut := text.find(". ", start)) > 0:
        if not text[:cut].endswith(("e.g", "i.e", "etc")):
            return text[: cut + 1]
        start = cut + 2
    return text


def _members(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _json_object(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None


def _none_or(kind: Any):
    def parse(value: str) -> Any:
        return None if value in ("None", "none") else kind(value)

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def argparse_kwargs(hint: Any, default: Any, doc: str) -> dict[str, Any]:
    """argparse's keywords for one field (its type hint, default and docstring)."""
    members = _members(hint)
    optional = type(None) in members
    members = tuple(m for m in members if m is not type(None))
    help_text = first_sentence(doc).replace("%", "%%") if doc else ""
    kwargs: dict[str, Any] = {"default": default, "help": help_text}
    if bool in members and str in members:  # vLLM's hf_token: `--hf-token` alone means True
        kwargs.update(nargs="?", const=True, type=str)
    elif bool in members:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif any(typing.get_origin(m) is Literal for m in members):
        choices = [
            c for m in members if typing.get_origin(m) is Literal for c in typing.get_args(m)
        ]
        kwargs.update(type=str, choices=choices + (["None"] if optional else []))
    elif any(
        typing.get_origin(m) is dict or m is dict or dataclasses.is_dataclass(m) for m in members
    ):
        kwargs["type"] = _json_object
        kwargs["help"] += " (JSON)"
    elif any(typing.get_origin(m) is list for m in members):  # vLLM's list flags: nargs="+"
        kwargs.update(type=str, nargs="+")
    elif int in members:
        kwargs["type"] = int
    elif float in members:
        kwargs["type"] = float
    else:
        kwargs["type"] = str
    if optional and "type" in kwargs and kwargs.get("nargs") not in ("?", "+"):
        kwargs["type"] = _none_or(kwargs["type"])
    if "action" not in kwargs:  # BooleanOptionalAction shows its default itself
        kwargs["help"] += " (default: none)" if default is None else " (default: %(default)s)"
    return kwargs


def dataclass_arguments(
    cls: type, names: typing.Iterable[str] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """(field name, argparse keywords) for the fields of dataclass `cls` (or `names` of them)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    out = []
    for name in names if names is not None else by_name:
        f = by_name[name]
        default = f.default if f.default is not dataclasses.MISSING else None
        out.append((name, argparse_kwargs(hints[name], default, docs.get(name, ""))))
    return out


def flag_of(name: str) -> str:
    """A field's flag: `max_model_len` → `--max-model-len`."""
    return "--" + name.replace("_", "-")
