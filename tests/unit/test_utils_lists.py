"""utils/lists.filled: a list built slot by slot is handed on only when every slot is filled."""

from __future__ import annotations

import pytest

from tidepool.utils.lists import filled


def test_filled_hands_back_the_same_list() -> None:
    items: list[int | None] = [None, None]
    items[1], items[0] = 2, 0  # filled out of order; 0 is a value, not a missing slot
    assert filled(items) is items and items == [0, 2]


def test_filled_refuses_a_slot_left_none() -> None:
    with pytest.raises(AssertionError, match="left unfilled"):
        filled([1, None, 3])
