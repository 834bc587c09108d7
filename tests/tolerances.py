"""Float32 tolerances for comparing tidepool with a reference, derived from rounding error.

Every test that compares two float32 computations of the same function (tidepool vs transformers /
sentence-transformers / FlagEmbedding, or two tidepool paths that block their loops differently)
takes its tolerance from here, so a tolerance never gets tuned to the CPU it was first run on.

Derivation
----------
Unit roundoff. Float32 rounds to nearest with a 24-bit significand: u = 2**-24 ~ 5.96e-8. Each
operation returns the exact result times (1 + d) with |d| <= u (an FMA rounds once, so it only
helps).

One reduction. A dot product or sum of n terms computed in any order has (Higham, "Accuracy and
Stability of Numerical Algorithms", 2nd ed., section 3.1)

    |fl(x . y) - x . y| <= gamma_n * sum |x_i y_i|,  gamma_n = n u / (1 - n u)   (worst case).

The rounding errors are (close to) independent and mean-zero, so the error grows like a random
walk: Higham & Mary ("A New Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci.
Comput. 41, 2019) prove |error| <= lambda * sqrt(n) * u * sum |x_i y_i| with probability at least
1 - 2 exp(-lambda**2 / 2). The bound is relative to sum |x_i y_i|, the *magnitude* of the terms,
not to the result (a sum that cancels to ~0 still carries the error of its terms), hence a
tolerance relative to the magnitude of the compared tensor (its largest |value|), never a
per-element relative one. Blocked GEMMs (oneDNN, MKL, AVX2 vs AVX-512 vs AMX tile shapes), SDPA's
blocked softmax and tree reductions only reorder these sums: same bound, different rounding.

Depth. A transformer layer chains about eight reductions (Q/K/V projection, Q.K^T, the softmax
sum, P.V, the output projection, LayerNorm's mean and variance, FFN up, FFN down). Each one's
relative error reaches the output with a gain of about one (residual adds, LayerNorm rescales,
GELU and softmax are 1-Lipschitz), so errors add, layer after layer: linear in depth.

The bound. For two float32 implementations of a network of `depth` layers (count the embedding /
head as one more) whose longest reduction has length n = max(hidden, intermediate, sequence):

    rtol = SAFETY * depth * sqrt(n) * u,   SAFETY = 2 * 8 * 6 = 96

* 2: both sides round, and their errors add;
* 8: the reductions per layer, added linearly (worst case, no cancellation between them);
* 6: lambda. Gaussian-like tails: P(|Z| > 6) ~ 2e-9 per element, so even the largest of 10**6
  compared elements stays inside; Higham & Mary's bound at lambda = 6 is itself loose (it charges
  every term its full magnitude).

`worst_case=True` uses n instead of sqrt(n) and drops lambda (SAFETY 2 * 8 = 16): the
deterministic bound, for a check that must never fail, at the price of a looser tolerance.

Scale. For a tiny model (hidden 32, intermediate 64, 2 layers + head: depth 3, n = 128) rtol is
96 * 3 * 11.3 * u ~ 1.9e-4 of the magnitude; measured differences on such models are 2-10 u per
layer (1e-7 to 1e-6). A real bug (a wrong row, position, mask or sequence) moves outputs by 1e-2 or
more, so the bound stays far below what it has to catch; each test keeps a guard that proves it.

Norms and cosines. A norm-wise relative error e = ||a - b|| / ||b|| obeys the same bound, and the
cosine of a and b is then at least 1 - e**2 / 2 (the error's part orthogonal to b is at most e).

Assumed: true float32 arithmetic. TF32 / bfloat16 down-conversion inside a float32 matmul (a
backend flag) is a different precision and needs its own u.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

UNIT_ROUNDOFF = 2.0**-24  # float32, round to nearest
REDUCTIONS_PER_LAYER = 8
TAIL_LAMBDA = 6
SAFETY = 2 * REDUCTIONS_PER_LAYER * TAIL_LAMBDA  # 96
SAFETY_WORST_CASE = 2 * REDUCTIONS_PER_LAYER  # 16


def float32_rtol(depth: int, reduction: int, *, worst_case: bool = False) -> float:
    """Tolerance relative to the magnitude, for `depth` chained layers whose longest reduction
    (dot product / sum) has `reduction` terms. See the module docstring for the derivation."""
    if depth < 1 or reduction < 1:
        raise ValueError(f"depth and reduction must be >= 1, got {depth}, {reduction}")
    if worst_case:
        return SAFETY_WORST_CASE * depth * reduction * UNIT_ROUNDOFF
    return SAFETY * depth * math.sqrt(reduction) * UNIT_ROUNDOFF


def float32_cosine_floor(depth: int, reduction: int, *, worst_case: bool = False) -> float:
    """The least cosine two float32 computations of the same vector can have: 1 - rtol**2 / 2."""
    rtol = float32_rtol(depth, reduction, worst_case=worst_case)
    return 1.0 - rtol * rtol / 2.0


def _as_tensor(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64)
    return torch.as_tensor(x, dtype=torch.float64)


def magnitude(expected, dim: int | None = None) -> torch.Tensor:
    """The scale errors are relative to: max |expected| over the tensor, or along `dim`."""
    e = _as_tensor(expected).abs()
    if e.numel() == 0:
        return torch.zeros(())
    if dim is None:
        return e.max()
    return e.amax(dim=dim, keepdim=True)


def assert_close(
    actual,
    expected,
    *,
    depth: int,
    reduction: int,
    scale: float | None = None,
    dim: int | None = None,
    worst_case: bool = False,
    msg: str = "",
) -> float:
    """|actual - expected| <= rtol * magnitude, elementwise; returns the largest ratio of the
    difference to the allowed one (<= 1 passes) so a test can report it.

    The magnitude is `scale` if given, else max |expected| over the tensor, or along `dim` (e.g.
    `dim=-1` for rows of different norms). Shapes must match exactly."""
    a, e = _as_tensor(actual), _as_tensor(expected)
    assert a.shape == e.shape, f"{msg} shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{msg} non-finite values in actual"
    rtol = float32_rtol(depth, reduction, worst_case=worst_case)
    mag = torch.as_tensor(scale, dtype=torch.float64) if scale is not None else magnitude(e, dim)
    allowed = rtol * mag.clamp_min(torch.finfo(torch.float32).tiny)
    diff = (a - e).abs()
    ratio = float((diff / allowed).max()) if diff.numel() else 0.0
    assert ratio <= 1.0, (
        f"{msg} max abs diff {float(diff.max()):.3e} exceeds float32 bound: rtol {rtol:.2e} "
        f"(depth {depth}, reduction {reduction}) x magnitude {float(mag.max()):.3e} "
        f"(ratio {ratio:.2f})"
    )
    return ratio


def assert_cosine_close(
    actual, expected, *, depth: int, reduction: int, worst_case: bool = False, msg: str = ""
) -> float:
    """Row-wise cosine of actual vs expected ([n, dim] or [dim]) >= float32_cosine_floor; returns
    the worst cosine."""
    a = _as_tensor(actual).reshape(-1, _as_tensor(actual).shape[-1])
    e = _as_tensor(expected).reshape(-1, _as_tensor(expected).shape[-1])
    assert a.shape == e.shape, f"{msg} shape {tuple(a.shape)} != {tuple(e.shape)}"
    cos = torch.nn.functional.cosine_similarity(a, e, dim=-1)
    floor = float32_cosine_floor(depth, reduction, worst_case=worst_case)
    worst = float(cos.min())
    assert worst >= floor, f"{msg} worst cosine {worst:.12f} < float32 floor {floor:.12f}"
    return worst


def approx(
    expected: float | Sequence[float] | dict,
    *,
    depth: int,
    reduction: int,
    scale: float | None = None,
    worst_case: bool = False,
):
    """pytest.approx with the float32 bound as its absolute tolerance: rtol * magnitude, the
    magnitude being `scale` or max |expected| (over a sequence's or dict's values)."""
    values = list(expected.values()) if isinstance(expected, dict) else expected
    mag = float(magnitude(values)) if scale is None else scale
    tol = float32_rtol(depth, reduction, worst_case=worst_case) * mag
    return pytest.approx(expected, rel=0, abs=max(tol, torch.finfo(torch.float32).tiny))
