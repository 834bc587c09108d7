// tidepool's int8 GEMM on AMX tiles with the epilogue inside the tile loop
// (quantization/int8_linear.py): y = epilogue(q @ Wᵀ) for q [T, K] uint8 (asymmetric inputs)
// or int8 and W [N, K] int8 packed once into 16 x 64-byte tiles. Each 32 x 32 block of int32
// sums goes from the tile registers to a 4 KiB L1 buffer and is finished there: the weight and
// per-token scales, bias, zero-point correction, GELU / ReLU, multiply / residual (the same
// formula as cpu_int8_ops.cpp's dequant_, epilogue_value). When a row group's blocks are done,
// its rows get the LayerNorm (post-LN encoders) and the quantization for the next int8 GEMM
// (the handoff) while they are in L2. No int32 or unfinished float32 tensor is ever written,
// and a layer whose float32 output only feeds the next GEMM (FFN up) writes none at all.
//
// Two-part weights (W ≈ s·(W_hi + W_lo / 254): ~15-bit weights where accuracy needs them) run
// both products in the same tile loop and combine the sums in float32.
//
// Layout: a packed weight is [N/16][K/64][16][64] int8: tile (nb, kb) holds columns
// nb·16..+16 and k = kb·64..+64 as 16 rows of 4 consecutive k for each of 16 columns (the VNNI
// order _tile_dpbusd reads). Needs K % 64 == 0 and N % 32 == 0; Int8Linear keeps oneDNN's GEMM
// for other shapes and for CPUs without AMX-INT8.

#include "cpu_amx.h"
#include "cpu_int8_fused.h"

#include <cpuid.h>

#include <vector>

namespace {

constexpr int64_t kStrip = 32;               // rows per tile block (two 16-row A tiles)
constexpr int64_t kBlockCols = 32;           // columns per tile block (two 16-column B tiles)
constexpr float kLoFactor = 1.f / 254.f;     // W_lo's weight relative to W_hi

// The CPU has AMX-TILE and AMX-INT8 and the kernel lets this process use the tile data.
bool amx_ready() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, int8 = (d >> 25) & 1;
    return tile && int8 && request_tile_data();
  }();
  return ok;
}

// Tile c += a · b: u8 x s8 (asymmetric inputs) or s8 x s8. A macro: gcc's tile intrinsics paste
// their arguments into the asm as register names, so they must be literal numbers.
#define TP_DOT(kUnsigned, c, a, b) \
  do {                             \
    if constexpr (kUnsigned) {     \
      _tile_dpbusd(c, a, b);       \
    } else {                       \
      _tile_dpbssd(c, a, b);       \
    }                              \
  } while (0)

// The 32 x 32 int32 sums of rows a (stride lda; 32 rows) against column tiles nb, nb + 1 of
// the packed weight b (K / 64 tiles per column tile), into c [32][32].
template <bool kUnsigned>
inline void block_32x32(const uint8_t* a, int64_t lda, const int8_t* b, int64_t ktiles,
                        int32_t* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int8_t* b1 = b + ktiles * 1024;
  for (int64_t kb = 0; kb < ktiles; ++kb) {
    _tile_loadd(4, a + kb * 64, lda);
    _tile_loadd(5, a + 16 * lda + kb * 64, lda);
    _tile_loadd(6, b + kb * 1024, 64);
    _tile_loadd(7, b1 + kb * 1024, 64);
    TP_DOT(kUnsigned, 0, 4, 6);
    TP_DOT(kUnsigned, 1, 4, 7);
    TP_DOT(kUnsigned, 2, 5, 6);
    TP_DOT(kUnsigned, 3, 5, 7);
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  _tile_stored(2, c + 16 * 32, 128);
  _tile_stored(3, c + 16 * 32 + 16, 128);
}

// Two-part weights: the 32 x 16 sums against column tile nb of hi (into c) and of lo (into
// c_lo), both [32][32] with this block in columns col..col + 16.
template <bool kUnsigned>
inline void block_32x16_two_part(const uint8_t* a, int64_t lda, const int8_t* hi,
                                 const int8_t* lo, int64_t ktiles, int32_t* c, int32_t* c_lo) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < ktiles; ++kb) {
    _tile_loadd(4, a + kb * 64, lda);
    _tile_loadd(5, a + 16 * lda + kb * 64, lda);
    _tile_loadd(6, hi + kb * 1024, 64);
    _tile_loadd(7, lo + kb * 1024, 64);
    TP_DOT(kUnsigned, 0, 4, 6);
    TP_DOT(kUnsigned, 1, 5, 6);
    TP_DOT(kUnsigned, 2, 4, 7);
    TP_DOT(kUnsigned, 3, 5, 7);
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16 * 32, 128);
  _tile_stored(2, c_lo, 128);
  _tile_stored(3, c_lo + 16 * 32, 128);
}

// Rows [r0, r0 + rows) x columns [n0, n0 + 32) from the int32 sums c (and c_lo), into dst
// (row stride N, row r0 at dst).
void finish_block(const Gemm& g, const Epilogue& e, const int32_t* c, const int32_t* c_lo,
                  int64_t r0, int64_t rows, int64_t n0, float* dst) {
  const __m512 lo_factor = _mm512_set1_ps(kLoFactor);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < kBlockCols; j += 16) {
      const int64_t n = n0 + j;
      __m512 acc = _mm512_cvtepi32_ps(_mm512_loadu_si512(c + i * 32 + j));
      if (c_lo != nullptr)
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(c_lo + i * 32 + j)),
                              lo_factor, acc);
      const __m512 y = _mm512_mul_ps(acc, _mm512_loadu_ps(g.w_scale + n));
      _mm512_storeu_ps(dst + i * g.N + n, epilogue_value(e, y, r0 + i, n, 0xFFFF));
    }
  }
}

// Rows [r0, r1) (a whole number of strips but maybe the last) x columns [n0, n1) into dst.
// A strip past T reads a zero-padded copy of its rows.
template <bool kUnsigned>
void run_blocks(const Gemm& g, const Epilogue& e, int64_t r0, int64_t r1, int64_t n0, int64_t n1,
                float* dst) {
  alignas(64) int32_t c[kStrip * 32];
  alignas(64) int32_t c_lo[kStrip * 32];
  const int64_t ktiles = g.K / 64;
  thread_local std::vector<uint8_t> pad;
  const uint8_t* tail = nullptr;
  const int64_t full_end = r0 + (r1 - r0) / kStrip * kStrip;
  if (full_end < r1) {
    pad.assign(kStrip * g.K, 0);
    std::copy(g.q + full_end * g.K, g.q + r1 * g.K, pad.data());
    tail = pad.data();
  }
  for (int64_t n = n0; n < n1; n += kBlockCols) {
    const int64_t nb = n / 16;
    for (int64_t r = r0; r < r1; r += kStrip) {
      const uint8_t* a = r < full_end ? g.q + r * g.K : tail;
      const int64_t rows = std::min(kStrip, r1 - r);
      if (g.w_lo == nullptr) {
        block_32x32<kUnsigned>(a, g.K, g.w + nb * ktiles * 1024, ktiles, c);
        finish_block(g, e, c, nullptr, r, rows, n, dst + (r - r0) * g.N);
      } else {
        for (int64_t half = 0; half < 2; ++half) {
          const int64_t off = (nb + half) * ktiles * 1024;
          block_32x16_two_part<kUnsigned>(a, g.K, g.w + off, g.w_lo + off, ktiles,
                                          c + half * 16, c_lo + half * 16);
        }
        finish_block(g, e, c, c_lo, r, rows, n, dst + (r - r0) * g.N);
      }
    }
  }
}

// The AMX blocks as the shared row-group / column-split drivers (cpu_int8_fused.h) run them.
template <bool kUnsigned>
struct AmxKernel {
  static constexpr int64_t kRows = kStrip;
  static constexpr int64_t kBlockCols = ::kBlockCols;
  static constexpr int64_t kGroupBytes = 1536 << 10;  // a row group's float32 rows, mostly in L2
  static constexpr int64_t kMaxGroupBlocks = 4;
  static void enter() { load_tile_config(); }
  static void leave() { _tile_release(); }
  static void blocks(const Gemm& g, const Epilogue& e, int64_t r0, int64_t r1, int64_t n0,
                     int64_t n1, float* dst) {
    run_blocks<kUnsigned>(g, e, r0, r1, n0, n1, dst);
  }
};

void check_packed(const at::Tensor& w, int64_t N, int64_t K, const char* what) {
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kChar && w.dim() == 4 &&
                  w.size(0) == N / 16 && w.size(1) == K / 64 && w.size(2) == 16 && w.size(3) == 64,
              what, ": packed int8 [N/16, K/64, 16, 64]");
}

void amx_linear(const at::Tensor& q, const at::Tensor& w, const c10::optional<at::Tensor>& w_lo,
                const at::Tensor& w_scale, const at::Tensor& scale,
                const c10::optional<at::Tensor>& scaled_zero,
                const c10::optional<at::Tensor>& wsum, const c10::optional<at::Tensor>& bias,
                int64_t act, const c10::optional<at::Tensor>& multiply,
                const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& gamma,
                const c10::optional<at::Tensor>& beta, double eps,
                const c10::optional<at::Tensor>& next_smoothing,
                const c10::optional<at::Tensor>& q_next, const c10::optional<at::Tensor>& q_scale,
                const c10::optional<at::Tensor>& q_scaled_zero, at::Tensor& out,
                bool write_out) {
  TORCH_CHECK(amx_ready(), "this CPU (or kernel) does not allow AMX-INT8");
  check_input(q, out);
  const int64_t K = q.size(1), N = out.size(1);
  TORCH_CHECK(K % 64 == 0 && N % kBlockCols == 0, "K % 64 == 0 and N % 32 == 0");
  check_packed(w, N, K, "w");
  if (w_lo.has_value()) check_packed(*w_lo, N, K, "w_lo");
  const Gemm g = make_gemm(q, w, w_lo, w_scale, scale, scaled_zero, wsum, bias, act, multiply,
                           residual, gamma, beta, eps, next_smoothing, q_next, q_scale,
                           q_scaled_zero, out, write_out);
  g.asym ? run_gemm<AmxKernel<true>>(g) : run_gemm<AmxKernel<false>>(g);
}

bool amx_int8_available() { return amx_ready(); }

}  // namespace

TORCH_LIBRARY(tidepool_int8_amx, m) {
  m.def("available() -> bool", &amx_int8_available);
  m.def(
      "linear(Tensor q, Tensor w, Tensor? w_lo, Tensor w_scale, Tensor scale, "
      "Tensor? scaled_zero, Tensor? wsum, Tensor? bias, int act, Tensor? multiply, "
      "Tensor? residual, Tensor? gamma, Tensor? beta, float eps, Tensor? next_smoothing, "
      "Tensor(a!)? q_next, Tensor(b!)? q_scale, Tensor(c!)? q_scaled_zero, Tensor(d!) out, "
      "bool write_out) -> ()");
}

TORCH_LIBRARY_IMPL(tidepool_int8_amx, CPU, m) { m.impl("linear", &amx_linear); }
