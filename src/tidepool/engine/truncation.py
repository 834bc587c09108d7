"""Truncation rules of the input processor: how many tokens of text a prompt may keep, how a
pair's budget is split between its two texts, which end of a text is kept, and the messages of
the texts refused for their length."""

from __future__ import annotations

from dataclasses import dataclass

from tidepool.engine.prefix_tokenizer import CHARS_PER_TOKEN, FirstTokens
from tidepool.params import PoolingParams


@dataclass(frozen=True)
class Budget:
    """How many tokens of text (special tokens excluded) one prompt may have."""

    num_tokens: int
    """Tokens of text the prompt may keep."""
    truncate: bool
    """A longer text is cut to `num_tokens` (truncate_prompt_tokens); else it is refused."""

    @property
    def num_wanted(self) -> int:
        """Tokens to read from the text: one more than it may keep tells that it is too long."""
        return max(self.num_tokens, 0) + (0 if self.truncate else 1)


def longest_first(num_first: int, num_second: int, budget: int) -> tuple[int, int]:
    """Tokens kept of each text of a pair: the tokenizers library's "longest_first" truncation
    (the longer text is cut first; when both are longer than half, the budget is split, the odd
    token to the longer one). One difference: when both texts are longer than the whole budget,
    the first keeps budget // 2 and the second the rest, whichever is longer: knowing which is
    would mean reading both texts whole."""
    if num_first + num_second <= budget:
        return num_first, num_second
    half = budget // 2
    if num_first > budget and num_second > budget:
        return half, budget - half
    if 2 * min(num_first, num_second) > budget:
        return (budget - half, half) if num_first > num_second else (half, budget - half)
    if num_first <= num_second:
        return num_first, budget - num_first
    return budget - num_second, num_second


def keeps_last(budget: Budget, params: PoolingParams) -> bool:
    return budget.truncate and params.truncation_side == "left"


def keep(token_ids: list[int], num_tokens: int | None, side: str | None) -> list[int]:
    """The first `num_tokens` ids ("right" or None: the end is cut), or the last ("left");
    num_tokens None = all."""
    if num_tokens is None:
        return token_ids
    if side == "left":
        return token_ids[max(len(token_ids) - num_tokens, 0) :]
    return token_ids[:num_tokens]


def too_long(
    max_model_len: int, what: str, num_tokens: int, num_chars_read: int, num_chars: int
) -> str:
    """Why a text is refused as too long; only a prefix was read, so the count is a lower bound."""
    return (
        f"{what} is longer than {max_model_len} tokens, the model's maximum "
        f"(max_model_len): its first {num_chars_read:,} of {num_chars:,} characters already "
        f"give {num_tokens} tokens; shorten it or pass truncate_prompt_tokens to truncate"
    )


def too_sparse(what: str, first: FirstTokens, num_wanted: int, num_chars: int) -> str:
    """Why a text is refused whose first characters (the read limit) give too few tokens."""
    return (
        f"{what} has {num_chars:,} characters and its first {first.num_chars_read:,} give "
        f"only {first.num_tokens} tokens; tidepool reads at most {CHARS_PER_TOKEN} "
        f"characters per token it needs ({num_wanted} here), so a text this sparse (long "
        "runs of whitespace or of characters without a break) must be shortened"
    )
