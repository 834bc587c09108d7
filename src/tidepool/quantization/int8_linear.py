"""The int8 linear layer: int8 weights (one scale per output channel, packed for oneDNN once) and
int8 activations (one scale per token, chosen at run time), int32 accumulation.

    x [T, K] float32 ─ per-token abs-max ─▶ q [T, K] int8, s [T, 1]   (s = max_k |x_tk| / 127)
    acc = q @ Wq.T                          int32, exact: |acc| <= K · 127² < 2³¹ for K < 133,000
    y = s · (acc · w_scale) + b  → activation, + residual / · multiply   (float32)

The GEMM is oneDNN's int8 matmul (`torch.ops.onednn.qlinear_pointwise`, VNNI / AMX-int8), which
applies `w_scale` as it writes float32. Its activation scale must be one number per tensor, so
the per-token scale, the bias, the activation, the residual (and a post-LN encoder's LayerNorm,
`forward_norm`) run after it, in one pass of tidepool's kernel (int8_ops.py); the quantizer is one
pass too. Where the kernels cannot be built the same formulas run as torch ops. Where tidepool's
own GEMM takes the shape (AMX tiles, csrc/cpu_int8_gemm.cpp; else VNNI registers, AVX-512 or
AVX-VNNI, csrc/cpu_int8_vnni.cpp), the epilogue runs inside its blocked loop instead.

An input may be quantized asymmetrically instead (`asym`: uint8, each token's [min, max] onto
[0, 255], x ≈ s·(q - z)): the GEMM runs u8 x s8 and the epilogue subtracts s·z · w_scale·Σ_k Wq,
which gives skewed inputs (a GELU's output) twice the resolution.

Per-token scales keep each row's result independent of the other rows in the batch; and the
integer accumulation is exact, so a text's vector does not depend on its neighbours at all.

Where the CPU has no VNNI (AVX2-only CPUs, AVX-512 without VNNI), oneDNN multiplies u8 · s8
with `vpmaddubsw`, which adds two products into a saturating int16: 2 · 255 · 127 > 2¹⁵ - 1, so
8-bit inputs give wrong sums (measured on an AMD EPYC with AVX2 only: errors of 10⁵ in sums of
4·10⁵; an int8 input is no better, oneDNN shifts it to u8 by 128). `onednn_int8_saturates()`
probes oneDNN once with the worst case; where it saturates, the layer splits each uint8 input
q = 2·h + l (h = q >> 1 in 0..127, l = q & 1) and runs two GEMMs that oneDNN sums exactly
(2 · 127 · 127 < 2¹⁵): acc = 2·(h·Wᵀ) + l·Wᵀ, the same integers as one GEMM on a VNNI CPU.
Symmetric inputs go in as q + 128 with the zero point 128. The numbers are then those of every
other CPU (up to float32 rounding of the two partial sums); the cost is a second GEMM.

Error bound (worst case, per output element; what tests/unit/test_int8_linear.py checks): with
x = s_x·q + e, |e| <= s_x/2 and w = s_w·p + d, |d| <= s_w/2,

    |y - y_ref| <= (s_w/2)·‖x_t‖₁ + (s_x/2)·‖w_n‖₁ + K·s_x·s_w/4        (+ float32 rounding)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from tidepool import envs
from tidepool.models.layers.activation import get_activation
from tidepool.models.layers.linear import Linear, combine
from tidepool.quantization import int8_ops

WEIGHT_LO_FACTOR = 254
"""Two-part weights: W ≈ w_scale · (weight_q + weight_lo / this) (|weight_lo| <= 127 holds the
remainder of round(W / w_scale), at most 1/2, in steps of 1/254)."""
# oneDNN's packing takes a hint of the typical number of rows; a step holds thousands of tokens.
_PACK_BATCH_HINT = 4096
# The GEMM runs on blocks of rows whose float32 output is about this size (see _fused).
_BLOCK_BYTES = 4 << 20
# A row of zeros gets this scale instead of 0 (its int8 values are 0 either way).
_MIN_SCALE = 1e-12
# 1.5 · 2²³ (bits 0x4B400000): adding it to a float32 v (|v| < 2²²) rounds v to an integer, held
# in the low mantissa bits (two's complement in the low byte for |v| <= 127).
_ROUNDING_SHIFT = torch.tensor(12582912.0)


def int8_gemm_available() -> bool:
    """This torch has oneDNN's int8 linear (x86 CPUs)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


@functools.cache
def onednn_int8_saturates() -> bool:
    """Whether oneDNN's int8 GEMM saturates on 8-bit inputs on this CPU (no VNNI), probed once
    with the worst case: every input 255, every weight ±127. Raises where even 7-bit inputs
    (the split form's halves) come out wrong: int8 cannot run correctly here at all."""
    if not int8_gemm_available():
        return False
    k, n = 64, 16
    weight = torch.full((n, k), 127, dtype=torch.int8)
    weight[1::2] = -127
    packed = torch.ops.onednn.qlinear_prepack(weight, [2, k])

    def exact(level: int) -> bool:
        q = torch.full((2, k), level, dtype=torch.uint8)
        got = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, 0, packed, torch.ones(n), torch.zeros(n, dtype=torch.int64),
            None, 1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip
        return torch.equal(got, (q.int() @ weight.int().T).float())

    if exact(255):
        return False
    if not exact(127):
        raise RuntimeError("oneDNN's int8 GEMM gives wrong sums on this CPU even on 7-bit inputs")
    return True


def quantize_per_token(
    x: torch.Tensor, smoothing: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] float32 (times `smoothing` [K] when given) → (q [T, K] int8, scale [T, 1]
    float32): symmetric, each row's abs-max to 127, rounded to nearest even.

    Three passes over x (four with smoothing): the row max (`vector_norm(inf)`: no |x| copy),
    then x · 127/max + 1.5·2²³ in one `addcmul`, whose float32 result holds the rounded integer
    in its low mantissa bits (for |v| < 2²²), so viewing the bits as int32 and casting keeps v:
    no separate round pass (ties may round differently from torch.round: one rounding of the
    exact product instead of two). Faster than the round-and-cast form (docs/performance.md, 'Choices elsewhere in the code')."""
    if smoothing is not None:
        x = x * smoothing
    amax = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True).clamp_(min=_MIN_SCALE)
    shifted = torch.addcmul(_ROUNDING_SHIFT, x, 127.0 / amax)
    # The cast to int8 keeps the low byte (torch truncates, it does not saturate: tested), and
    # the shift's low byte is 0, so no subtraction pass either.
    q = shifted.view(torch.int32).to(torch.int8)
    return q, amax.mul_(1.0 / 127.0)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] → (int8 [N, K], scale [N] float32): one symmetric scale per output channel."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_(min=_MIN_SCALE) / 127.0
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def quantize_per_token_asym(
    x: torch.Tensor, smoothing: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K] float32 (times `smoothing`) → (q [T, K] uint8, scale [T, 1], scale · zero point
    [T, 1]): asymmetric, each row's [min, max] to [0, 255] (x ≈ scale · q - scale · z). The torch
    form of the kernel's asymmetric quantizer (same formula, same rounding)."""
    if smoothing is not None:
        x = x * smoothing
    low, high = torch.aminmax(x, dim=1, keepdim=True)
    scale = (high - low).clamp_(min=_MIN_SCALE) / 255.0
    zero = torch.round(-low / scale)
    q = torch.round(x * (1.0 / scale)).add_(zero).clamp_(0, 255).to(torch.uint8)
    return q, scale, scale * zero


class Int8Linear(nn.Module):
    """A drop-in for `Linear` (same forward: activation, `residual`, `multiply`; `forward_norm`)
    computing the GEMM in int8. Built from a loaded float32 `Linear` by `from_linear`. `asym`:
    the input is quantized asymmetrically to uint8 (one zero point per token: for skewed inputs
    such as a GELU's output), else symmetrically to int8."""

    def __init__(
        self,
        weight_q: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        activation: str | None,
        input_smoothing: torch.Tensor | None = None,
        asym: bool = False,
        weight_lo: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_q.shape
        self.activation = activation
        self._ops = int8_ops.load()
        self._act_code = int8_ops.ACTIVATION_CODES.get(activation)
        self._amx = self._vnni = None
        if self._ops is not None and self._act_code is not None:
            self._amx = _amx_for(self.out_features, self.in_features)
            if self._amx is None:
                self._vnni = _vnni_for(self.out_features, self.in_features)
        self.split_input = self._amx is None and self._vnni is None and onednn_int8_saturates()
        """Each uint8 input runs as two 7-bit GEMMs (2·h + l), with the torch epilogue, where
        oneDNN saturates on 8-bit inputs (a CPU without VNNI): see the module docstring."""
        if self.split_input:
            self._ops = None
        self.asym = asym
        self._zero_point = asym or self.split_input
        """The input carries a zero point: asymmetric, or symmetric shifted by 128 to uint8."""
        self._act = None
        if activation:
            self._act = _INPLACE_ACTIVATIONS.get(activation, get_activation(activation))
        self.register_buffer("weight_scale", weight_scale.contiguous(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.register_buffer(
            "input_smoothing",
            None if input_smoothing is None else input_smoothing.float().contiguous(),
            persistent=False,
        )
        """[K]: inputs are multiplied by it before quantizing (1 / the SmoothQuant factor)."""
        self.two_part = weight_lo is not None
        """W ≈ w_scale · (weight_q + weight_lo / WEIGHT_LO_FACTOR): ~15-bit weights."""
        # The zero-point correction: scale_n · Σ_k W_nk (exact integer sums, then scaled).
        wsum = None
        if self._zero_point:
            wsum = weight_q.sum(dim=1, dtype=torch.int64).double()
            if weight_lo is not None:
                wsum += weight_lo.sum(dim=1, dtype=torch.int64).double() / WEIGHT_LO_FACTOR
            wsum = weight_scale * wsum.float()
        self.register_buffer("weight_sum", wsum, persistent=False)
        self._block_rows = max(256, _BLOCK_BYTES // (4 * self.out_features) // 64 * 64)
        self._tiles = self._tiles_lo = None
        self._packed = self._packed_lo = None
        self._own_weights: tuple[torch.Tensor | None, ...] = ()
        if self._amx is not None:
            self._tiles = int8_ops.pack_weight(weight_q)
            self._tiles_lo = None if weight_lo is None else int8_ops.pack_weight(weight_lo)
            self._own_weights = (self._tiles, self._tiles_lo)
        elif self._vnni is not None:  # (packed, packed_lo, 128·Σ_k W, 128·Σ_k W_lo)
            self._tiles, comp = int8_ops.pack_weight_vnni(weight_q)
            self._tiles_lo, comp_lo = (None, None)
            if weight_lo is not None:
                self._tiles_lo, comp_lo = int8_ops.pack_weight_vnni(weight_lo)
            self._own_weights = (self._tiles, self._tiles_lo, comp, comp_lo)
            self._vnni_isa = int8_ops.vnni_isa()
        else:
            self._packed = torch.ops.onednn.qlinear_prepack(
                weight_q, [_PACK_BATCH_HINT, self.in_features]
            )
            if weight_lo is not None:
                self._packed_lo = torch.ops.onednn.qlinear_prepack(
                    weight_lo, [_PACK_BATCH_HINT, self.in_features]
                )
        self._weight_zero_points = torch.zeros(self.out_features, dtype=torch.int64)

    @classmethod
    def from_linear(
        cls,
        linear: Linear,
        input_amax: torch.Tensor | None = None,
        alpha: float = 0.5,
        asym: bool = False,
    ) -> Int8Linear:
        """From a loaded `Linear`; with `input_amax` (its largest input per channel, [K], from a
        calibration pass) the inputs are smoothed: divided per channel by
        c_k = input_amax_k^alpha / max_n |W_nk|^(1 - alpha), the weight multiplied by it
        (SmoothQuant), so outlier channels no longer set every token's scale."""
        weight = linear.weight.detach().float()
        smoothing = None
        if input_amax is not None:
            w_amax = weight.abs().amax(dim=0).clamp(min=1e-5)
            c = input_amax.float().clamp(min=1e-5).pow(alpha) / w_amax.pow(1.0 - alpha)
            weight = weight * c
            smoothing = 1.0 / c
        weight_q, weight_scale = quantize_weight(weight)
        return cls(weight_q, weight_scale, linear.bias, linear.activation, smoothing, asym)

    def feed(self, consumer: Int8Linear, exclusive: bool = False) -> None:
        """This layer's output is (among others) `consumer`'s input, unchanged: quantize each
        output row for it in the epilogue, while the row is in L1, so it skips its quantizer
        pass. The model passes the tensor on as before; `consumer` takes the quantized form only
        when the tensor it is given is that very object (else it quantizes it itself).
        `exclusive`: nothing but `consumer` reads the output (a BERT layer's FFN up), so the AMX
        GEMM need not write its float32 form at all: the tensor passed on is then unwritten."""
        # Not a submodule: a plain attribute, so the module tree and state dict stay as they are.
        self.__dict__["_consumer"] = consumer
        self.__dict__["_exclusive"] = exclusive

    def _quantized_input(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q, scale, scaled_zero) for x [..., K]: the producer's handoff when x is its output."""
        handoff = self.__dict__.get("_handoff")
        if handoff is not None and handoff[0] is x:
            del self.__dict__["_handoff"]
            return handoff[1:]
        x = x.reshape(-1, self.in_features)
        if self._ops is not None and x.stride(-1) == 1:
            return int8_ops.quantize_rows(x, self.input_smoothing, self.asym)
        if self.asym:
            return quantize_per_token_asym(x, self.input_smoothing)
        q, scale = quantize_per_token(x, self.input_smoothing)
        if self.split_input:  # the same integers as uint8 with the zero point 128
            return q.to(torch.int16).add_(128).to(torch.uint8), scale, scale * 128.0
        return q, scale, torch.zeros_like(scale)

    def _gemm(self, q: torch.Tensor) -> torch.Tensor:
        """q [T, K] int8 / uint8 → acc · w_scale [T, N] float32 (the activation scale 1 and no
        bias: the per-token scale and the bias follow in the epilogue); two-part weights add
        the second GEMM's sums / WEIGHT_LO_FACTOR; split inputs add 2·(h·Wᵀ) + l·Wᵀ."""
        if self.split_input:
            low = self._gemm_exact(q.bitwise_and(1))
            return low.add_(self._gemm_exact(q.bitwise_right_shift(1)), alpha=2.0)
        return self._gemm_exact(q)

    def _gemm_exact(self, q: torch.Tensor) -> torch.Tensor:
        """One input through oneDNN (and the low weights' GEMM for two-part weights)."""
        y = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, 0, self._packed, self.weight_scale, self._weight_zero_points,
            None, 1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip
        if self._packed_lo is not None:
            lo = torch.ops.onednn.qlinear_pointwise(
                q, 1.0, 0, self._packed_lo, self.weight_scale, self._weight_zero_points,
                None, 1.0, 0, torch.float32, "none", [], "",
            )  # fmt: skip
            y = y.add_(lo, alpha=1.0 / WEIGHT_LO_FACTOR)
        return y

    def _handoff_args(self, rows: int) -> list[torch.Tensor | None]:
        """The consumer's smoothing and the tensors its quantized input is written to (all None
        without a consumer)."""
        consumer = self.__dict__.get("_consumer")
        if consumer is None:
            return [None] * 4
        q = torch.empty(rows, self.out_features, dtype=torch.uint8 if consumer.asym else torch.int8)
        return [consumer.input_smoothing, q, torch.empty(rows, 1), torch.empty(rows, 1)]

    def _fused(
        self,
        x: torch.Tensor,
        multiply: torch.Tensor | None,
        residual: torch.Tensor | None,
        norm: nn.LayerNorm | None,
    ) -> torch.Tensor:
        """GEMM + the kernel's epilogue, [T, N] float32, in blocks of `_block_rows` rows: a
        block's float32 output is still in cache when the epilogue reads it (at 4,096 rows a
        768 → 3072 GEMM alone ran at a third of its speed at 1,024, writing 48 MB)."""
        q, scale, scaled_zero = self._quantized_input(x)
        if self._own_weights:
            return self._fused_own(q, scale, scaled_zero, multiply, residual, norm)
        rows, block = q.shape[0], self._block_rows
        handoff = self._handoff_args(rows)
        sides = [t if t is None else t.reshape(-1, self.out_features) for t in (multiply, residual)]
        out = self._output(rows) if rows > block else None
        for start in range(0, rows, block):
            part = slice(start, start + block)
            y = self._gemm(q[part] if out is not None else q)
            cut = [None if t is None else t[part] for t in (scale, scaled_zero)]
            if out is not None:
                sides_part = [None if t is None else t[part] for t in sides]
                tail = [handoff[0]] + [None if t is None else t[part] for t in handoff[1:]]
                target = out[part]
            else:
                sides_part, tail, target = sides, handoff, None
            zero = cut[1] if self.asym else None
            if norm is None:
                self._ops.dequant_(
                    y, cut[0], zero, self.weight_sum, self.bias, self._act_code,
                    *sides_part, *tail, target,
                )  # fmt: skip
            else:
                self._ops.dequant_norm_(
                    y, cut[0], zero, self.weight_sum, self.bias, sides_part[1],
                    norm.weight, norm.bias, norm.eps, *tail, target,
                )  # fmt: skip
            if out is None:
                out = y
        if handoff[1] is not None:
            self.__dict__["_consumer"].__dict__["_handoff"] = (out, *handoff[1:])
        return out

    def _fused_own(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        scaled_zero: torch.Tensor,
        multiply: torch.Tensor | None,
        residual: torch.Tensor | None,
        norm: nn.LayerNorm | None,
    ) -> torch.Tensor:
        """tidepool's GEMM (AMX tiles or VNNI registers) with the epilogue (and LayerNorm,
        handoff) in its blocked loop: one call."""
        rows = q.shape[0]
        handoff = self._handoff_args(rows)
        sides = [t if t is None else t.reshape(-1, self.out_features) for t in (multiply, residual)]
        out = self._output(rows)
        write_out = handoff[1] is None or not self.__dict__.get("_exclusive", False)
        (self._amx if self._amx is not None else self._vnni).linear(
            q, *self._own_weights, self.weight_scale, scale,
            scaled_zero if self.asym else None, self.weight_sum, self.bias, self._act_code,
            *sides, None if norm is None else norm.weight, None if norm is None else norm.bias,
            1e-12 if norm is None else norm.eps, *handoff, out, write_out,
        )  # fmt: skip
        if handoff[1] is not None:
            self.__dict__["_consumer"].__dict__["_handoff"] = (out, *handoff[1:])
        return out

    def use_scratch(self, scratch: Scratch) -> None:
        """Write outputs into `scratch` (shared with layers of the same role) instead of a fresh
        tensor: for a layer whose output is dead before the next layer of its role runs (a
        BERT layer's QKV, FFN up, and the residual stream but the last layer's: quantization/chains.py).
        A fresh large tensor costs several times its write in page faults."""
        self.__dict__["_scratch"] = scratch

    def _output(self, rows: int) -> torch.Tensor:
        scratch = self.__dict__.get("_scratch")
        if scratch is None:
            return torch.empty(rows, self.out_features)
        return scratch.take(rows, self.out_features)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        multiply: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """activation(x @ W.T + b), plus `residual` or times `multiply`; x [..., K] float32."""
        lead = x.shape[:-1]
        if self._ops is not None and self._act_code is not None:
            if x.dim() != 2:  # the handoff is keyed by the very tensor passed on: keep 2-D here
                return self._fused(x, multiply, residual, None).view(*lead, self.out_features)
            return self._fused(x, multiply, residual, None)
        q, scale, scaled_zero = self._quantized_input(x)
        y = self._dequantize(self._gemm(q), scale, scaled_zero if self._zero_point else None)
        if self._act is not None:
            y = self._act(y)
        return combine(y.view(*lead, self.out_features), multiply, residual)

    def forward_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: nn.LayerNorm
    ) -> torch.Tensor:
        """norm(x @ W.T + b + residual), the dequantize, residual and LayerNorm in one pass."""
        if self._ops is None or self._act is not None or not _fusable_norm(norm, x.dim()):
            return norm(self(x, residual=residual))
        return self._fused(x, None, residual, norm)

    def _dequantize(
        self, y: torch.Tensor, scale: torch.Tensor, scaled_zero: torch.Tensor | None
    ) -> torch.Tensor:
        """The torch form of the kernel's epilogue before the activation: s · y + b - s·z · wsum."""
        if self.bias is not None:
            y = torch.addcmul(self.bias, y, scale, out=y)  # one pass: s · y + b
        else:
            y = y.mul_(scale)
        if scaled_zero is not None:
            y = y.sub_(scaled_zero * self.weight_sum)
        return y

    def extra_repr(self) -> str:
        kind = "uint8 asymmetric" if self.asym else "int8 symmetric"
        if self.split_input:
            kind = f"{kind}, split in two 7-bit GEMMs (no VNNI)"
        kernels = "native" if self._ops is not None else "torch"
        if self._own_weights:
            kernels = "amx" if self._amx is not None else f"vnni-{self._vnni_isa}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, activation={self.activation}, {kind} per-token, "
            f"{'two-part' if self.two_part else 'int8'} weights, kernels={kernels}"
        )


class Scratch:
    """One reused float32 buffer (grown to the largest step seen, never shrunk) for the outputs
    of layers that take turns: each output is dead before the next layer of the group writes."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0)

    def take(self, rows: int, cols: int) -> torch.Tensor:
        if self._buffer.numel() < rows * cols:
            self._buffer = torch.empty(rows * cols)
        return self._buffer[: rows * cols].view(rows, cols)


def _amx_for(out_features: int, in_features: int) -> object | None:
    """The AMX GEMM's ops for a layer of this shape (K % 64, N % 32), else None (oneDNN)."""
    if in_features % 64 or out_features % 32 or envs.int8_gemm() == "onednn":
        return None
    return int8_ops.load_amx()


def _vnni_for(out_features: int, in_features: int) -> object | None:
    """The VNNI GEMM's ops (the build kernels/cpu_features.py chose) for a layer of this shape
    (K % 4, N % 16) on a CPU without AMX-INT8, else None (oneDNN)."""
    if in_features % 4 or out_features % 16 or envs.int8_gemm() == "onednn":
        return None
    return int8_ops.load_vnni()


def _fusable_norm(norm: nn.Module, dims: int) -> bool:
    """A float32 LayerNorm over the last dim with weight and bias, on 2-D rows."""
    return (
        dims == 2
        and type(norm) is nn.LayerNorm
        and norm.weight is not None
        and norm.bias is not None
        and len(norm.normalized_shape) == 1
        and norm.weight.dtype == torch.float32
    )


# In-place forms of the activations that have one (saves a [T, N] allocation and a pass).
_INPLACE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": torch.ops.aten.gelu_,
    "gelu_new": partial(torch.ops.aten.gelu_, approximate="tanh"),
    "gelu_pytorch_tanh": partial(torch.ops.aten.gelu_, approximate="tanh"),
    "gelu_fast": partial(torch.ops.aten.gelu_, approximate="tanh"),
    "relu": torch.relu_,
    "tanh": torch.tanh_,
}
