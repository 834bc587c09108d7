"""Lists built slot by slot (results placed by index as they arrive, out of order)."""

from __future__ import annotations

from typing import TypeVar, cast

T = TypeVar("T")


def filled(items: list[T | None]) -> list[T]:
    """`items` once every slot holds its value: the type checker's list[T], checked (a slot
    left None is a bug of the caller, not a result)."""
    assert all(item is not None for item in items), "a slot was left unfilled"
    return cast("list[T]", items)
