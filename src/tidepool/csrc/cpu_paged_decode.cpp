// tidepool's CPU decode attention over the paged KV cache, reading the cache blocks in place.
//
// Rows of one step whose queries are few (a decode's one token, a handful of speculative or short
// prompt tokens) attend here, each to its own keys, straight from the cache:
//
//   kv_cache [2, Hkv, num_blocks, block_size, D]   (K = [0], V = [1]; attention/paged.py)
//   row r: queries query[query_starts[r] + i], i < query_lens[r], at positions
//          seq_lens[r] - query_lens[r] + i; keys 0 .. seq_lens[r] - 1 through block_table[r]
//   key k is visible to the query at position p when k <= p and (no window or k > p - window)
//
// One task per (row, KV head): its G = Hq / Hkv query heads times the row's queries are M query
// vectors that share every key and value they read (GQA), so each K / V row is loaded once per
// task. Two passes over the visible keys: scores (q . k * scale, Gemma 2's cap * tanh(s / cap)),
// an exact softmax per query (max, exp, sum: the same order of operations as SDPA's), then P . V.
// A sliding window starts at the block of the row's first visible key, so it reads only its
// window's blocks. float32 or bfloat16 (computed in float32); parallel over tasks with ATen's
// parallel_for.
//
// One source, built per ISA (csrc/cpu_simd.h: TP_ISA_AVX512, 16 lanes, or TP_ISA_AVX2, 8 lanes;
// the op namespace TP_NS per build). Head sizes are multiples of 8: under AVX-512 a head of
// 16k + 8 floats takes one masked half vector at its end. Loaded by attention/cpu_paged_decode.py.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_simd.h"

namespace {

// ---------------------------------------------------------------- ISA-specific helpers

#if defined(TP_ISA_AVX512)
// The first n (< kW) lanes of p, the others 0.
TP_INLINE vf load_part(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(lanes(n), p); }
TP_INLINE vf load_part(const c10::BFloat16* p, int64_t n) {
  const __m256i raw = _mm256_maskz_loadu_epi16(lanes(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
TP_INLINE vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
TP_INLINE vf vor_sign(vf magnitude, vf sign_of) {  // |magnitude| with sign_of's sign
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(sign_of), _mm512_set1_epi32(INT32_MIN));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(magnitude), sign));
}
TP_INLINE vf vselect_lt(vf a, vf b, vf if_lt, vf otherwise) {  // a < b ? if_lt : otherwise
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), otherwise, if_lt);
}
#else
// AVX2's vector is 8 floats and head sizes are multiples of 8: never a part vector.
TP_INLINE vf load_part(const float* p, int64_t) { return vload(p); }
TP_INLINE vf load_part(const c10::BFloat16* p, int64_t) { return vload(p); }
TP_INLINE vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
TP_INLINE vf vor_sign(vf magnitude, vf sign_of) {
  const __m256 sign = _mm256_and_ps(sign_of, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN)));
  return _mm256_or_ps(magnitude, sign);
}
TP_INLINE vf vselect_lt(vf a, vf b, vf if_lt, vf otherwise) {
  return _mm256_blendv_ps(otherwise, if_lt, _mm256_cmp_ps(a, b, _CMP_LT_OQ));
}
#endif

// tanh(x), Cephes' tanhf in vector form: |x| < 0.625 an odd polynomial (no cancellation near 0),
// else (1 - t) / (1 + t) with t = e^(-2|x|) <= 0.29 (exp_ps takes x <= 0); ~2 ulp, as libm's.
TP_INLINE vf tanh_ps(vf x) {
  const vf ax = vabs(x);
  const vf z = vmul(x, x);
  vf p = vset1(-5.70498872745e-3f);
  p = vfmadd(p, z, vset1(2.06390887954e-2f));
  p = vfmadd(p, z, vset1(-5.37397155531e-2f));
  p = vfmadd(p, z, vset1(1.33314422036e-1f));
  p = vfmadd(p, z, vset1(-3.33332819422e-1f));
  const vf small = vfmadd(vmul(p, z), x, x);
  const vf t = exp_ps(vmul(ax, vset1(-2.f)));
  const vf large = vor_sign(vdiv(vsub(vset1(1.f), t), vadd(vset1(1.f), t)), x);
  return vselect_lt(ax, vset1(0.625f), small, large);
}

// ---------------------------------------------------------------- one task

struct Args {
  int64_t D, G, Hkv, block_size, num_blocks, window, table_width;
  int64_t q_stride_t, q_stride_h;  // elements
  float scale, cap;                // cap 0: no soft-capping
};

// Scratch of one thread: queries [M, D] (float32, scaled), scores [M, N], accumulators [M, D].
struct Scratch {
  std::vector<float> q, s, acc, inv_sum;
};

// s[m * N] = q_m . k for the M queries (rows of q, D floats each) against one key row.
template <typename T>
TP_INLINE void scores_of_key(const float* q, const T* k, int64_t M, int64_t D, float* s,
                             int64_t N) {
  const int64_t full = D / kW * kW;
  for (int64_t m = 0; m < M; ++m, q += D) {
    vf a0 = vzero(), a1 = vzero();
    int64_t d = 0;
    for (; d + 2 * kW <= full; d += 2 * kW) {
      a0 = vfmadd(vloadu(q + d), vload(k + d), a0);
      a1 = vfmadd(vloadu(q + d + kW), vload(k + d + kW), a1);
    }
    if (d < full) a0 = vfmadd(vloadu(q + d), vload(k + d), a0);
    if (full < D) a1 = vfmadd(load_part(q + full, D - full), load_part(k + full, D - full), a1);
    s[m * N] = vreduce_add(vadd(a0, a1));
  }
}

// acc[d] += p * v[d] over D (acc has D floats; the part vector's other lanes add 0).
template <typename T>
TP_INLINE void axpy(float* acc, float p, const T* v, int64_t D) {
  const vf pp = vset1(p);
  const int64_t full = D / kW * kW;
  for (int64_t d = 0; d < full; d += kW) vstoreu(acc + d, vfmadd(pp, vload(v + d), vloadu(acc + d)));
  if (full < D) {
    const vmask m = lanes(D - full);
    vstore_masked(acc + full, m, vfmadd(pp, load_part(v + full, D - full), vload_masked(acc + full, m)));
  }
}

inline void store_row(float* dst, const float* src, float mul, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * mul;
}

inline void store_row(c10::BFloat16* dst, const float* src, float mul, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = c10::BFloat16(src[d] * mul);
}

// Row `s[begin, end)` (the visible keys of one query) → exp(s - max) in place, the rest of its N
// entries 0; returns 1 / sum. Soft-capping first where cap > 0.
inline float softmax_row(float* s, int64_t begin, int64_t end, int64_t N, float cap) {
  if (cap > 0.f) {
    const vf c = vset1(cap), inv_c = vset1(1.f / cap);
    int64_t j = begin;
    for (; j + kW <= end; j += kW) vstoreu(s + j, vmul(c, tanh_ps(vmul(vloadu(s + j), inv_c))));
    if (j < end) {
      const vmask m = lanes(end - j);
      vstore_masked(s + j, m, vmul(c, tanh_ps(vmul(vload_masked(s + j, m), inv_c))));
    }
  }
  vf vm = vset1(-std::numeric_limits<float>::infinity());
  int64_t j = begin;
  for (; j + kW <= end; j += kW) vm = vmax(vm, vloadu(s + j));
  if (j < end) vm = vmask_max(vm, lanes(end - j), vload_masked(s + j, lanes(end - j)));
  const vf mx = vset1(vreduce_max(vm));
  vf sum = vzero();
  for (j = begin; j + kW <= end; j += kW) {
    const vf e = exp_ps(vsub(vloadu(s + j), mx));
    vstoreu(s + j, e);
    sum = vadd(sum, e);
  }
  if (j < end) {
    const vmask m = lanes(end - j);
    const vf e = vmaskz(m, exp_ps(vsub(vload_masked(s + j, m), mx)));
    vstore_masked(s + j, m, e);
    sum = vadd(sum, e);
  }
  std::fill(s, s + begin, 0.f);
  std::fill(s + end, s + N, 0.f);
  return 1.f / vreduce_add(sum);
}

// Row r, KV head h. `seq_len` keys, queries at positions seq_len - qlen .. seq_len - 1.
template <typename T>
void attend_task(const Args& a, const T* query, const T* cache, const int32_t* table,
                 int64_t seq_len, int64_t q_start, int64_t qlen, int64_t h, T* out,
                 int64_t out_stride, Scratch& buf) {
  const int64_t D = a.D, G = a.G, M = G * qlen, BS = a.block_size;
  const int64_t first_pos = seq_len - qlen;
  // Keys [lo, seq_len) cover every query's window; query i sees [lo_i, first_pos + i].
  const int64_t lo = a.window > 0 ? std::max<int64_t>(first_pos - a.window + 1, 0) : 0;
  const int64_t N = seq_len - lo;
  buf.q.resize(M * D);
  buf.s.resize(M * N);
  buf.acc.assign(M * D, 0.f);
  buf.inv_sum.resize(M);
  // Query vectors m = i * G + g in float32, times the scale (so scores need no multiply).
  for (int64_t i = 0; i < qlen; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const T* src = query + (q_start + i) * a.q_stride_t + (h * G + g) * a.q_stride_h;
      float* dst = buf.q.data() + (i * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * a.scale;
    }
  const int64_t plane = a.Hkv * a.num_blocks * BS * D;  // K | V
  const T* k_head = cache + h * a.num_blocks * BS * D;
  const T* v_head = k_head + plane;
  // Pass 1: scores of every query against keys lo .. seq_len - 1, block by block.
  float* s = buf.s.data();
  for (int64_t key = lo; key < seq_len;) {
    const int64_t block = key / BS, offset = key % BS;
    const int64_t count = std::min(BS - offset, seq_len - key);
    const T* k = k_head + (static_cast<int64_t>(table[block]) * BS + offset) * D;
    for (int64_t j = 0; j < count; ++j, k += D)
      scores_of_key(buf.q.data(), k, M, D, s + (key - lo + j), N);
    key += count;
  }
  // Softmax per query over its visible keys [begin, end) of the buffer; the rest get 0.
  for (int64_t m = 0; m < M; ++m) {
    const int64_t pos = first_pos + m / G;
    const int64_t begin = (a.window > 0 ? std::max<int64_t>(pos - a.window + 1, 0) : 0) - lo;
    buf.inv_sum[m] = softmax_row(s + m * N, begin, pos + 1 - lo, N, a.cap);
  }
  // Pass 2: acc[m] = sum_j p[m, j] v_j, block by block (each V row loaded once for all M).
  for (int64_t key = lo; key < seq_len;) {
    const int64_t block = key / BS, offset = key % BS;
    const int64_t count = std::min(BS - offset, seq_len - key);
    const T* v = v_head + (static_cast<int64_t>(table[block]) * BS + offset) * D;
    for (int64_t j = 0; j < count; ++j, v += D) {
      const int64_t col = key - lo + j;
      for (int64_t m = 0; m < M; ++m) {
        const float p = s[m * N + col];
        if (p != 0.f) axpy(buf.acc.data() + m * D, p, v, D);
      }
    }
    key += count;
  }
  for (int64_t i = 0; i < qlen; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t m = i * G + g;
      store_row(out + (q_start + i) * out_stride + (h * G + g) * D, buf.acc.data() + m * D,
                buf.inv_sum[m], D);
    }
}

// ---------------------------------------------------------------- rows of many queries
//
// A row of many queries (a prompt chunk) is GEMM-shaped: its keys are transposed once per task
// into chunks of kW keys, Kt [chunk][D][kW] (float32), so that scores come out kW keys per vector
// with the queries broadcast (kMB query vectors per register block, no horizontal sums); P . V
// runs 4 query vectors x 4 vectors of D per register block. Queries go in tiles of kQueryTile:
// each tile's scores span only the keys some query of it sees (its window, the causal end), so
// a sliding-window layer reads W + kQueryTile keys per tile, not the whole row. Heads must be a
// multiple of 4 * kW floats (64 / 128 / 256); others take attend_task.

constexpr int64_t kQueryTile = 32;
constexpr int64_t kMB = 8;
constexpr int64_t kLongMinQueries = 8;  // rows of at least this many queries take attend_long

struct LongScratch {
  std::vector<float> kt, q, s, inv_sum;
  std::vector<int64_t> offset;  // element offset of key j's row in the K plane (V: + plane)
};

template <typename T>
void transpose_keys(const T* k_head, const int64_t* offset, int64_t N, int64_t D, float* kt) {
  for (int64_t c = 0; c * kW < N; ++c) {
    const int64_t cnt = std::min<int64_t>(kW, N - c * kW);
    for (int64_t dd = 0; dd < D; dd += kW) {
      vf r[kW];
      for (int64_t j = 0; j < kW; ++j) r[j] = j < cnt ? vload(k_head + offset[c * kW + j] + dd) : vzero();
      transpose(r);
      for (int64_t i = 0; i < kW; ++i) vstoreu(kt + (c * D + dd + i) * kW, r[i]);
    }
  }
}

// s[m * ld + c * kW + j] = q_m . key (chunk c, lane j) for m < M, chunks [0, C) of kt.
inline void tile_scores(const float* q, const float* kt, int64_t M, int64_t C, int64_t D,
                        float* s, int64_t ld) {
  for (int64_t c = 0; c < C; ++c) {
    const float* ktc = kt + c * D * kW;
    int64_t m = 0;
    for (; m + kMB <= M; m += kMB) {
      vf acc[kMB];
      for (int64_t r = 0; r < kMB; ++r) acc[r] = vzero();
      const float* qm = q + m * D;
      for (int64_t d = 0; d < D; ++d) {
        const vf k = vloadu(ktc + d * kW);
#pragma GCC unroll 8
        for (int64_t r = 0; r < kMB; ++r) acc[r] = vfmadd(vset1(qm[r * D + d]), k, acc[r]);
      }
      for (int64_t r = 0; r < kMB; ++r) vstoreu(s + (m + r) * ld + c * kW, acc[r]);
    }
    for (; m < M; ++m) {
      vf acc = vzero();
      for (int64_t d = 0; d < D; ++d) acc = vfmadd(vset1(q[m * D + d]), vloadu(ktc + d * kW), acc);
      vstoreu(s + m * ld + c * kW, acc);
    }
  }
}

// out row of query vector m (of M) = inv_sum[m] * sum_{j in [j0, j1)} p[m, j] V_j, with V_j at
// v_head + offset[j]; 4 query vectors x 4 vectors of D per register block.
template <typename T>
void tile_values(const float* p, int64_t ld, const float* inv_sum, int64_t M, int64_t j0,
                 int64_t j1, const T* v_head, const int64_t* offset, int64_t D,
                 T* const* out_rows) {
  for (int64_t m = 0; m < M; m += 4) {
    const float* pr[4];
    for (int64_t r = 0; r < 4; ++r) pr[r] = p + std::min(m + r, M - 1) * ld;  // repeats: unused
    for (int64_t dv = 0; dv < D; dv += 4 * kW) {
      vf acc[4][4];
      for (int64_t r = 0; r < 4; ++r)
        for (int64_t x = 0; x < 4; ++x) acc[r][x] = vzero();
      for (int64_t j = j0; j < j1; ++j) {
        const T* v = v_head + offset[j] + dv;
        const vf v0 = vload(v), v1 = vload(v + kW), v2 = vload(v + 2 * kW), v3 = vload(v + 3 * kW);
#pragma GCC unroll 4
        for (int64_t r = 0; r < 4; ++r) {
          const vf pp = vset1(pr[r][j]);
          acc[r][0] = vfmadd(pp, v0, acc[r][0]);
          acc[r][1] = vfmadd(pp, v1, acc[r][1]);
          acc[r][2] = vfmadd(pp, v2, acc[r][2]);
          acc[r][3] = vfmadd(pp, v3, acc[r][3]);
        }
      }
      for (int64_t r = 0; r < 4 && m + r < M; ++r) {
        const vf mul = vset1(inv_sum[m + r]);
        for (int64_t x = 0; x < 4; ++x) vstore(out_rows[m + r] + dv + x * kW, vmul(acc[r][x], mul));
      }
    }
  }
}

// Row r, KV head h, as attend_task, for rows of many queries (D a multiple of 4 * kW).
template <typename T>
void attend_long(const Args& a, const T* query, const T* cache, const int32_t* table,
                 int64_t seq_len, int64_t q_start, int64_t qlen, int64_t h, T* out,
                 int64_t out_stride, LongScratch& buf) {
  const int64_t D = a.D, G = a.G, BS = a.block_size, W = a.window;
  const int64_t first_pos = seq_len - qlen;
  const int64_t lo = W > 0 ? std::max<int64_t>(first_pos - W + 1, 0) : 0;
  const int64_t N = seq_len - lo, C = (N + kW - 1) / kW;
  buf.offset.resize(C * kW);
  for (int64_t j = 0; j < N; ++j) {
    const int64_t key = lo + j;
    buf.offset[j] = ((static_cast<int64_t>(table[key / BS]) * BS) + key % BS) * D;
  }
  for (int64_t j = N; j < C * kW; ++j) buf.offset[j] = 0;  // never read (lanes past N are 0)
  const T* k_head = cache + h * a.num_blocks * BS * D;
  const T* v_head = k_head + a.Hkv * a.num_blocks * BS * D;
  buf.kt.resize(C * D * kW);
  transpose_keys(k_head, buf.offset.data(), N, D, buf.kt.data());
  std::vector<T*> out_rows(G * kQueryTile);
  for (int64_t t0 = 0; t0 < qlen; t0 += kQueryTile) {
    const int64_t qt = std::min(kQueryTile, qlen - t0), M = G * qt;
    const int64_t p0 = first_pos + t0;  // the tile's first query position
    // Keys the tile sees, [klo, khi), from chunk c0 on (keys lo + c0 * kW ...).
    const int64_t klo = W > 0 ? std::max<int64_t>(p0 - W + 1, 0) : 0, khi = p0 + qt;
    const int64_t c0 = (klo - lo) / kW, c1 = (khi - lo + kW - 1) / kW;
    const int64_t base = lo + c0 * kW, ld = (c1 - c0) * kW;
    buf.q.resize(M * D);
    buf.s.resize(M * ld);
    buf.inv_sum.resize(M);
    for (int64_t i = 0; i < qt; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const T* src = query + (q_start + t0 + i) * a.q_stride_t + (h * G + g) * a.q_stride_h;
        float* dst = buf.q.data() + (i * G + g) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * a.scale;
        out_rows[i * G + g] = out + (q_start + t0 + i) * out_stride + (h * G + g) * D;
      }
    tile_scores(buf.q.data(), buf.kt.data() + c0 * D * kW, M, c1 - c0, D, buf.s.data(), ld);
    for (int64_t m = 0; m < M; ++m) {
      const int64_t pos = p0 + m / G;
      const int64_t begin = (W > 0 ? std::max<int64_t>(pos - W + 1, 0) : 0) - base;
      buf.inv_sum[m] = softmax_row(buf.s.data() + m * ld, begin, pos + 1 - base, ld, a.cap);
    }
    tile_values(buf.s.data(), ld, buf.inv_sum.data(), M, klo - base, khi - base, v_head,
                buf.offset.data() + c0 * kW, D, out_rows.data());
  }
}

template <typename T>
void run(const Args& a, const at::Tensor& query, const at::Tensor& kv_cache,
         const at::Tensor& block_table, const int32_t* seq_lens, const int32_t* q_starts,
         const int32_t* q_lens, int64_t R, at::Tensor& out) {
  const T* qp = reinterpret_cast<const T*>(query.data_ptr());
  const T* cp = reinterpret_cast<const T*>(kv_cache.data_ptr());
  const int32_t* tp = block_table.data_ptr<int32_t>();
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t out_stride = out.stride(0), Hkv = a.Hkv;
  const bool long_rows = a.D % (4 * kW) == 0;
  at::parallel_for(0, R * Hkv, 1, [&](int64_t begin, int64_t end) {
    Scratch buf;
    LongScratch long_buf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / Hkv, h = task % Hkv;
      if (long_rows && q_lens[r] >= kLongMinQueries)
        attend_long<T>(a, qp, cp, tp + r * a.table_width, seq_lens[r], q_starts[r], q_lens[r],
                       h, op, out_stride, long_buf);
      else
        attend_task<T>(a, qp, cp, tp + r * a.table_width, seq_lens[r], q_starts[r], q_lens[r],
                       h, op, out_stride, buf);
    }
  });
}

// query: [T, Hq, D] (any token and head strides, D contiguous); kv_cache: contiguous
// [2, Hkv, num_blocks, block_size, D] of query's dtype; block_table: [R, W] int32 contiguous;
// seq_lens / query_starts / query_lens: [R] int32; window: 0 for full attention; softcap: 0 for
// none; out: [T', Hq * D] with contiguous rows: row query_starts[r] + i is written for each query
// of each row, other rows are left as they are.
void paged_decode(const at::Tensor& query, const at::Tensor& kv_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens,
                  const at::Tensor& query_starts, const at::Tensor& query_lens, int64_t window,
                  double scale, double softcap, at::Tensor& out) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache: contiguous [2, Hkv, num_blocks, block_size, D]");
  const auto dtype = kv_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "float32 or bfloat16 only");
  const int64_t Hkv = kv_cache.size(1), NB = kv_cache.size(2), BS = kv_cache.size(3);
  const int64_t D = kv_cache.size(4);
  TORCH_CHECK(D % 8 == 0, "head size must be a multiple of 8, got ", D);
  TORCH_CHECK(query.dim() == 3 && query.size(2) == D && query.stride(2) == 1 &&
                  query.scalar_type() == dtype && query.size(1) % Hkv == 0,
              "query: [T, Hq, D] in the cache's dtype, D contiguous, Hq a multiple of Hkv");
  const int64_t Hq = query.size(1), T = query.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(1) == Hq * D && out.stride(1) == 1 &&
                  out.scalar_type() == dtype,
              "out: [T, Hq * D] with contiguous rows in the cache's dtype");
  TORCH_CHECK(block_table.dim() == 2 && block_table.is_contiguous() &&
                  block_table.scalar_type() == at::kInt,
              "block_table: contiguous int32 [R, W]");
  const int64_t R = block_table.size(0), W = block_table.size(1);
  for (const at::Tensor* t : {&seq_lens, &query_starts, &query_lens})
    TORCH_CHECK(t->dim() == 1 && t->numel() == R && t->is_contiguous() &&
                    t->scalar_type() == at::kInt,
                "seq_lens / query_starts / query_lens: contiguous int32 [R]");
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* qs = query_starts.data_ptr<int32_t>();
  const int32_t* ql = query_lens.data_ptr<int32_t>();
  const int32_t* tp = block_table.data_ptr<int32_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(ql[r] >= 1 && ql[r] <= sl[r] && (sl[r] + BS - 1) / BS <= W,
                "row ", r, ": query_len ", ql[r], ", seq_len ", sl[r], ", table width ", W);
    TORCH_CHECK(qs[r] >= 0 && qs[r] + ql[r] <= T && qs[r] + ql[r] <= out.size(0),
                "row ", r, ": queries out of range");
    const int64_t first = window > 0 ? std::max<int64_t>(sl[r] - ql[r] - window + 1, 0) / BS : 0;
    for (int64_t b = first; b < (sl[r] + BS - 1) / BS; ++b)
      TORCH_CHECK(tp[r * W + b] >= 0 && tp[r * W + b] < NB, "row ", r, ": block id out of range");
  }
  Args a{D,  Hq / Hkv, Hkv, BS, NB, window, W, query.stride(0), query.stride(1),
         static_cast<float>(scale), static_cast<float>(softcap)};
  if (dtype == at::kFloat)
    run<float>(a, query, kv_cache, block_table, sl, qs, ql, R, out);
  else
    run<c10::BFloat16>(a, query, kv_cache, block_table, sl, qs, ql, R, out);
}

}  // namespace

#ifndef TP_NS
#define TP_NS tidepool_paged
#endif

TORCH_LIBRARY(TP_NS, m) {
  m.def(
      "paged_decode(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_starts, Tensor query_lens, int window, float scale, float softcap, "
      "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(TP_NS, CPU, m) { m.impl("paged_decode", &paged_decode); }
