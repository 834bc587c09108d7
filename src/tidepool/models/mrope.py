"""M-RoPE (Qwen2-VL's multimodal rotary embedding): three position rows, one per axis.

Every token has a (temporal, height, width) position; the rotated pairs of a head are split in
three sections (`mrope_section`, summing to head_dim / 2) and section s turns with row s:

    text token at sequence index i:  (p, p, p), p = i + shift (shift: what the images before it
                                     moved the count by)
    image of grid (t, h, w) after merging (h' = h / merge, w' = w / merge), starting at p:
                                     token (ti, hi, wi) → (p + ti, p + hi, p + wi), row-major;
                                     the text after it starts at p + max(h', w')

so a text-only prompt has three equal rows (plain RoPE). The rule (transformers'
`get_rope_index`) is computed once per request from its prompt and its images' placeholder
ranges; a generated token at index i >= len(prompt) has (i + delta) * 3, where
delta = max(prompt positions) + 1 - len(prompt) (vLLM's mrope_position_delta).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tidepool.models.layers.rotary import RotaryEmbedding, rope_parameters


@dataclass(frozen=True)
class ImagePlacement:
    """Where an image's placeholder tokens lie in the prompt, and its grid of patches."""

    offset: int
    """Index of its first placeholder token."""
    grid: tuple[int, int, int]
    """(t, h, w) of its patches (before merging)."""


@dataclass(frozen=True)
class MRopePositions:
    """One request's positions: the prompt's three rows, and the shift of later tokens."""

    prompt: torch.Tensor
    """[3, num_prompt_tokens] int64."""
    delta: int
    """A token at index i past the prompt has position i + delta on every row."""

    def between(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] int64: the positions of tokens [start, end)."""
        num_prompt = self.prompt.shape[1]
        if end <= num_prompt:
            return self.prompt[:, start:end]
        later = torch.arange(max(start, num_prompt), end, dtype=torch.int64) + self.delta
        later = later.expand(3, -1)
        if start >= num_prompt:
            return later
        return torch.cat([self.prompt[:, start:], later], dim=1)


def mrope_positions(
    num_tokens: int, images: Sequence[ImagePlacement], merge: int
) -> MRopePositions:
    """The positions of a prompt of `num_tokens` tokens whose images lie at `images` (in prompt
    order, not overlapping)."""
    rows: list[torch.Tensor] = []
    index = position = 0
    for image in sorted(images, key=lambda i: i.offset):
        t, h, w = image.grid[0], image.grid[1] // merge, image.grid[2] // merge
        if image.offset < index or image.offset + t * h * w > num_tokens:
            raise ValueError(
                f"image placeholder at {image.offset} ({t * h * w} tokens) overlaps another or "
                f"runs past the prompt's {num_tokens} tokens"
            )
        text = image.offset - index
        rows.append(torch.arange(text, dtype=torch.int64).expand(3, -1) + position)
        position += text
        grid = torch.stack(
            torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        )
        rows.append(grid.reshape(3, -1) + position)
        position += max(h, w)
        index = image.offset + t * h * w
    rows.append(torch.arange(num_tokens - index, dtype=torch.int64).expand(3, -1) + position)
    prompt = torch.cat(rows, dim=1)
    top = int(prompt.max()) + 1 if num_tokens else 0
    return MRopePositions(prompt, top - num_tokens)


class MRotaryEmbedding(nn.Module):
    """RoPE over three position rows (the sections above); one row ([T] positions) is plain
    RoPE. Default RoPE frequencies only (transformers' Qwen2-VL rotary)."""

    def __init__(self, head_size: int, config: Any) -> None:
        super().__init__()
        params = rope_parameters(config)
        section = [int(s) for s in params.get("mrope_section") or ()]
        if sum(section) != head_size // 2:
            raise ValueError(f"mrope_section {section} must sum to head_dim / 2 = {head_size // 2}")
        self.rope = RotaryEmbedding(head_size, config)
        # The row each frequency takes: section s (of the pairs in order) → row s % 3.
        rows = [s % 3 for s, n in enumerate(section) for _ in range(n)]
        self.register_buffer("freq_row", torch.tensor(rows, dtype=torch.int64), persistent=False)
        self._rows = rows

    def process_weights_after_loading(self) -> None:
        self.freq_row = torch.tensor(self._rows, dtype=torch.int64, device=self.freq_row.device)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] (or [T]) → cos, sin [T, 1, head_size // 2]."""
        if positions.dim() == 1:
            return self.rope.cos_sin(positions, dtype)
        # angle[t, j] = positions[row(j), t] * inv_freq[j]
        angles = positions.t().float().index_select(1, self.freq_row) * self.rope.inv_freq.float()
        return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]
