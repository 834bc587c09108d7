// tidepool's CPU element-wise kernels for the decoders: RMSNorm and the per-head q/k RMSNorm
// (Qwen3) fused with RoPE (float32), and the KV-cache write (any dtype). Each is one pass over its rows instead of the 4-6 passes
// (and their temporaries) of the torch ops; the loops are written for the compiler to vectorise
// (-O3 with the build's ISA, -mavx512f... or -mavx2 -mfma: attention/cpu_kernels.py's
// ISA_CFLAGS; `omp simd` reductions), parallel over tokens with ATen's parallel_for.
// Loaded by attention/cpu_decoder_ops.py, which keeps the torch ops as the fallback.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGrain = 16;  // tokens per parallel task: small steps still use every thread

inline float inv_rms(const float* x, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// out = x / rms(x) * weight, row by row. x: [T, H] (any row stride), out: [T, H] contiguous.
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              "x: float32 [T, H] with contiguous rows");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == at::kFloat,
              "out: contiguous float32 like x");
  const int64_t T = x.size(0), H = x.size(1), row = x.stride(0);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == H && weight.scalar_type() == at::kFloat,
              "weight: float32 [H]");
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* src = xp + t * row;
      float* dst = op + t * H;
      const float inv = inv_rms(src, H, e);
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) dst[i] = src[i] * inv * wp[i];
    }
  });
}

// One head, in place: optional RMSNorm over D, then rotate-half RoPE over the first 2 * half
// dims (the rest kept). buf: D floats of scratch.
inline void norm_rope_head(float* x, const float* weight, float eps, const float* cos,
                           const float* sin, int64_t D, int64_t half, float* buf) {
  if (weight != nullptr) {
    const float inv = inv_rms(x, D, eps);
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) buf[i] = x[i] * inv * weight[i];
  } else {
#pragma omp simd
    for (int64_t i = 0; i < 2 * half; ++i) buf[i] = x[i];
  }
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    x[i] = buf[i] * cos[i] - buf[i + half] * sin[i];
    x[i + half] = buf[i + half] * cos[i] + buf[i] * sin[i];
  }
  if (weight != nullptr)
    for (int64_t i = 2 * half; i < D; ++i) x[i] = buf[i];
}

// In place on qk: [T, Hq + Hk, D], a view of the fused QKV output (any token stride; heads and
// D contiguous): q heads first, then k heads. cos / sin: [T, half] float32 contiguous.
// q_weight / k_weight: [D] per-head RMSNorm weights, or undefined for no norm. In place, so that
// no [T, heads, D] output is allocated: at thousands of tokens a fresh one is a fresh mmap, and
// its page faults cost more than the arithmetic.
void qk_norm_rope_(at::Tensor& qk, int64_t num_q_heads, const c10::optional<at::Tensor>& q_weight,
                   const c10::optional<at::Tensor>& k_weight, double eps, const at::Tensor& cos,
                   const at::Tensor& sin) {
  TORCH_CHECK(qk.dim() == 3 && qk.scalar_type() == at::kFloat && qk.stride(2) == 1 &&
                  qk.stride(1) == qk.size(2),
              "qk: float32 [T, heads, D] with contiguous heads");
  const int64_t T = qk.size(0), H = qk.size(1), D = qk.size(2), row = qk.stride(0);
  const int64_t Hq = num_q_heads;
  TORCH_CHECK(Hq > 0 && Hq <= H, "num_q_heads out of range");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == T &&
                  sin.sizes() == cos.sizes() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && 2 * cos.size(1) <= D,
              "cos / sin: float32 [T, half] contiguous, 2 * half <= D");
  auto check_weight = [&](const c10::optional<at::Tensor>& w) -> const float* {
    if (!w.has_value() || !w->defined()) return nullptr;
    TORCH_CHECK(w->is_contiguous() && w->numel() == D && w->scalar_type() == at::kFloat,
                "norm weight: float32 [D]");
    return w->data_ptr<float>();
  };
  const float* qw = check_weight(q_weight);
  const float* kw = check_weight(k_weight);
  const int64_t half = cos.size(1);
  float* base = qk.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(D);
    for (int64_t t = begin; t < end; ++t) {
      float* x = base + t * row;
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int64_t h = 0; h < H; ++h)
        norm_rope_head(x + h * D, h < Hq ? qw : kw, e, c, s, D, half, buf.data());
    }
  });
}

// This step's keys and values into their cache slots (any dtype: rows are copied as bytes).
// kv_cache: contiguous [2, Hkv, num_blocks, block_size, D]; key / value: [T, Hkv, D] views (any
// token and head strides, D contiguous); slot_mapping: [T] int64, slot = block * block_size + i.
void write_kv(at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache: contiguous 5-d");
  const int64_t Hkv = kv_cache.size(1), D = kv_cache.size(4);
  const int64_t num_slots = kv_cache.size(2) * kv_cache.size(3);
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->dim() == 3 && t->size(1) == Hkv && t->size(2) == D && t->stride(2) == 1 &&
                    t->scalar_type() == kv_cache.scalar_type() && t->size(0) == key.size(0),
                "key / value: [T, Hkv, D] in the cache's dtype with contiguous D");
  TORCH_CHECK(slot_mapping.is_contiguous() && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.numel() == key.size(0),
              "slot_mapping: int64 [T]");
  const int64_t T = key.size(0), bytes = D * kv_cache.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range: ", slots[t]);
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const int64_t esize = kv_cache.element_size();
  const int64_t half = Hkv * num_slots * bytes;  // K | V
  at::parallel_for(0, T, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t side = 0; side < 2; ++side) {
      const at::Tensor& src = side == 0 ? key : value;
      const char* base = static_cast<const char*>(src.data_ptr());
      const int64_t s0 = src.stride(0) * esize, s1 = src.stride(1) * esize;
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < Hkv; ++h)
          std::memcpy(cache + side * half + (h * num_slots + slots[t]) * bytes,
                      base + t * s0 + h * s1, bytes);
    }
  });
}

}  // namespace

#ifndef TP_NS
#define TP_NS tidepool_decoder
#endif

TORCH_LIBRARY(TP_NS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def(
      "qk_norm_rope_(Tensor(a!) qk, int num_q_heads, Tensor? q_weight, Tensor? k_weight, "
      "float eps, Tensor cos, Tensor sin) -> ()");
  m.def("write_kv(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(TP_NS, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("qk_norm_rope_", &qk_norm_rope_);
  m.impl("write_kv", &write_kv);
}
