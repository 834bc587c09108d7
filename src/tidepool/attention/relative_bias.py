"""An additive attention-score bias that depends only on the key - query distance (the bucketed
relative position bias of T5 and MPNet), built once per step and shared by every layer.

The model keeps a [num_buckets, heads] table; per step it is expanded, through the bucket of each
distance, into one row of biases per head over the distances the step can have:

    by_distance[h, c] = table[bucket(c - offset), h]      c = key - query + offset

so a backend reads the bias of (query i, key j) at column j - i + offset, with no [L, L] tensor.
Worked example, longest sequence 3, offset 3 + 7 = 10: query 2 and key 0 read column 8
(distance -2). The offset and the width carry slack on both sides because the CPU kernel reads 16-
and 32-wide vectors past the last key and runs query tiles of 8 rows past the last query.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# Slack the CPU kernel's tiles read beyond a sequence (csrc/cpu_encoder_attention.cpp: query tiles
# of 8 rows, key blocks of 32): columns before offset - max_len and after offset + max_len.
_QUERY_SLACK = 7
_KEY_SLACK = 32


def bidirectional_bucket(
    relative_position: torch.Tensor, num_buckets: int = 32, max_distance: int = 128
) -> torch.Tensor:
    """key - query distance (int64) → bucket, with the integer arithmetic and float32 log of
    transformers' T5Attention._relative_position_bucket (bidirectional; MPNet's is the same
    function): half the buckets per direction (keys after the query in the upper half), exact up
    to num_buckets / 4, logarithmic up to max_distance, the last bucket beyond.

    Worked example, 8 buckets, max_distance 16 (max_exact 2): distances 0, -1 → 0, 1; -2..-5 → 2
    and -6 onwards → 3 (2 + log(|d| / 2) / log(8) * 2, rounded down, capped at 3); keys after
    the query take the upper half: +1 → 5, +2..+5 → 6, +6 onwards → 7."""
    half = num_buckets // 2
    ret = (relative_position > 0).to(torch.long) * half
    n = relative_position.abs()
    max_exact = half // 2
    is_small = n < max_exact
    val_if_large = max_exact + (
        torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (half - max_exact)
    ).to(torch.long)
    val_if_large = torch.clamp(val_if_large, max=half - 1)
    return ret + torch.where(is_small, n, val_if_large)


@dataclass(frozen=True)
class RelativePositionBias:
    """One step's bias by distance, for every head (float32)."""

    by_distance: torch.Tensor
    """[heads, width] float32, contiguous: the bias of key j for query i at column j - i + offset."""
    offset: int
    """The column of distance 0; at least max_len - 1 + the kernel's query slack."""
    _dense: dict[tuple[object, ...], torch.Tensor] = field(
        default_factory=dict, compare=False, repr=False
    )
    """Dense masks the SDPA path needs, made once per step on first use."""

    @classmethod
    def build(
        cls,
        table: torch.Tensor,
        bucket_of: Callable[[torch.Tensor], torch.Tensor],
        max_len: int,
    ) -> RelativePositionBias:
        """table: [num_buckets, heads]; bucket_of maps int64 distances (key - query) to buckets;
        max_len: the step's longest sequence."""
        offset = max_len - 1 + _QUERY_SLACK
        width = offset + max_len + _KEY_SLACK
        distances = torch.arange(width, device=table.device) - offset
        by_distance = table[bucket_of(distances)].t().float().contiguous()
        return cls(by_distance, offset)

    def dense(self, length: int, dtype: torch.dtype) -> torch.Tensor:
        """[heads, length, length] in `dtype`: entry (h, i, j) is the bias of key j for query i."""
        key = (length, dtype)
        bias = self._dense.get(key)
        if bias is None:
            idx = torch.arange(length, device=self.by_distance.device)
            columns = idx[None, :] - idx[:, None] + self.offset  # [L, L]: j - i + offset
            bias = self.by_distance[:, columns].to(dtype)
            self._dense[key] = bias
        return bias

    def with_key_mask(
        self, bucket_start: int, key_mask: torch.Tensor | None, length: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """The additive mask of one padded bucket: the bias plus -inf at padding keys.

        key_mask: [num_seqs, 1, 1, length] bool or None → [num_seqs or 1, heads, length, length]."""
        key = ("bucket", bucket_start, length, dtype)
        mask = self._dense.get(key)
        if mask is None:
            mask = self.dense(length, dtype)[None]
            if key_mask is not None:
                mask = mask.masked_fill(~key_mask, float("-inf"))
            self._dense[key] = mask
        return mask
