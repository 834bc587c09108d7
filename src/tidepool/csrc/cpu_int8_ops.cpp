// tidepool's CPU kernels around oneDNN's int8 GEMM (quantization/int8_linear.py): the per-token
// quantization of a GEMM's input and the epilogue of its output, each one pass over its rows
// while a row sits in L1, instead of the 3-4 torch passes (and temporaries) each took.
//
//   quantize_rows:  x [T, K] float32 (· smoothing [K]) → q [T, K] int8 (symmetric: s = amax/127,
//                   q = round(x/s)) or uint8 (asymmetric: s = (max - min)/255,
//                   z = round(-min/s), q = clamp(round(x/s) + z, 0, 255)), s [T], s·z [T].
//   dequant_:       y [T, N] = act(s_t · y + b_n - (s·z)_t · wsum_n) · multiply + residual,
//                   in place on the GEMM's float32 output (oneDNN has applied the per-channel
//                   weight scale; wsum_n = w_scale_n · Σ_k Wq_nk undoes the zero point).
//   dequant_norm_:  the same with the residual, then LayerNorm over the row (post-LN encoders).
// Both may also quantize each finished row for the next int8 GEMM (its smoothing, its scheme)
// while the row is in L1: the next layer then skips its own quantizer pass.
//
// Rounding is to nearest even (the default MXCSR mode of vcvtps2dq), like torch.round. One
// source for AVX-512 and AVX2 + FMA (cpu_simd.h; the build's ISA, quantization/int8_ops.py).
// Loaded by quantization/int8_ops.py, which keeps torch ops as the fallback.

#include "cpu_int8_common.h"

namespace {

void quantize_rows(const at::Tensor& x, const c10::optional<at::Tensor>& smoothing, bool asym,
                   at::Tensor& q, at::Tensor& scale, at::Tensor& scaled_zero) {
  check_rows(x, "x");
  const int64_t T = x.size(0), K = x.size(1), row = x.stride(0);
  TORCH_CHECK(q.is_contiguous() && q.sizes() == x.sizes() &&
                  q.scalar_type() == (asym ? at::kByte : at::kChar),
              "q: contiguous ", asym ? "uint8" : "int8", " like x");
  TORCH_CHECK(scale.is_contiguous() && scale.numel() == T && scale.scalar_type() == at::kFloat &&
                  scaled_zero.is_contiguous() && scaled_zero.numel() == T &&
                  scaled_zero.scalar_type() == at::kFloat,
              "scale, scaled_zero: contiguous float32 [T]");
  const float* xp = x.data_ptr<float>();
  const float* sm = optional_ptr(smoothing, K, "smoothing");
  float* sp = scale.data_ptr<float>();
  float* zp = scaled_zero.data_ptr<float>();
  if (asym) {
    uint8_t* qp = q.data_ptr<uint8_t>();
    at::parallel_for(0, T, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        quantize_row_asym(xp + t * row, sm, K, qp + t * K, sp + t, zp + t);
    });
  } else {
    int8_t* qp = q.data_ptr<int8_t>();
    at::parallel_for(0, T, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        quantize_row_sym(xp + t * row, sm, K, qp + t * K, sp + t);
        zp[t] = 0.f;
      }
    });
  }
}

void dequant_(at::Tensor& y, const at::Tensor& scale, const c10::optional<at::Tensor>& scaled_zero,
              const c10::optional<at::Tensor>& wsum, const c10::optional<at::Tensor>& bias,
              int64_t act, const c10::optional<at::Tensor>& multiply,
              const c10::optional<at::Tensor>& residual,
              const c10::optional<at::Tensor>& next_smoothing, const c10::optional<at::Tensor>& q,
              const c10::optional<at::Tensor>& q_scale,
              const c10::optional<at::Tensor>& q_scaled_zero,
              const c10::optional<at::Tensor>& out) {
  const Epilogue e = make_epilogue(y, scale, scaled_zero, wsum, bias, act, multiply, residual);
  const Handoff h = make_handoff(y, next_smoothing, q, q_scale, q_scaled_zero);
  const int64_t T = y.size(0), N = y.size(1);
  const float* yp = y.data_ptr<float>();
  float* op = output_ptr(y, out);
  at::parallel_for(0, T, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = op + t * N;
      for (int64_t n = 0; n < N; n += kW) {
        const vmask m = tail_mask(N - n);
        vstore_masked(row + n, m, epilogue_lanes(e, yp + t * N, t, n, m));
      }
      h.row(row, t, N);
    }
  });
}

// dequant_ (no activation, no multiply) then LayerNorm of each row: two passes over an L1 row
// (the sum, then the centred sum of squares: the stable form torch's layer_norm uses too).
void dequant_norm_(at::Tensor& y, const at::Tensor& scale,
                   const c10::optional<at::Tensor>& scaled_zero,
                   const c10::optional<at::Tensor>& wsum, const c10::optional<at::Tensor>& bias,
                   const c10::optional<at::Tensor>& residual, const at::Tensor& gamma,
                   const at::Tensor& beta, double eps,
                   const c10::optional<at::Tensor>& next_smoothing,
                   const c10::optional<at::Tensor>& q, const c10::optional<at::Tensor>& q_scale,
                   const c10::optional<at::Tensor>& q_scaled_zero,
              const c10::optional<at::Tensor>& out) {
  const Epilogue e = make_epilogue(y, scale, scaled_zero, wsum, bias, kNone, c10::nullopt, residual);
  const Handoff h = make_handoff(y, next_smoothing, q, q_scale, q_scaled_zero);
  const int64_t T = y.size(0), N = y.size(1);
  const float* g = optional_ptr(gamma, N, "gamma");
  const float* b = optional_ptr(beta, N, "beta");
  const float* yp = y.data_ptr<float>();
  float* op = output_ptr(y, out);
  at::parallel_for(0, T, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = op + t * N;
      vf sum = vzero();
      for (int64_t n = 0; n < N; n += kW) {
        const vmask m = tail_mask(N - n);
        const vf v = epilogue_lanes(e, yp + t * N, t, n, m);
        vstore_masked(row + n, m, v);
        sum = vadd(sum, v);  // masked lanes are 0
      }
      layer_norm_row(row, N, vreduce_add(sum), g, b, eps);
      h.row(row, t, N);
    }
  });
}

}  // namespace

#ifndef TP_NS
#define TP_NS tidepool_int8
#endif

TORCH_LIBRARY(TP_NS, m) {
  m.def(
      "quantize_rows(Tensor x, Tensor? smoothing, bool asym, Tensor(a!) q, Tensor(b!) scale, "
      "Tensor(c!) scaled_zero) -> ()");
  m.def(
      "dequant_(Tensor(a!) y, Tensor scale, Tensor? scaled_zero, Tensor? wsum, Tensor? bias, "
      "int act, Tensor? multiply, Tensor? residual, Tensor? next_smoothing, Tensor(b!)? q, "
      "Tensor(c!)? q_scale, Tensor(d!)? q_scaled_zero, Tensor(e!)? out) -> ()");
  m.def(
      "dequant_norm_(Tensor(a!) y, Tensor scale, Tensor? scaled_zero, Tensor? wsum, Tensor? bias, "
      "Tensor? residual, Tensor gamma, Tensor beta, float eps, Tensor? next_smoothing, "
      "Tensor(b!)? q, Tensor(c!)? q_scale, Tensor(d!)? q_scaled_zero, Tensor(e!)? out) -> ()");
}

TORCH_LIBRARY_IMPL(TP_NS, CPU, m) {
  m.impl("quantize_rows", &quantize_rows);
  m.impl("dequant_", &dequant_);
  m.impl("dequant_norm_", &dequant_norm_);
}
