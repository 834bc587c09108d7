// Bidirectional attention over packed, variable-length sequences on CPU (AVX-512).
//
// One task is one (sequence, head). Its keys are packed transposed and its values packed
// contiguous, both in float32, into per-thread scratch; queries run in tiles of kRows rows: the
// scores of a tile against every key stay in a [kRows, L] scratch (L1/L2-resident for encoder
// lengths), are soft-maxed in place with a vectorised exp, and multiplied by the values. No mask
// and no padding: each sequence attends to exactly its own tokens. Tasks are taken from a shared
// counter, longest sequence first, so the threads finish together.
//
// Optional key counts (key_lens): sequence i's keys are then its first key_lens[i] tokens while
// every one of its tokens is a query (a ColBERT query's [MASK] expansion, which attends but is
// not attended to). A task simply packs fewer keys: nothing changes inside it, and without
// key_lens the key count is the length.
//
// An optional relative position bias (MPNet's) is added to the scores from a per-head row of
// biases by key - query distance ([heads, width], attention/relative_bias.py): query i, key j read
// column j - i + offset, one unaligned vector load per 16 scores, no [L, L] tensor.
//
// With matmul = bf16 / bf16x3 (where the CPU has AMX-bf16) both products run on AMX tiles
// instead, the softmax staying float32: attend_amx below.
//
// Why by hand: PyTorch's CPU flash-attention kernel tiles the work into many small GEMM calls,
// which for 32- and 64-wide heads run at 25-60 GFLOP/s here; see docs/performance.md.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_amx.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kRows = 8;  // query rows per tile

// The longest sequence the op accepts: one constant, attention/cpu_kernels.py's MAX_SEQ_LEN,
// passed by its build (-DTIDEPOOL_MAX_SEQ_LEN), so Python and C++ cannot disagree.
#ifndef TIDEPOOL_MAX_SEQ_LEN
#error "build through tidepool.attention.cpu_kernels, which defines TIDEPOOL_MAX_SEQ_LEN"
#endif
constexpr int64_t kMaxSeqLen = TIDEPOOL_MAX_SEQ_LEN;

#define TP_INLINE inline __attribute__((always_inline))

// exp(x) for x <= 0 (scores minus the row's maximum): 2^n * p(r), r = x - n ln2, |r| <= ln2/2,
// degree-6 polynomial; relative error ~2e-7, underflows to 0 below -87.
TP_INLINE __m512 exp_ps(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f);
  const __m512 ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

TP_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
TP_INLINE __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

TP_INLINE void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
TP_INLINE void store16(c10::BFloat16* p, __m512 v) {
  // Round to nearest even, as torch's float -> bfloat16 conversion does (no NaN inputs here).
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

struct Scratch {
  std::vector<float> kt;      // [Lp / 32, D, 32] keys, transposed in blocks of 32
  std::vector<float> v;       // [len, D] values
  std::vector<float> q;       // [Lr, D] queries, scaled (Lr: q_len rounded up to kRows)
  std::vector<float> s;       // [Lr, Lp] scores, then probabilities
  std::vector<float> inv;     // [Lr] 1 / each row's softmax denominator
};

// 16 x 16 transpose in registers: r[i] holds row i on entry, column i on exit.
TP_INLINE void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      t[8 * i + k] = _mm512_shuffle_f32x4(u[8 * i + k], u[8 * i + 4 + k], 0x88);
      t[8 * i + 4 + k] = _mm512_shuffle_f32x4(u[8 * i + k], u[8 * i + 4 + k], 0xDD);
    }
  }
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xDD);
  }
}

// Where one head's rows are: row i of the head starts at ptr + i * row (elements).
template <typename T>
struct HeadRows {
  const T* ptr;
  int64_t row;
};

// One (sequence, head): keys and values are its rows [0, len) of k, v, queries its rows
// [0, q_len) of q (q_len may exceed len: rows past the sequence's key count). Query rows are
// written to out rows out_start + i (row stride H D, this head's D columns). bias: this head's
// biases by distance, column j - i of key j for query i (already offset), or null.
template <typename T, int64_t D>
void attend(HeadRows<T> q, HeadRows<T> k, HeadRows<T> v, int64_t H, int64_t len, int64_t q_len,
            int64_t h, float scale, const float* bias, T* out, int64_t out_start, Scratch& sc) {
  constexpr int64_t V = D / 16;  // vectors per head row
  const int64_t Lp = (len + 31) / 32 * 32;
  sc.kt.resize(D * Lp);
  float* kt = sc.kt.data();
  // Keys, 16 at a time: 16 rows x 16 dims transposed in registers into the [D, 32] blocks.
  for (int64_t j = 0; j < Lp; j += 16) {
    float* ktb = kt + (j / 32) * D * 32 + j % 32;
    for (int64_t c = 0; c < V; ++c) {
      __m512 r[16];
#pragma GCC unroll 16
      for (int64_t i = 0; i < 16; ++i)
        r[i] = j + i < len ? load16(k.ptr + (j + i) * k.row + 16 * c) : _mm512_setzero_ps();
      transpose16(r);
#pragma GCC unroll 16
      for (int64_t i = 0; i < 16; ++i) _mm512_storeu_ps(ktb + (16 * c + i) * 32, r[i]);
    }
  }
  // Values contiguous in float32 (read in place, their rows are a page apart: 1.3x slower).
  sc.v.resize(len * D);
  float* vb = sc.v.data();
  for (int64_t j = 0; j < len; ++j)
    for (int64_t c = 0; c < V; ++c)
      store16(vb + j * D + 16 * c, load16(v.ptr + j * v.row + 16 * c));
  const int64_t Lr = (q_len + kRows - 1) / kRows * kRows;
  sc.q.resize(Lr * D);
  sc.s.resize(Lr * Lp);
  sc.inv.resize(Lr);
  float* qb = sc.q.data();
  float* s = sc.s.data();
  float* inv = sc.inv.data();
  // Queries, scaled, all rows before any is used: broadcasting a float out of a vector that was
  // just stored stalls store forwarding (a per-tile copy made the scores 2x slower).
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < Lr; ++i)
    for (int64_t c = 0; c < V; ++c)
      store16(qb + i * D + 16 * c,
              i < q_len ? _mm512_mul_ps(load16(q.ptr + i * q.row + 16 * c), vscale) : _mm512_setzero_ps());
  // Phase 1, scores S = Q K^T: [kRows, 32] register tiles; the keys (D x Lp) stay in L1 while
  // every query tile passes over them. Each row's maximum over its real keys goes with it.
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i0 = 0; i0 < Lr; i0 += kRows) {
    const float* qt = qb + i0 * D;
    float* st = s + i0 * Lp;
    __m512 mx[kRows];
    for (int64_t r = 0; r < kRows; ++r) mx[r] = neg_inf;
    for (int64_t j = 0; j < Lp; j += 32) {
      __m512 acc[kRows][2];
      for (int64_t r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      const float* ktb = kt + j * D;  // block j / 32: [D, 32]
      for (int64_t d = 0; d < D; ++d) {
        const __m512 k0 = _mm512_loadu_ps(ktb + d * 32);
        const __m512 k1 = _mm512_loadu_ps(ktb + d * 32 + 16);
        for (int64_t r = 0; r < kRows; ++r) {
          const __m512 qv = _mm512_set1_ps(qt[r * D + d]);
          acc[r][0] = _mm512_fmadd_ps(qv, k0, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(qv, k1, acc[r][1]);
        }
      }
      if (bias != nullptr) {
        for (int64_t r = 0; r < kRows; ++r) {
          const float* b = bias + j - (i0 + r);
          acc[r][0] = _mm512_add_ps(acc[r][0], _mm512_loadu_ps(b));
          acc[r][1] = _mm512_add_ps(acc[r][1], _mm512_loadu_ps(b + 16));
        }
      }
      const int64_t real = len - j;  // real keys in this block (may exceed 32)
      const __mmask16 m0 = real >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << real) - 1u);
      const __mmask16 m1 =
          real >= 32 ? 0xFFFF : (real <= 16 ? 0 : static_cast<__mmask16>((1u << (real - 16)) - 1u));
      for (int64_t r = 0; r < kRows; ++r) {
        _mm512_storeu_ps(st + r * Lp + j, acc[r][0]);
        _mm512_storeu_ps(st + r * Lp + j + 16, acc[r][1]);
        mx[r] = _mm512_mask_max_ps(mx[r], m0, mx[r], acc[r][0]);
        mx[r] = _mm512_mask_max_ps(mx[r], m1, mx[r], acc[r][1]);
      }
    }
    // Phase 2 for the tile, while its scores are in L1: softmax over the len real keys.
    for (int64_t r = 0; r < kRows; ++r) {
      float* sr = st + r * Lp;
      const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx[r]));
      __m512 sum = _mm512_setzero_ps();
      int64_t j = 0;
      for (; j + 16 <= len; j += 16) {
        const __m512 p = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + j), m));
        _mm512_storeu_ps(sr + j, p);
        sum = _mm512_add_ps(sum, p);
      }
      if (j < len) {
        const __mmask16 tail = static_cast<__mmask16>((1u << (len - j)) - 1u);
        const __m512 p = _mm512_maskz_mov_ps(tail, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + j), m)));
        _mm512_storeu_ps(sr + j, p);
        sum = _mm512_add_ps(sum, p);
      }
      inv[i0 + r] = 1.0f / _mm512_reduce_add_ps(sum);
    }
  }
  // Phase 3, O = P V / sum: rows in groups that keep 16 accumulators.
  constexpr int64_t G = 16 / V < kRows ? 16 / V : kRows;
  for (int64_t g = 0; g < q_len; g += G) {
    const int64_t gr = std::min(G, q_len - g);
    __m512 acc[G][V];
    for (int64_t r = 0; r < G; ++r)
      for (int64_t c = 0; c < V; ++c) acc[r][c] = _mm512_setzero_ps();
    const float* pg = s + g * Lp;
    for (int64_t j = 0; j < len; ++j) {
      __m512 vv[V];
      for (int64_t c = 0; c < V; ++c) vv[c] = _mm512_loadu_ps(vb + j * D + 16 * c);
      for (int64_t r = 0; r < G; ++r) {
        const __m512 p = _mm512_set1_ps(pg[r * Lp + j]);
        for (int64_t c = 0; c < V; ++c) acc[r][c] = _mm512_fmadd_ps(p, vv[c], acc[r][c]);
      }
    }
    for (int64_t r = 0; r < gr; ++r) {
      const __m512 w = _mm512_set1_ps(inv[g + r]);
      T* o = out + (out_start + g + r) * H * D + h * D;
      for (int64_t c = 0; c < V; ++c) store16(o + 16 * c, _mm512_mul_ps(acc[r][c], w));
    }
  }
}

#include "cpu_encoder_attention_amx.h"  // the AMX-bf16 path (attend_amx)

View as_view(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1, name,
              " must be a [rows, heads, head_dim] view with contiguous head_dim");
  TORCH_CHECK(t.scalar_type() == q.scalar_type() && t.size(0) == q.size(0) && t.size(2) == q.size(2),
              name, ": same dtype, rows and head_dim as q");
  return View{t.data_ptr(), t.stride(0), t.stride(1), t.size(1)};
}

void encoder_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& starts, const at::Tensor& lens, const at::Tensor& out_starts,
                       bool first_only, double scale, const c10::optional<at::Tensor>& bias,
                       int64_t bias_offset, const c10::optional<at::Tensor>& key_lens,
                       int64_t matmul, at::Tensor out) {
  TORCH_CHECK(matmul >= kFloat32 && matmul <= kBf16x3,
              "matmul: 0 (float32), 1 (bf16) or 2 (bf16x3), got ", matmul);
  // Where AMX-bf16 is missing, the AVX-512 float32 path (amx_bf16_available() says which).
  const Matmul mode = amx_ready() ? static_cast<Matmul>(matmul) : kFloat32;
  const View qv = as_view(q, "q", q), kv = as_view(k, "k", q), vv = as_view(v, "v", q);
  TORCH_CHECK(kv.heads == vv.heads && kv.heads >= 1 && qv.heads % kv.heads == 0,
              "k and v need the same number of heads, dividing q's");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == q.scalar_type() &&
                  out.dim() == 2 && out.size(1) == q.size(1) * q.size(2),
              "out: contiguous [rows, heads * head_dim] in q's dtype");
  TORCH_CHECK(starts.scalar_type() == at::kLong && lens.scalar_type() == at::kLong &&
                  out_starts.scalar_type() == at::kLong,
              "starts, lens, out_starts must be int64");
  const int64_t D = q.size(2);
  const int64_t num_seqs = starts.size(0);
  TORCH_CHECK(lens.size(0) == num_seqs && out_starts.size(0) == num_seqs,
              "starts, lens and out_starts need one entry per sequence");
  const int64_t* ln = lens.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* os = out_starts.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK(ln[i] >= 1 && ln[i] <= kMaxSeqLen && st[i] >= 0 && st[i] + ln[i] <= q.size(0),
                "sequence ", i, ": rows ", st[i], " + ", ln[i], " outside q's ", q.size(0),
                " rows, or a length outside 1..", kMaxSeqLen);
    TORCH_CHECK(os[i] >= 0 && os[i] + (first_only ? 1 : ln[i]) <= out.size(0), "sequence ", i,
                ": output rows outside out's ", out.size(0));
  }
  const int64_t* key_lens_ptr = nullptr;
  if (key_lens.has_value()) {
    const at::Tensor& kl = *key_lens;
    TORCH_CHECK(kl.scalar_type() == at::kLong && kl.is_contiguous() && kl.dim() == 1 &&
                    kl.size(0) == num_seqs,
                "key_lens: contiguous int64 with one entry per sequence");
    key_lens_ptr = kl.data_ptr<int64_t>();
    for (int64_t i = 0; i < num_seqs; ++i)
      TORCH_CHECK(key_lens_ptr[i] >= 1 && key_lens_ptr[i] <= ln[i], "sequence ", i, ": key_lens ",
                  key_lens_ptr[i], " outside 1..", ln[i], " (its length)");
  }
  const float* bias_ptr = nullptr;
  int64_t bias_width = 0;
  if (bias.has_value()) {
    // Columns the tiles read: j - i + offset for i in [0, 8 * ceil(q_len / 8)), j in [0, Lp).
    int64_t longest = 0;
    for (int64_t i = 0; i < num_seqs; ++i) longest = std::max(longest, ln[i]);
    const at::Tensor& b = *bias;
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.is_contiguous() && b.dim() == 2 &&
                    b.size(0) == q.size(1),
                "bias: contiguous float32 [heads, width]");
    TORCH_CHECK(bias_offset >= longest - 1 + kRows - 1 &&
                    b.size(1) >= bias_offset + (longest + 31) / 32 * 32,
                "bias: offset ", bias_offset, " and width ", b.size(1),
                " leave too little slack for sequences of ", longest, " tokens");
    bias_ptr = b.data_ptr<float>() + bias_offset;
    bias_width = b.size(1);
  }
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || q.scalar_type() == at::kFloat, "float32 or bfloat16 only");
#define TP_RUN(T, DIM, KEYS)                                                                  \
  run<T, DIM, KEYS>(qv, kv, vv, starts, lens, out_starts, first_only, scale, bias_ptr,        \
                    bias_width, key_lens_ptr, mode, out)
#define TP_CASE(DIM)                                                                          \
  if (D == DIM) {                                                                             \
    if (bf16)                                                                                 \
      key_lens_ptr ? TP_RUN(c10::BFloat16, DIM, true) : TP_RUN(c10::BFloat16, DIM, false);    \
    else                                                                                      \
      key_lens_ptr ? TP_RUN(float, DIM, true) : TP_RUN(float, DIM, false);                    \
    return;                                                                                   \
  }
  TP_CASE(32)
  TP_CASE(64)
  TP_CASE(128)
#undef TP_CASE
#undef TP_RUN
  TORCH_CHECK(false, "head_dim must be 32, 64 or 128, got ", D);
}

}  // namespace

#ifndef TP_NS
#define TP_NS tidepool_cpu
#endif

TORCH_LIBRARY(TP_NS, m) {
  m.def(
      "encoder_attention(Tensor q, Tensor k, Tensor v, Tensor starts, Tensor lens, "
      "Tensor out_starts, bool first_only, float scale, Tensor? bias, int bias_offset, "
      "Tensor? key_lens, int matmul, Tensor(a!) out) -> ()");
  m.def("amx_bf16_available() -> bool", &amx_ready);
}

TORCH_LIBRARY_IMPL(TP_NS, CPU, m) { m.impl("encoder_attention", &encoder_attention); }
