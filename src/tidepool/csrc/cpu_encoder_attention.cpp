// Bidirectional attention over packed, variable-length sequences on CPU (AVX-512).
//
// One task is one (sequence, head). Its keys are packed transposed and its values packed
// contiguous, both in float32, into per-thread scratch; queries run in tiles of kRows rows: the
// scores of a tile against every key stay in a [kRows, L] scratch (L1/L2-resident for encoder
// lengths), are soft-maxed in place with a vectorised exp, and multiplied by the values. No mask
// and no padding: each sequence attends to exactly its own tokens. Tasks are taken from a shared
// counter, longest sequence first, so the threads finish together.
//
// Why by hand: PyTorch's CPU flash-attention kernel tiles the work into many small GEMM calls,
// which for 32- and 64-wide heads run at 25-60 GFLOP/s here; see docs/performance.md.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kRows = 8;  // query rows per tile

// exp(x) for x <= 0 (scores minus the row's maximum): 2^n * p(r), r = x - n ln2, |r| <= ln2/2,
// degree-6 polynomial; relative error ~2e-7, underflows to 0 below -87.
inline __m512 exp_ps(__m512 x) {
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

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  // Round to nearest even, as torch's float -> bfloat16 conversion does (no NaN inputs here).
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

struct Scratch {
  std::vector<float> kt;      // [Lp / 32, D, 32] keys, transposed in blocks of 32
  std::vector<float> v;       // [Lp, D] values
  std::vector<float> q;       // [kRows, D] one query tile
  std::vector<float> s;       // [kRows, Lp] scores, then probabilities
};

// One (sequence, head): rows [start, start + len) of qkv ([rows, 3, H, D], row stride 3 H D).
// Query rows 0 .. q_len-1 of the sequence are written to out rows out_start + i (row stride H D).
template <typename T, int64_t D>
void attend(const T* qkv, int64_t H, int64_t start, int64_t len, int64_t q_len, int64_t h,
            float scale, T* out, int64_t out_start, Scratch& sc) {
  constexpr int64_t V = D / 16;  // vectors per head row
  const int64_t row = 3 * H * D;
  const int64_t Lp = (len + 31) / 32 * 32;
  sc.kt.resize(D * Lp);
  sc.v.resize(Lp * D);
  sc.q.resize(kRows * D);
  sc.s.resize(kRows * Lp);
  float* kt = sc.kt.data();
  float* vb = sc.v.data();
  const T* base = qkv + start * row + h * D;
  for (int64_t j = 0; j < len; ++j) {
    const T* k = base + j * row + H * D;
    const T* v = base + j * row + 2 * H * D;
    float* ktj = kt + (j / 32) * D * 32 + j % 32;
    for (int64_t d = 0; d < D; ++d) ktj[d * 32] = to_float(k[d]);
    for (int64_t c = 0; c < V; ++c) store16(vb + j * D + 16 * c, load16(v + 16 * c));
  }
  for (int64_t j = len; j < Lp; ++j) {
    float* ktj = kt + (j / 32) * D * 32 + j % 32;
    for (int64_t d = 0; d < D; ++d) ktj[d * 32] = 0.0f;
    for (int64_t d = 0; d < D; ++d) vb[j * D + d] = 0.0f;
  }
  float* qb = sc.q.data();
  float* s = sc.s.data();
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t i0 = 0; i0 < q_len; i0 += kRows) {
    const int64_t rows = std::min(kRows, q_len - i0);
    for (int64_t r = 0; r < kRows; ++r) {
      if (r < rows) {
        const T* q = base + (i0 + r) * row;
        for (int64_t c = 0; c < V; ++c)
          store16(qb + r * D + 16 * c, _mm512_mul_ps(load16(q + 16 * c), vscale));
      } else {
        for (int64_t d = 0; d < D; ++d) qb[r * D + d] = 0.0f;
      }
    }
    // Scores: [kRows, 32] register tiles over the keys.
    for (int64_t j = 0; j < Lp; j += 32) {
      __m512 acc[kRows][2];
      for (int64_t r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      const float* ktb = kt + j * D;  // block j / 32: [D, 32]
      for (int64_t d = 0; d < D; ++d) {
        const __m512 k0 = _mm512_loadu_ps(ktb + d * 32);
        const __m512 k1 = _mm512_loadu_ps(ktb + d * 32 + 16);
        for (int64_t r = 0; r < kRows; ++r) {
          const __m512 qv = _mm512_set1_ps(qb[r * D + d]);
          acc[r][0] = _mm512_fmadd_ps(qv, k0, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(qv, k1, acc[r][1]);
        }
      }
      for (int64_t r = 0; r < kRows; ++r) {
        _mm512_storeu_ps(s + r * Lp + j, acc[r][0]);
        _mm512_storeu_ps(s + r * Lp + j + 16, acc[r][1]);
      }
    }
    // Softmax per row over the len real keys; padded keys get probability 0.
    float inv[kRows];
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = s + r * Lp;
      __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      int64_t j = 0;
      for (; j + 16 <= len; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sr + j));
      const __mmask16 tail = static_cast<__mmask16>((1u << (len - j)) - 1u);
      if (j < len) m = _mm512_mask_max_ps(m, tail, m, _mm512_loadu_ps(sr + j));
      const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
      __m512 sum = _mm512_setzero_ps();
      for (j = 0; j + 16 <= len; j += 16) {
        const __m512 p = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + j), mx));
        _mm512_storeu_ps(sr + j, p);
        sum = _mm512_add_ps(sum, p);
      }
      if (j < len) {
        const __m512 p = _mm512_maskz_mov_ps(tail, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + j), mx)));
        _mm512_storeu_ps(sr + j, p);
        sum = _mm512_add_ps(sum, p);
        j += 16;
      }
      inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    // Output: rows in groups that keep 16 accumulators.
    constexpr int64_t G = 16 / V < kRows ? 16 / V : kRows;
    for (int64_t g = 0; g < rows; g += G) {
      const int64_t gr = std::min(G, rows - g);
      __m512 acc[G][V];
      for (int64_t r = 0; r < G; ++r)
        for (int64_t c = 0; c < V; ++c) acc[r][c] = _mm512_setzero_ps();
      for (int64_t j = 0; j < len; ++j) {
        __m512 vv[V];
        for (int64_t c = 0; c < V; ++c) vv[c] = _mm512_loadu_ps(vb + j * D + 16 * c);
        for (int64_t r = 0; r < G; ++r) {
          const __m512 p = _mm512_set1_ps(s[(g + r) * Lp + j]);
          for (int64_t c = 0; c < V; ++c) acc[r][c] = _mm512_fmadd_ps(p, vv[c], acc[r][c]);
        }
      }
      for (int64_t r = 0; r < gr; ++r) {
        const __m512 w = _mm512_set1_ps(inv[g + r]);
        T* o = out + (out_start + i0 + g + r) * H * D + h * D;
        for (int64_t c = 0; c < V; ++c) store16(o + 16 * c, _mm512_mul_ps(acc[r][c], w));
      }
    }
  }
}

template <typename T, int64_t D>
void run(const at::Tensor& qkv, const at::Tensor& starts, const at::Tensor& lens,
         const at::Tensor& out_starts, bool first_only, double scale, at::Tensor& out) {
  const int64_t H = qkv.size(2);
  const int64_t num_seqs = starts.size(0);
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  const int64_t* os = out_starts.data_ptr<int64_t>();
  const T* q = reinterpret_cast<const T*>(qkv.data_ptr());
  T* o = reinterpret_cast<T*>(out.data_ptr());
  // Longest sequences first, so the last tasks taken are the short ones.
  std::vector<int64_t> order(num_seqs);
  for (int64_t i = 0; i < num_seqs; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ln[a] > ln[b]; });
  const int64_t num_tasks = num_seqs * H;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  at::parallel_for(0, workers, 1, [&](int64_t b, int64_t e) {
    Scratch sc;
    for (int64_t w = b; w < e; ++w) {
      for (int64_t t = next.fetch_add(1); t < num_tasks; t = next.fetch_add(1)) {
        const int64_t i = order[t / H];
        const int64_t len = ln[i];
        attend<T, D>(q, H, st[i], len, first_only ? 1 : len, t % H, static_cast<float>(scale), o,
                     os[i], sc);
      }
    }
  });
}

void encoder_attention(const at::Tensor& qkv, const at::Tensor& starts, const at::Tensor& lens,
                       const at::Tensor& out_starts, bool first_only, double scale, at::Tensor out) {
  TORCH_CHECK(qkv.dim() == 4 && qkv.size(1) == 3 && qkv.is_contiguous(),
              "qkv must be a contiguous [rows, 3, heads, head_dim] tensor");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == qkv.scalar_type(), "out: contiguous, qkv's dtype");
  TORCH_CHECK(starts.scalar_type() == at::kLong && lens.scalar_type() == at::kLong &&
                  out_starts.scalar_type() == at::kLong,
              "starts, lens, out_starts must be int64");
  const int64_t D = qkv.size(3);
  const bool bf16 = qkv.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || qkv.scalar_type() == at::kFloat, "float32 or bfloat16 only");
#define TP_CASE(DIM)                                                                   \
  if (D == DIM) {                                                                      \
    if (bf16) run<c10::BFloat16, DIM>(qkv, starts, lens, out_starts, first_only, scale, out); \
    else run<float, DIM>(qkv, starts, lens, out_starts, first_only, scale, out);       \
    return;                                                                            \
  }
  TP_CASE(32)
  TP_CASE(64)
  TP_CASE(128)
#undef TP_CASE
  TORCH_CHECK(false, "head_dim must be 32, 64 or 128, got ", D);
}

}  // namespace

TORCH_LIBRARY(tidepool_cpu, m) {
  m.def(
      "encoder_attention(Tensor qkv, Tensor starts, Tensor lens, Tensor out_starts, bool first_only, "
      "float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tidepool_cpu, CPU, m) { m.impl("encoder_attention", &encoder_attention); }
