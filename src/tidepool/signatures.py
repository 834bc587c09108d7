"""Signatures of functions whose keyword arguments a dataclass owns.

`LLM(model, **engine_args)` takes `EngineArgs`'s fields as `**kwargs` so that the argument list is
written once, in the dataclass, with the names, defaults and docs. `fields_as_keywords` puts them
back into what `help()` and `inspect.signature` show, as if they were written out:

    @fields_as_keywords(EngineArgs)
    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None: ...

    inspect.signature(LLM) → (model='...', *, runner='auto', ..., model_impl='auto', **kwargs)
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

_Function = TypeVar("_Function", bound=Callable[..., Any])

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def fields_as_keywords(
    fields_of: type, *, hide_var_keyword: bool = False
) -> Callable[[_Function], _Function]:
    """Show the fields of the dataclass `fields_of` as keyword-only parameters of the decorated
    function, right after its positional ones (calls are unchanged: it takes them as `**kwargs`).
    `hide_var_keyword`: its `**kwargs` takes nothing else, so it is not shown."""

    def decorate(function: _Function) -> _Function:
        signature = inspect.signature(function)
        params = list(signature.parameters.values())
        if hide_var_keyword:
            params = [param for param in params if param.kind != inspect.Parameter.VAR_KEYWORD]
        num_positional = sum(param.kind in _POSITIONAL for param in params)
        shown = []
        taken = {param.name for param in params}
        for field in dataclasses.fields(fields_of):
            if field.name in taken:  # already a parameter of its own (LLM's `model`)
                continue
            assert field.default is not dataclasses.MISSING, f"{field.name} needs a plain default"
            shown.append(
                inspect.Parameter(
                    field.name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=field.default,
                    annotation=field.type,
                )
            )
        function.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[*params[:num_positional], *shown, *params[num_positional:]]
        )
        return function

    return decorate
