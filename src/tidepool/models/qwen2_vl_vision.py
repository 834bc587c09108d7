"""Qwen2-VL's vision tower, packed: the patches of every image of a step in one pass.

    pixel_values [num_patches, C * T * P * P]   (Qwen2VLImageProcessor's rows; T temporal copies)
      → patch_embed (the Conv3d with stride = kernel, as one linear)
      → depth x [LayerNorm → attention with 2D RoPE (+ residual) → LayerNorm → MLP (+ residual)]
      → merger: LayerNorm, each 2 x 2 block of neighbouring patches concatenated, MLP
      → [num_patches / merge², text hidden]   (one row per image placeholder token)

Attention is bidirectional inside each image (each frame: one sequence of h * w patches, as
transformers' `cu_seqlens`), through the encoder backend registry (the CPU kernel where the head
width fits, else bucketed SDPA). The patches arrive in the processor's order, which already
groups each merge block's patches together, so the merger's view is a plain reshape; the rotary
positions (row, column of each patch) follow that order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from tidepool.attention.backend import (
    BUCKETED_SDPA,
    AttentionSpec,
    EncoderAttentionBackend,
    select_encoder_backend,
    with_reduced_precision,
)
from tidepool.attention.common import AttentionMetadataBuilder, encoder_step
from tidepool.attention.layer import Attention
from tidepool.models.layers.linear import Linear
from tidepool.models.layers.rotary import apply_rotary

Grid = tuple[int, int, int]
"""(t, h, w): an image's grid of patches (image_grid_thw's row): t frames of h x w patches."""

DEFAULT_MAX_PATCHES = 16384
"""The most patches of one image the backend is chosen for, when the config names no bound
(Qwen2-VL's processor allows up to max_pixels / patch²; a backend with a shorter limit is then
not chosen)."""


def vision_positions(grids: Sequence[Grid], merge: int) -> torch.Tensor:
    """[num_patches, 2] int64 (row, column) of each patch, in the processor's order: frame by
    frame, merge x merge blocks in row-major order, row-major inside a block."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        # [h/m, m, w/m, m] → [h/m, w/m, m, m]: block-major
        hw = torch.stack(
            [rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)], dim=-1
        )
        out.append(hw.repeat(t, 1))
    return torch.cat(out)


class VisionRotary(nn.Module):
    """2D RoPE: the first half of the rotated pairs turn with the patch's row, the second half
    with its column (the same frequencies for both: head_dim / 4 of them)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        dim = self.head_dim // 2
        return 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def process_weights_after_loading(self) -> None:
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    def cos_sin(self, hw: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """hw [N, 2] → cos, sin [N, 1, head_dim / 2] (computed in float32)."""
        angles = (hw.float()[:, :, None] * self.inv_freq.float()).flatten(1)
        return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = Linear(dim, 3 * dim)
        self.proj = Linear(dim, dim)
        self.attn = Attention(BUCKETED_SDPA)

    def forward(self, x, residual, cos_sin, meta) -> torch.Tensor:
        n, heads, d = x.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv(x).view(n, 3, heads, d)
        cos, sin = cos_sin
        # q and k side by side: one rotary pass, written back into qkv.
        qk = apply_rotary(qkv[:, :2].reshape(n, 2 * heads, d), cos, sin)
        qkv[:, :2] = qk.view(n, 2, heads, d)
        out = self.attn.backend.attend(qkv, meta, self.scale)
        return self.proj(out, residual=residual)


class VisionBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = config.embed_dim
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, config.num_heads)
        hidden = int(dim * config.mlp_ratio)
        self.mlp = nn.Module()
        self.mlp.fc1 = Linear(dim, hidden, activation=config.hidden_act)
        self.mlp.fc2 = Linear(hidden, dim)

    def forward(self, x, cos_sin, meta) -> torch.Tensor:
        x = self.attn(self.norm1(x), x, cos_sin, meta)
        return self.mlp.fc2(self.mlp.fc1(self.norm2(x)), residual=x)


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.merged_dim = dim * merge * merge
        self.ln_q = nn.LayerNorm(dim, eps=1e-6)
        # Named as the checkpoint's nn.Sequential: mlp.0 (GELU after it), mlp.2.
        self.mlp = nn.ModuleDict(
            {
                "0": Linear(self.merged_dim, self.merged_dim, activation="gelu"),
                "2": Linear(self.merged_dim, out_dim),
            }
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x).view(-1, self.merged_dim)
        return self.mlp["2"](self.mlp["0"](x))


class Qwen2VisionTransformer(nn.Module):
    """`visual.*` of a Qwen2-VL checkpoint: pixel rows of several images → their placeholder
    tokens' embeddings. Its own encoder backend (set_encoder_backend; chosen by the model that
    holds it, apart from that model's decoder backend)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.merge = int(config.spatial_merge_size)
        self.patch_dim = (
            config.in_channels * config.temporal_patch_size * config.patch_size * config.patch_size
        )
        self.patch_embed = nn.Module()
        self.patch_embed.proj = Linear(self.patch_dim, config.embed_dim, bias=False)
        head_dim = config.embed_dim // config.num_heads
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        self.rotary = VisionRotary(head_dim, theta)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config.hidden_size, config.embed_dim, self.merge)
        self.encoder_backend: EncoderAttentionBackend = BUCKETED_SDPA
        self._builder: tuple[EncoderAttentionBackend, AttentionMetadataBuilder[Any]] | None = None

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        max_patches = int(getattr(self.config, "max_num_patches", 0) or DEFAULT_MAX_PATCHES)
        return AttentionSpec(
            device, dtype, self.config.embed_dim // self.config.num_heads, max_patches
        )

    def select_encoder_backend(self, device: torch.device, dtype: torch.dtype) -> None:
        """The registry's choice for this tower (the loader's half: device and dtype final)."""
        spec = self.attention_spec(device, dtype)
        if dtype == torch.bfloat16:
            spec = with_reduced_precision(spec)
        self.set_encoder_backend(select_encoder_backend(spec))

    def set_encoder_backend(self, backend: EncoderAttentionBackend) -> None:
        self.encoder_backend = backend
        for block in self.blocks:
            block.attn.attn.backend = backend

    def num_tokens(self, grid: Grid) -> int:
        """Placeholder tokens of an image of this grid."""
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """pixel_values [sum t*h*w, patch_dim] of the images of `grids`, in order → [sum of
        num_tokens(grid), hidden]: each image's rows, in order."""
        weight = self.patch_embed.proj.weight
        x = self.patch_embed.proj(pixel_values.to(weight.dtype))
        seq_lens = [h * w for t, h, w in grids for _ in range(t)]
        backend = self.encoder_backend
        if self._builder is None or self._builder[0] is not backend:
            self._builder = (backend, backend.metadata_builder())
        meta = self._builder[1].build(
            encoder_step(seq_lens, x.device, x.dtype, self.config.num_heads)
        )
        hw = vision_positions(grids, self.merge).to(x.device)
        cos, sin = self.rotary.cos_sin(hw, x.dtype)
        # The blocks run on the rows the backend's builder chose (packed, or padded buckets).
        rows = meta.rows
        x, cos_sin = rows.gather(x), (rows.gather(cos), rows.gather(sin))
        for block in self.blocks:
            x = block(x, cos_sin, meta)
        return self.merger(rows.to_tokens(x))

    def adapt_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The checkpoint's Conv3d kernel [E, C, T, P, P] → our linear's [E, C*T*P*P]."""
        if name.endswith("patch_embed.proj.weight") and tensor.dim() == 5:
            return tensor.reshape(tensor.shape[0], -1)
        return tensor


def vision_weights(
    tower: Qwen2VisionTransformer, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterable[tuple[str, torch.Tensor]]:
    """`weights` with the tower's patch kernel reshaped for its linear."""
    for name, tensor in weights:
        yield name, tower.adapt_weight(name, tensor)
