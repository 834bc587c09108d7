"""Choosing a linear's int8 weights: one symmetric scale per output channel, and the int8 values.

Round to nearest (`round_to_nearest`) quantizes each weight alone. GPTQ (`gptq`, Frantar et al.
2022) keeps the same grid but rounds the input columns one at a time and spreads each column's
rounding error over the columns not yet rounded, weighted by the calibration inputs' second
moments H = Xᵀ X: it minimises ‖X Wᵀ - X Qᵀ‖² (the layer's output error on inputs like the
sample), not ‖W - Q‖². Worked example, two inputs that always move together (x₁ = x₂): rounding
w₁ up by e is undone by rounding w₂ down by e, so the output is exact where round to nearest
would have doubled the error.

Two-part weights (`split_weight`) keep a second int8 tensor of the first one's rounding error,
at 1/WEIGHT_LO_FACTOR of its step: W ≈ s·(hi + lo/254), ~15 bits per weight for two int8 GEMMs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# A two-part weight's low part counts in steps of s / WEIGHT_LO_FACTOR (254 maps the high part's
# rounding error, within ±s/2, onto int8's ±127): defined with the layer that computes with it.
from tidepool.quantization.int8_linear import WEIGHT_LO_FACTOR

# A channel of zeros gets this scale instead of 0 (its int8 values are 0 either way).
_MIN_SCALE = 1e-12
# Columns are rounded in blocks: the error of a block reaches the later columns in one GEMM.
_GPTQ_BLOCK = 128
CLIP_RATIOS = tuple(1.0 - 0.02 * i for i in range(16))
"""The clipping search's candidates, times a channel's abs-max (1.0 first: no clipping)."""


def channel_scales(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] → [N]: each output channel's abs-max to 127."""
    return weight.abs().amax(dim=1).clamp_(min=_MIN_SCALE) / 127.0


def clipped_channel_scales(weight: torch.Tensor, importance: torch.Tensor) -> torch.Tensor:
    """weight [N, K], importance [K] (diag Xᵀ X) → [N]: each channel's scale among abs-max ·
    CLIP_RATIOS / 127, the one with the least importance-weighted rounding error
    Σ_k importance_k · (w_nk - s · round(w_nk / s))² (clipping the largest weights buys a finer
    step for all the others)."""
    amax = weight.abs().amax(dim=1).clamp_(min=_MIN_SCALE)
    best_scale, best_error = amax / 127.0, None
    for ratio in CLIP_RATIOS:
        scale = amax * (ratio / 127.0)
        rounded = torch.round(weight / scale[:, None]).clamp_(-127, 127) * scale[:, None]
        error = ((weight - rounded).square() * importance).sum(dim=1)
        if best_error is None:
            best_error = error
            continue
        better = error < best_error
        best_scale = torch.where(better, scale, best_scale)
        best_error = torch.where(better, error, best_error)
    return best_scale


def round_to_nearest(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] → (int8 [N, K], scale [N] float32), each value rounded alone."""
    w = weight.detach().float()
    scale = channel_scales(w)
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def split_weight(
    weight: torch.Tensor, hi: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] → (hi int8 [N, K], lo int8 [N, K], scale [N] float32) with
    W ≈ scale_n · (hi + lo / WEIGHT_LO_FACTOR): hi = round(W / s) (s = each channel's abs-max
    / 127, `round_to_nearest`), lo = round((W / s - hi) · 254) clamped to [-127, 127].

    With hi rounded to nearest, |W / s - hi| <= 1/2, so lo never clamps and
    |W - s·(hi + lo/254)| <= s / (2·254) (+ float32 rounding): 254x finer than hi alone. A given
    `hi` (and its `scale`: e.g. GPTQ's) is kept and lo holds what is left of its error, clamped
    where that exceeds ±1/2 step."""
    w = weight.detach().float()
    if scale is None:
        scale = channel_scales(w)
    units = w / scale[:, None]
    high = torch.round(units).clamp_(-127, 127) if hi is None else hi.float()
    low = torch.round((units - high) * WEIGHT_LO_FACTOR).clamp_(-127, 127)
    return high.to(torch.int8), low.to(torch.int8), scale


def input_second_moments(x: torch.Tensor) -> torch.Tensor:
    """Inputs [T, K] → Xᵀ X [K, K] in float64 (summed over batches, it stays exact enough)."""
    x = x.detach().reshape(-1, x.shape[-1]).double()
    return x.T @ x


def gptq(
    weight: torch.Tensor, hessian: torch.Tensor, damping: float = 0.01, clip: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K], hessian Xᵀ X [K, K] of the calibration inputs → (int8 [N, K], scale [N]):
    round-to-nearest's per-channel scales, values chosen by GPTQ.

    `damping` (times the mean diagonal, added to it) keeps H invertible when the sample has
    fewer tokens than K and bounds how far one column's error is pushed onto the others.
    Columns are visited largest H_kk first (the inputs that carry the most energy get rounded
    while the most columns are left to absorb their error)."""
    return _gptq(weight.detach().float(), hessian.float(), damping, clip)


def _gptq(
    weight: torch.Tensor, hessian: torch.Tensor, damping: float, clip: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    scale = clipped_channel_scales(weight, hessian.diagonal()) if clip else channel_scales(weight)
    h = hessian.clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    order = torch.argsort(h.diagonal(), descending=True)
    h = h[order][:, order]
    h.diagonal().add_(damping * h.diagonal().mean())
    # Upper Cholesky factor of H⁻¹: row k holds how column k's error spreads to the later ones.
    h_inv = upper_cholesky_of_inverse(h)
    # wt [K, N]: input column k of the weight is row k here, contiguous for the row updates.
    wt = weight.T[order].contiguous()
    wt[dead[order]] = 0.0
    qt = torch.empty_like(wt)
    for start in range(0, wt.shape[0], _GPTQ_BLOCK):
        end = min(start + _GPTQ_BLOCK, wt.shape[0])
        with _one_thread():  # the factorizations and the GEMM between blocks keep every thread
            errors = _gptq_block(wt[start:end], qt[start:end], scale, h_inv[start:end, start:end])
        wt[end:] -= h_inv[start:end, end:].T @ errors
    q = torch.empty_like(qt)
    q[order] = qt
    return q.T.contiguous().to(torch.int8), scale


def upper_cholesky_of_inverse(h: torch.Tensor) -> torch.Tensor:
    """U upper triangular with H⁻¹ = Uᵀ U, from one Cholesky and one triangular inverse (not
    cholesky → cholesky_inverse → cholesky: half the time at K = 3,072): with J the reversal,
    J H J = M Mᵀ (M lower), so H = R Rᵀ with R = J M J upper, and U = R⁻¹ = J M⁻¹ J."""
    m = torch.linalg.cholesky(h.flip(0, 1))
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    return torch.linalg.solve_triangular(m, eye, upper=False).flip(0, 1)


def _gptq_block(
    block: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, h_inv: torch.Tensor
) -> torch.Tensor:
    """Round the rows (input columns) of `block` [B, N] into `q` (integer values), each row's
    error pushed onto the block's later rows by `h_inv` [B, B]; returns the scaled errors
    [B, N] for the rows after the block."""
    errors = torch.empty_like(block)
    for i in range(block.shape[0]):
        rounded = torch.round(block[i] / scale).clamp_(-127, 127)
        q[i] = rounded
        errors[i] = (block[i] - rounded * scale) / h_inv[i, i]
        block[i + 1 :] -= h_inv[i, i + 1 :, None] * errors[i][None, :]
    return errors


@contextmanager
def _one_thread() -> Iterator[None]:
    """GPTQ's loop is thousands of small ops: on one thread each is far faster than on two
    (two threads wait on each other whenever the machine is busy; docs/performance.md, 'Choices elsewhere in the code')."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
