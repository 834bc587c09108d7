// Shared by tidepool's int8 CPU kernels (cpu_int8_ops.cpp: the quantizer and the epilogues
// around oneDNN's GEMM; cpu_int8_gemm.cpp: the AMX GEMM with the epilogue in its tile loop): the
// per-row quantizers, GELU's erf, and the epilogue's per-lane formula. Header-only, in an
// anonymous namespace: each kernel source is its own extension.
#pragma once

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <utility>

namespace {

constexpr int64_t kGrain = 8;  // rows per parallel task: a 32-token step still uses two threads
constexpr float kMinScale = 1e-12f;
enum Activation : int64_t { kNone = 0, kGelu = 1, kRelu = 2 };

inline vmask tail_mask(int64_t left) { return lanes(left); }

inline vf load(const float* p, vmask m) { return vload_masked(p, m); }

// v = x (· smoothing) for kW lanes.
inline vf smoothed(const float* x, const float* sm, int64_t k, vmask m) {
  vf v = load(x + k, m);
  return sm == nullptr ? v : vmul(v, load(sm + k, m));
}

// erf as a rational function of x (odd degree-13 numerator over an even degree-8 denominator in
// x, |x| clamped to 4): |error| < 5e-7 on float32 inputs, checked against float64 in the tests;
// 2x faster here than ATen's exp-based form.
inline vf erf_ps(vf x) {
  const vf lim = vset1(4.f);
  x = vmin(vmax(x, vsub(vzero(), lim)), lim);
  const vf x2 = vmul(x, x);
  vf p = vset1(-2.72614225801306e-10f);
  p = vfmadd(p, x2, vset1(2.77068142495902e-08f));
  p = vfmadd(p, x2, vset1(-2.10102402082508e-06f));
  p = vfmadd(p, x2, vset1(-5.69250639462346e-05f));
  p = vfmadd(p, x2, vset1(-7.34990630326855e-04f));
  p = vfmadd(p, x2, vset1(-2.95459980854025e-03f));
  p = vfmadd(p, x2, vset1(-1.60960333262415e-02f));
  p = vmul(p, x);
  vf q = vset1(-1.45660718464996e-05f);
  q = vfmadd(q, x2, vset1(-2.13374055278905e-04f));
  q = vfmadd(q, x2, vset1(-1.68282697438203e-03f));
  q = vfmadd(q, x2, vset1(-7.37332916720468e-03f));
  q = vfmadd(q, x2, vset1(-1.42647390514189e-02f));
  // p / q as p · rcp(q) with one Newton step (vrcp: 14 bits on AVX-512, ~23 on AVX2; then
  // float32's 24): vdivps's throughput (one per ~10 cycles) set the GELU epilogue's speed.
  vf r = vrcp(q);
  r = vmul(r, vfnmadd(q, r, vset1(2.f)));
  return vmul(p, r);
}

inline vf activate(vf v, int64_t act) {
  if (act == kGelu) {
    const vf half = vset1(0.5f);
    const vf e = erf_ps(vmul(v, vset1(0.70710678118654752f)));
    return vmul(vmul(v, half), vadd(vset1(1.f), e));
  }
  if (act == kRelu) return vmax(v, vzero());
  return v;
}

// One row's quantization once its range is known: symmetric int8 (amax = max |v|: scale =
// amax / 127, q = round(v / scale)) or asymmetric uint8 ([mn, mx]: scale = (mx - mn) / 255,
// z = round(-mn / scale), q = clamp(round(v / scale) + z, 0, 255)); v = x (· smoothing).
void quantize_row_sym_given(const float* x, const float* sm, int64_t K, float amax, int8_t* q,
                            float* scale) {
  const float s = std::max(amax, kMinScale) / 127.f;
  const vf inv = vset1(1.f / s);
  for (int64_t k = 0; k < K; k += kW) {
    const vi i = vround_int(vmul(smoothed(x, sm, k, tail_mask(K - k)), inv));
    store_s8(q + k, i, K - k);  // |i| <= 127 already
  }
  *scale = s;
}

void quantize_row_asym_given(const float* x, const float* sm, int64_t K, float mn, float mx,
                             uint8_t* q, float* scale, float* scaled_zero) {
  const float s = std::max(mx - mn, kMinScale) / 255.f;
  const float z = std::nearbyint(-mn / s);
  const vf inv = vset1(1.f / s);
  const vi zero_point = vi_set1(static_cast<int32_t>(z));
  const vi top = vi_set1(255);
  for (int64_t k = 0; k < K; k += kW) {
    vi i = vround_int(vmul(smoothed(x, sm, k, tail_mask(K - k)), inv));
    i = vi_min(vi_max(vi_add(i, zero_point), vi_zero()), top);
    store_u8(q + k, i, K - k);
  }
  *scale = s;
  *scaled_zero = s * z;
}

// The range of v = x (· smoothing) over a row: (min, max).
inline std::pair<float, float> row_range(const float* x, const float* sm, int64_t K) {
  vf lo = vset1(std::numeric_limits<float>::infinity());
  vf hi = vset1(-std::numeric_limits<float>::infinity());
  for (int64_t k = 0; k < K; k += kW) {
    const vmask m = tail_mask(K - k);
    const vf v = smoothed(x, sm, k, m);
    lo = vmask_min(lo, m, v);
    hi = vmask_max(hi, m, v);
  }
  return {vreduce_min(lo), vreduce_max(hi)};
}

// One row, range then quantization: symmetric ...
void quantize_row_sym(const float* x, const float* sm, int64_t K, int8_t* q, float* scale) {
  vf amax = vzero();
  for (int64_t k = 0; k < K; k += kW) {
    amax = vmax(amax, vabs(smoothed(x, sm, k, tail_mask(K - k))));
  }
  quantize_row_sym_given(x, sm, K, vreduce_max(amax), q, scale);
}

// ... and asymmetric.
void quantize_row_asym(const float* x, const float* sm, int64_t K, uint8_t* q, float* scale,
                       float* scaled_zero) {
  const auto [mn, mx] = row_range(x, sm, K);
  quantize_row_asym_given(x, sm, K, mn, mx, q, scale, scaled_zero);
}

const float* optional_ptr(const c10::optional<at::Tensor>& t, int64_t numel, const char* what) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat && t->numel() == numel, what,
              ": contiguous float32 of ", numel, " elements");
  return t->data_ptr<float>();
}

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat, what,
              ": float32 [T, K] with contiguous rows");
}

// The pointers an epilogue reads; row strides for the two optional [T, N] inputs.
struct Epilogue {
  const float* scale;
  const float* scaled_zero;  // null: symmetric input
  const float* wsum;
  const float* bias;
  const float* multiply;
  int64_t multiply_row;
  const float* residual;
  int64_t residual_row;
  int64_t act;
};

// kW lanes of row t, columns n..: act(s·y + b - sz·wsum) · multiply + residual, for y (the
// GEMM's accumulator times the weight scale) already in a register.
inline vf epilogue_value(const Epilogue& e, vf y, int64_t t, int64_t n, vmask m) {
  vf v = vmul(y, vset1(e.scale[t]));
  if (e.bias != nullptr) v = vadd(v, load(e.bias + n, m));
  if (e.scaled_zero != nullptr) v = vfnmadd(vset1(e.scaled_zero[t]), load(e.wsum + n, m), v);
  v = activate(v, e.act);
  if (e.multiply != nullptr) v = vmul(v, load(e.multiply + t * e.multiply_row + n, m));
  if (e.residual != nullptr) v = vadd(v, load(e.residual + t * e.residual_row + n, m));
  return v;
}

inline vf epilogue_lanes(const Epilogue& e, const float* y, int64_t t, int64_t n, vmask m) {
  return epilogue_value(e, load(y + n, m), t, n, m);
}

// LayerNorm of one finished row in place, given its sum: the centred sum of squares, then
// (v - mean) · rstd · gamma + beta (the stable two-pass form torch's layer_norm uses too).
inline void layer_norm_row(float* row, int64_t N, float sum, const float* g, const float* b,
                           double eps) {
  const float mean = sum / static_cast<float>(N);
  const vf mu = vset1(mean);
  vf sq = vzero();
  for (int64_t n = 0; n < N; n += kW) {
    const vmask m = tail_mask(N - n);
    const vf d = vmaskz_sub(m, load(row + n, m), mu);
    sq = vfmadd(d, d, sq);
  }
  const float var = vreduce_add(sq) / static_cast<float>(N);
  const vf rstd = vset1(1.f / std::sqrt(var + static_cast<float>(eps)));
  for (int64_t n = 0; n < N; n += kW) {
    const vmask m = tail_mask(N - n);
    const vf d = vmul(vsub(load(row + n, m), mu), rstd);
    vstore_masked(row + n, m, vfmadd(d, load(g + n, m), load(b + n, m)));
  }
}

// Optionally, each finished row is quantized again for the next int8 GEMM (while in L1).
struct Handoff {
  const float* smoothing = nullptr;
  void* q = nullptr;  // null: no handoff
  bool asym = false;
  float* scale = nullptr;
  float* scaled_zero = nullptr;

  void row(const float* y, int64_t t, int64_t N) const {
    if (q == nullptr) return;
    if (asym) {
      quantize_row_asym(y, smoothing, N, static_cast<uint8_t*>(q) + t * N, scale + t,
                        scaled_zero + t);
    } else {
      quantize_row_sym(y, smoothing, N, static_cast<int8_t*>(q) + t * N, scale + t);
      scaled_zero[t] = 0.f;
    }
  }

  // The same, for a row whose smoothed range [mn, mx] is already known.
  void row_given(const float* y, int64_t t, int64_t N, float mn, float mx) const {
    if (q == nullptr) return;
    if (asym) {
      quantize_row_asym_given(y, smoothing, N, mn, mx, static_cast<uint8_t*>(q) + t * N,
                              scale + t, scaled_zero + t);
    } else {
      quantize_row_sym_given(y, smoothing, N, std::max(-mn, mx), static_cast<int8_t*>(q) + t * N,
                             scale + t);
      scaled_zero[t] = 0.f;
    }
  }
};

Handoff make_handoff(const at::Tensor& y, const c10::optional<at::Tensor>& smoothing,
                     const c10::optional<at::Tensor>& q, const c10::optional<at::Tensor>& scale,
                     const c10::optional<at::Tensor>& scaled_zero) {
  Handoff h;
  if (!q.has_value()) return h;
  const int64_t T = y.size(0), N = y.size(1);
  TORCH_CHECK(q->is_contiguous() && q->sizes() == y.sizes() &&
                  (q->scalar_type() == at::kByte || q->scalar_type() == at::kChar),
              "q: contiguous int8 / uint8 like y");
  TORCH_CHECK(scale.has_value() && scaled_zero.has_value(), "q comes with its scale tensors");
  h.asym = q->scalar_type() == at::kByte;
  h.q = q->data_ptr();
  h.smoothing = optional_ptr(smoothing, N, "next_smoothing");
  h.scale = const_cast<float*>(optional_ptr(scale, T, "q_scale"));
  h.scaled_zero = const_cast<float*>(optional_ptr(scaled_zero, T, "q_scaled_zero"));
  return h;
}

Epilogue make_epilogue(const at::Tensor& y, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& scaled_zero,
                       const c10::optional<at::Tensor>& wsum,
                       const c10::optional<at::Tensor>& bias, int64_t act,
                       const c10::optional<at::Tensor>& multiply,
                       const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat,
              "y: contiguous float32 [T, N]");
  TORCH_CHECK(act >= kNone && act <= kRelu, "unknown activation code ", act);
  const int64_t T = y.size(0), N = y.size(1);
  Epilogue e{};
  e.scale = optional_ptr(scale, T, "scale");
  e.scaled_zero = optional_ptr(scaled_zero, T, "scaled_zero");
  e.wsum = optional_ptr(wsum, N, "wsum");
  TORCH_CHECK((e.scaled_zero == nullptr) == (e.wsum == nullptr),
              "scaled_zero and wsum come together");
  e.bias = optional_ptr(bias, N, "bias");
  e.act = act;
  for (auto [src, ptr, row, what] :
       {std::tuple{&multiply, &e.multiply, &e.multiply_row, "multiply"},
        std::tuple{&residual, &e.residual, &e.residual_row, "residual"}}) {
    if (!src->has_value()) continue;
    check_rows(**src, what);
    TORCH_CHECK((*src)->sizes() == y.sizes(), what, ": [T, N] like y");
    *ptr = (*src)->data_ptr<float>();
    *row = (*src)->stride(0);
  }
  return e;
}

// Where an epilogue writes: `out` (contiguous, like y) when given, else y itself.
float* output_ptr(at::Tensor& y, const c10::optional<at::Tensor>& out) {
  if (!out.has_value()) return y.data_ptr<float>();
  TORCH_CHECK(out->is_contiguous() && out->sizes() == y.sizes() &&
                  out->scalar_type() == at::kFloat,
              "out: contiguous float32 like y");
  return out->data_ptr<float>();
}

}  // namespace
