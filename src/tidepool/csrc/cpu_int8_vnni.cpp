// tidepool's int8 GEMM on VNNI (vpdpbusd) with the epilogue inside the blocked loop, for CPUs
// without AMX (quantization/int8_linear.py): the AMX kernel's design (cpu_int8_gemm.cpp) on
// vector registers. One source, two builds (quantization/int8_ops.py): AVX-512 VNNI
// (TP_ISA_AVX512 + -mavx512vnni: _mm512_dpbusd_epi32, 16 columns a register) and the 256-bit
// AVX-VNNI of client CPUs (TP_ISA_AVX2 + -mavxvnni: _mm256_dpbusd_avx_epi32, 8 columns).
//
// y = epilogue(q @ Wᵀ) for q [T, K] uint8 (asymmetric inputs) or int8 (symmetric) and W [N, K]
// int8 packed once. vpdpbusd multiplies unsigned by signed bytes and adds four products into an
// int32 lane without saturating (unlike vpmaddubsw's int16), so the full uint8 range is exact.
// Symmetric int8 inputs go in as q + 128 (a byte xor, once per row block) and the sums get
// 128 · Σ_k W_nk taken off (w_comp, exact int32): |sum| <= K · 255 · 127 < 2³¹ for K < 66,000.
//
// A register block is kRows rows x kVecs column vectors of int32 sums, over the whole of K;
// it goes to a small L1 buffer and is finished there: weight and per-token scales, bias,
// zero-point correction, GELU / ReLU, multiply / residual (cpu_int8_common.h's epilogue_value,
// the formula of the epilogue kernels and the AMX GEMM). Many rows: each thread takes whole row
// groups (float32 rows in L2), then the row pass (multiply / residual, LayerNorm, the next
// layer's quantization) writes each row once; few rows: the blocks are split by columns too
// (both drivers, the set-up and the row pass are the AMX kernel's: cpu_int8_fused.h).
// Two-part weights (W ≈ s·(W_hi + W_lo / 254)) run both products per block.
//
// Layout: a packed weight is [N/16][K/4][16][4] int8: for 16 columns and each k-quad, 64 bytes
// holding 4 consecutive k of each column (the order vpdpbusd reads; the AMX tiles' order too).
// Needs K % 4 == 0 and N % 16 == 0; Int8Linear keeps oneDNN's GEMM for other shapes.

#include "cpu_int8_fused.h"

#include <cstring>
#include <vector>

namespace {

#if defined(TP_ISA_AVX512)
constexpr int kRows = 6;  // 24 accumulators + 4 weight vectors + a broadcast: 29 of 32 zmm
constexpr int kVecs = 4;  // 64 columns
TP_INLINE vi dot(vi acc, vi a, vi w) { return _mm512_dpbusd_epi32(acc, a, w); }
TP_INLINE vi load_i(const void* p) { return _mm512_loadu_si512(p); }
TP_INLINE void store_i(void* p, vi v) { _mm512_storeu_si512(p, v); }
TP_INLINE vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
TP_INLINE vf vcvt(vi v) { return _mm512_cvtepi32_ps(v); }
#else
constexpr int kRows = 6;  // 12 accumulators + 2 weight vectors + a broadcast: 15 of 16 ymm
constexpr int kVecs = 2;  // 16 columns: one 64-byte line of the packed weight
TP_INLINE vi dot(vi acc, vi a, vi w) { return _mm256_dpbusd_avx_epi32(acc, a, w); }
TP_INLINE vi load_i(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
TP_INLINE void store_i(void* p, vi v) { _mm256_storeu_si256(static_cast<__m256i*>(p), v); }
TP_INLINE vi vi_sub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
TP_INLINE vf vcvt(vi v) { return _mm256_cvtepi32_ps(v); }
#endif

constexpr int64_t kBlockCols = kVecs * kW;  // columns per register block
// A column panel's packed weights, in L2 while the group's row blocks pass over them: K = 384
// shapes ran at 0.60x torch._int_mm's GOP/s without panels, 0.73x with (1 thread, CPU time).
constexpr int64_t kPanelBytes = 256 << 10;
constexpr float kLoFactor = 1.f / 254.f;    // W_lo's weight relative to W_hi

// The int32 sums of kRows rows of a (stride lda, prepared: uint8, padded) against C column
// vectors starting at column n of the packed weight w, over all K, into c [kRows][kBlockCols].
template <int C>
void block_sums(const uint8_t* a, int64_t lda, const int8_t* w, int64_t n, int64_t K,
                int32_t* c) {
  const int64_t quads = K / 4;
  const int8_t* wp[C];
#pragma GCC unroll 4
  for (int j = 0; j < C; ++j) {
    const int64_t col = n + j * kW;
    wp[j] = w + (col / 16) * quads * 64 + (col % 16) * 4;
  }
  vi acc[kRows][C];
#pragma GCC unroll 6
  for (int i = 0; i < kRows; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) acc[i][j] = vi_zero();
  }
  for (int64_t kq = 0; kq < quads; ++kq) {
    vi wv[C];
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) wv[j] = load_i(wp[j] + kq * 64);
#pragma GCC unroll 6
    for (int i = 0; i < kRows; ++i) {
      int32_t four;
      std::memcpy(&four, a + i * lda + kq * 4, 4);
      const vi av = vi_set1(four);
#pragma GCC unroll 4
      for (int j = 0; j < C; ++j) acc[i][j] = dot(acc[i][j], av, wv[j]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < kRows; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) store_i(c + i * kBlockCols + j * kW, acc[i][j]);
  }
}

template <int C>
void finish_block(const Gemm& g, const Epilogue& e, const int32_t* c, const int32_t* c_lo,
                  int64_t r0, int64_t rows, int64_t n0, float* dst) {
  const vf lo_factor = vset1(kLoFactor);
  const vmask all = lanes(kW);
  for (int64_t i = 0; i < rows; ++i) {
    for (int j = 0; j < C; ++j) {
      const int64_t n = n0 + j * kW;
      vi s = load_i(c + i * kBlockCols + j * kW);
      if (!g.asym) s = vi_sub(s, load_i(g.comp + n));
      vf acc = vcvt(s);
      if (c_lo != nullptr) {
        vi sl = load_i(c_lo + i * kBlockCols + j * kW);
        if (!g.asym) sl = vi_sub(sl, load_i(g.comp_lo + n));
        acc = vfmadd(vcvt(sl), lo_factor, acc);
      }
      const vf y = vmul(acc, vloadu(g.w_scale + n));
      vstoreu(dst + i * g.N + n, epilogue_value(e, y, r0 + i, n, all));
    }
  }
}

// One register block: kRows rows of the prepared input a (row r at a) x C column vectors at n,
// finished into dst (row r at dst; `rows` of them are real).
template <int C>
void block(const Gemm& g, const Epilogue& e, const uint8_t* a, int64_t r, int64_t rows, int64_t n,
           float* dst) {
  alignas(64) int32_t c[kRows * kBlockCols];
  alignas(64) int32_t c_lo[kRows * kBlockCols];
  block_sums<C>(a, g.K, g.w, n, g.K, c);
  if (g.w_lo != nullptr) block_sums<C>(a, g.K, g.w_lo, n, g.K, c_lo);
  finish_block<C>(g, e, c, g.w_lo == nullptr ? nullptr : c_lo, r, rows, n, dst);
}

// Rows [r0, r1) x columns [n0, n1) into dst (row r0 at dst): the rows are copied once into a
// per-thread buffer, as uint8 (symmetric inputs + 128) and padded with zero rows to whole
// register blocks, then every column block reads them from there.
void run_blocks(const Gemm& g, const Epilogue& e, int64_t r0, int64_t r1, int64_t n0, int64_t n1,
                float* dst) {
  thread_local std::vector<uint8_t> prepared;
  const int64_t padded = (r1 - r0 + kRows - 1) / kRows * kRows;
  prepared.resize(padded * g.K);
  const uint8_t* src = g.q + r0 * g.K;
  const int64_t bytes = (r1 - r0) * g.K;
  uint8_t* a = prepared.data();
  if (g.asym) {
    std::memcpy(a, src, bytes);
  } else {
    for (int64_t i = 0; i < bytes; ++i) a[i] = src[i] ^ 0x80;
  }
  std::memset(a + bytes, 0, (padded - (r1 - r0)) * g.K);
  // Column panels whose weights stay in L2 while every row block of the range passes over them;
  // a row block's input stays in L1 across the panel's column blocks.
  const int64_t panel = std::max<int64_t>(kBlockCols, kPanelBytes / g.K / kBlockCols * kBlockCols);
  for (int64_t p0 = n0; p0 < n1; p0 += panel) {
    const int64_t p1 = std::min(n1, p0 + panel);
    for (int64_t r = r0; r < r1; r += kRows) {
      const uint8_t* ar = a + (r - r0) * g.K;
      const int64_t rows = std::min<int64_t>(kRows, r1 - r);
      float* dr = dst + (r - r0) * g.N;
      for (int64_t n = p0; n < p1; n += kBlockCols) {
        switch (std::min<int64_t>(kVecs, (p1 - n) / kW)) {
#if defined(TP_ISA_AVX512)
          case 4: block<4>(g, e, ar, r, rows, n, dr); break;
          case 3: block<3>(g, e, ar, r, rows, n, dr); break;
#endif
          case 2: block<2>(g, e, ar, r, rows, n, dr); break;
          default: block<1>(g, e, ar, r, rows, n, dr); break;
        }
      }
    }
  }
}

// The VNNI blocks as the shared row-group / column-split drivers (cpu_int8_fused.h) run them.
struct VnniKernel {
  static constexpr int64_t kRows = ::kRows;
  static constexpr int64_t kBlockCols = ::kBlockCols;
  static constexpr int64_t kGroupBytes = 512 << 10;  // a row group's float32 rows, in L2
  static constexpr int64_t kMaxGroupBlocks = 16;
  static void enter() {}
  static void leave() {}
  static void blocks(const Gemm& g, const Epilogue& e, int64_t r0, int64_t r1, int64_t n0,
                     int64_t n1, float* dst) {
    run_blocks(g, e, r0, r1, n0, n1, dst);
  }
};

void check_packed(const at::Tensor& w, const at::Tensor& comp, int64_t N, int64_t K,
                  const char* what) {
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kChar && w.dim() == 4 &&
                  w.size(0) == N / 16 && w.size(1) == K / 4 && w.size(2) == 16 && w.size(3) == 4,
              what, ": packed int8 [N/16, K/4, 16, 4]");
  TORCH_CHECK(comp.is_contiguous() && comp.scalar_type() == at::kInt && comp.numel() == N, what,
              "'s comp: contiguous int32 [N]");
}

void vnni_linear(const at::Tensor& q, const at::Tensor& w, const c10::optional<at::Tensor>& w_lo,
                 const at::Tensor& comp, const c10::optional<at::Tensor>& comp_lo,
                 const at::Tensor& w_scale, const at::Tensor& scale,
                 const c10::optional<at::Tensor>& scaled_zero,
                 const c10::optional<at::Tensor>& wsum, const c10::optional<at::Tensor>& bias,
                 int64_t act, const c10::optional<at::Tensor>& multiply,
                 const c10::optional<at::Tensor>& residual,
                 const c10::optional<at::Tensor>& gamma, const c10::optional<at::Tensor>& beta,
                 double eps, const c10::optional<at::Tensor>& next_smoothing,
                 const c10::optional<at::Tensor>& q_next,
                 const c10::optional<at::Tensor>& q_scale,
                 const c10::optional<at::Tensor>& q_scaled_zero, at::Tensor& out,
                 bool write_out) {
  check_input(q, out);
  const int64_t K = q.size(1), N = out.size(1);
  TORCH_CHECK(K % 4 == 0 && N % 16 == 0, "K % 4 == 0 and N % 16 == 0");
  check_packed(w, comp, N, K, "w");
  TORCH_CHECK(w_lo.has_value() == comp_lo.has_value(), "w_lo and comp_lo come together");
  if (w_lo.has_value()) check_packed(*w_lo, *comp_lo, N, K, "w_lo");
  Gemm g = make_gemm(q, w, w_lo, w_scale, scale, scaled_zero, wsum, bias, act, multiply, residual,
                     gamma, beta, eps, next_smoothing, q_next, q_scale, q_scaled_zero, out,
                     write_out);
  g.comp = comp.data_ptr<int32_t>();
  g.comp_lo = comp_lo.has_value() ? comp_lo->data_ptr<int32_t>() : nullptr;
  run_gemm<VnniKernel>(g);
}

}  // namespace

#ifndef TP_NS
#define TP_NS tidepool_int8_vnni
#endif

TORCH_LIBRARY(TP_NS, m) {
  m.def(
      "linear(Tensor q, Tensor w, Tensor? w_lo, Tensor comp, Tensor? comp_lo, Tensor w_scale, "
      "Tensor scale, Tensor? scaled_zero, Tensor? wsum, Tensor? bias, int act, Tensor? multiply, "
      "Tensor? residual, Tensor? gamma, Tensor? beta, float eps, Tensor? next_smoothing, "
      "Tensor(a!)? q_next, Tensor(b!)? q_scale, Tensor(c!)? q_scaled_zero, Tensor(d!) out, "
      "bool write_out) -> ()");
}

TORCH_LIBRARY_IMPL(TP_NS, CPU, m) { m.impl("linear", &vnni_linear); }
