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
// window's blocks. float32 or bfloat16 (computed in float32), AVX2 + FMA (no AVX-512 needed);
// parallel over tasks with ATen's parallel_for. Loaded by attention/cpu_paged_decode.py.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// ---------------------------------------------------------------- 8-wide loads, float32 math

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0 (scores minus their max), Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a
// degree-5 polynomial for e^r (relative error ~1 ulp), 2^n through the exponent bits. Inputs
// below -87.3 (where 2^n would leave the normal range) give ~1e-38, i.e. nothing beside the max.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                             _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float exp1(float x) {
  return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x)));
}

// Soft-capping of one score: cap * tanh(s / cap), with libm's tanh (only Gemma 2 pays it).
inline float softcap1(float s, float cap) { return cap * std::tanh(s / cap); }

// ---------------------------------------------------------------- one task

struct Args {
  int64_t D, G, Hkv, block_size, num_blocks, window, table_width;
  int64_t q_stride_t, q_stride_h;  // elements
  float scale, cap;                // cap 0: no soft-capping
};

// acc[d] += p * v[d]
template <typename T>
inline void axpy(float* acc, float p, const T* v, int64_t D) {
  const __m256 pp = _mm256_set1_ps(p);
  for (int64_t d = 0; d < D; d += 8)
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pp, load8(v + d), _mm256_loadu_ps(acc + d)));
}

inline float dot(const float* q, const float* k, int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), a1);
  }
  if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
  return hsum(_mm256_add_ps(a0, a1));
}

inline float dot(const float* q, const c10::BFloat16* k, int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(k + d + 8), a1);
  }
  if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a0);
  return hsum(_mm256_add_ps(a0, a1));
}

inline void store_row(float* dst, const float* src, float mul, int64_t D) {
  const __m256 m = _mm256_set1_ps(mul);
  for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(src + d), m));
}

inline void store_row(c10::BFloat16* dst, const float* src, float mul, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = c10::BFloat16(src[d] * mul);
}

// Scratch of one thread: queries [M, D] (float32, scaled), scores [M, N], accumulators [M, D].
struct Scratch {
  std::vector<float> q, s, acc;
};

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
    for (int64_t j = 0; j < count; ++j, k += D) {
      const int64_t col = key - lo + j;
      for (int64_t m = 0; m < M; ++m) s[m * N + col] = dot(buf.q.data() + m * D, k, D);
    }
    key += count;
  }
  // Softmax per query over its visible keys [begin, end) of the buffer; the rest get 0.
  std::vector<float> inv_sum(M);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t pos = first_pos + m / G;
    const int64_t begin = (a.window > 0 ? std::max<int64_t>(pos - a.window + 1, 0) : 0) - lo;
    const int64_t end = pos + 1 - lo;
    float* row = s + m * N;
    if (a.cap > 0.f)
      for (int64_t j = begin; j < end; ++j) row[j] = softcap1(row[j], a.cap);
    __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t j = begin;
    for (; j + 8 <= end; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(row + j));
    float mx = hmax(vmax);
    for (; j < end; ++j) mx = std::max(mx, row[j]);
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (j = begin; j + 8 <= end; j += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), vm));
      _mm256_storeu_ps(row + j, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    for (; j < end; ++j) {
      row[j] = exp1(row[j] - mx);
      sum += row[j];
    }
    for (j = 0; j < begin; ++j) row[j] = 0.f;
    for (j = end; j < N; ++j) row[j] = 0.f;
    inv_sum[m] = 1.f / sum;
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
                inv_sum[m], D);
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
  at::parallel_for(0, R * Hkv, 1, [&](int64_t begin, int64_t end) {
    Scratch buf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / Hkv, h = task % Hkv;
      attend_task<T>(a, qp, cp, tp + r * a.table_width, seq_lens[r], q_starts[r], q_lens[r], h,
                     op, out_stride, buf);
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

TORCH_LIBRARY(tidepool_paged, m) {
  m.def(
      "paged_decode(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_starts, Tensor query_lens, int window, float scale, float softcap, "
      "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tidepool_paged, CPU, m) { m.impl("paged_decode", &paged_decode); }
