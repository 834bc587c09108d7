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
#include <sys/syscall.h>
#include <unistd.h>

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

// ----------------------------------------------------------------------------- AMX-bf16 path
//
// The same task on AMX tiles: both products, S = Q K^T and O = P V, as bf16 tile multiplies with
// float32 accumulation (TDPBF16PS); scaling, the bias, the softmax and the normalisation stay in
// float32 as above. Matmul::kBf16 rounds Q, K, P and V to bf16 once; kBf16x3 splits each float x
// into hi = bf16(x) + lo = bf16(x - hi) and sums hi.hi + hi.lo + lo.hi (float32-like accuracy for
// 3x the tile work; bf16 inputs have lo = 0, so only P's split is left: 1 + 2 passes).
//
// Layouts (all bf16, per task): queries row-major [Lr, D] (A tiles of 16 rows x 32 dims); keys as
// B tiles, [Lp / 16 key blocks][D / 32 dim steps][16 dim pairs][16 keys][2]; values as B tiles,
// [D / 16 dim blocks][Lp / 32 key steps][16 key pairs][16 dims][2]; probabilities row-major
// [32, Lp]. Queries go in blocks of 32 rows (two A tiles; 16 for a short tail), keys and dims in
// blocks of 32 (two B tiles): 4 accumulator tiles, 8 tiles in all, one configuration.

enum Matmul : int64_t { kFloat32 = 0, kBf16 = 1, kBf16x3 = 2 };

#define TP_AMX __attribute__((target("amx-tile,amx-bf16,avx512bf16")))

constexpr int64_t kTile = 512;  // bf16 elements in one tile (16 rows x 32, 1 KiB)

// Whether this process may use AMX-bf16: the CPU has it and the kernel granted the tile state
// (ARCH_REQ_XCOMP_PERM for XTILEDATA; oneDNN usually asked already, asking again is harmless).
bool amx_ready() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("avx512bf16")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: accumulators C[row block][column block]; 4-5: A (row blocks); 6-7: B (column blocks).
// The configuration is per thread: each worker loads it before its first task.
TP_AMX void amx_begin() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  // Not _tile_loadconfig: gcc 12's macro tells the compiler it reads 8 bytes, so the stores of
  // the rows and widths were dropped (SIGILL on the first tile instruction).
  asm volatile("ldtilecfg %0" ::"m"(cfg));
}

TP_AMX void amx_end() { _tile_release(); }

// The bf16 bits of 16 floats (round to nearest even).
TP_AMX TP_INLINE __m256i bf16_bits(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
TP_AMX TP_INLINE __m512 widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 elements as bf16 hi and lo (lo = bf16(x - hi); zero for bf16 inputs, never read then).
template <typename T>
TP_AMX TP_INLINE void split16(const T* p, bool split, __m256i& hi, __m256i& lo) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_setzero_si256();
  } else {
    const __m512 x = _mm512_loadu_ps(p);
    hi = bf16_bits(x);
    lo = split ? bf16_bits(_mm512_sub_ps(x, widen(hi))) : _mm256_setzero_si256();
  }
}

TP_AMX TP_INLINE __m512i join(__m256i a, __m256i b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

// Into L2: one head row of D elements.
template <typename T>
TP_INLINE void prefetch_row(const T* p, int64_t D) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(c + b, _MM_HINT_T2);
}

// n elements of v starting at a 64-byte boundary: tile rows (64 bytes) then never split a
// cache line.
template <typename E>
E* aligned64(std::vector<E>& v, int64_t n) {
  v.resize(n + 64 / sizeof(E));
  const auto addr = reinterpret_cast<uintptr_t>(v.data());
  return reinterpret_cast<E*>((addr + 63) & ~static_cast<uintptr_t>(63));
}

struct AmxScratch {
  std::vector<uint16_t> q, kb, vb, p;  // each [2][...]: hi, then lo
  std::vector<float> s, o;             // [32, Lp] scores, [32, D] a block's outputs
  float inv[64];
};

// Keys (rows [0, len) of k, zero up to Lp) into B tiles: a 16 x 16 transpose of (key, dim pair)
// 32-bit elements per tile.
template <typename T, int64_t D>
TP_AMX void pack_keys(HeadRows<T> k, int64_t len, int64_t Lp, bool split, uint16_t* hi,
                      uint16_t* lo) {
  constexpr int64_t S = D / 32;
  for (int64_t nb = 0; nb < Lp / 16; ++nb)
    for (int64_t ks = 0; ks < S; ++ks) {
      __m512 rh[16], rl[16];
      for (int64_t n = 0; n < 16; ++n) {
        const int64_t key = nb * 16 + n;
        __m256i h0, l0, h1, l1;
        if (key < len) {
          const T* p = k.ptr + key * k.row + ks * 32;
          split16(p, split, h0, l0);
          split16(p + 16, split, h1, l1);
        } else {
          h0 = l0 = h1 = l1 = _mm256_setzero_si256();
        }
        rh[n] = _mm512_castsi512_ps(join(h0, h1));
        rl[n] = _mm512_castsi512_ps(join(l0, l1));
      }
      const int64_t tile = (nb * S + ks) * kTile;
      transpose16(rh);
      for (int64_t r = 0; r < 16; ++r) _mm512_storeu_ps(hi + tile + r * 32, rh[r]);
      if (split) {
        transpose16(rl);
        for (int64_t r = 0; r < 16; ++r) _mm512_storeu_ps(lo + tile + r * 32, rl[r]);
      }
    }
}

// Values (rows [0, len), zero up to Lp) into B tiles: rows 2r and 2r + 1 of a key step
// interleaved element by element.
template <typename T, int64_t D>
TP_AMX void pack_values(HeadRows<T> v, int64_t len, int64_t Lp, bool split, uint16_t* hi,
                        uint16_t* lo) {
  const int64_t steps = Lp / 32;
  for (int64_t ks = 0; ks < steps; ++ks)
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t k0 = ks * 32 + 2 * r;
      for (int64_t nb = 0; nb < D / 16; ++nb) {
        __m256i h0 = _mm256_setzero_si256(), l0 = h0, h1 = h0, l1 = h0;
        if (k0 < len) split16(v.ptr + k0 * v.row + nb * 16, split, h0, l0);
        if (k0 + 1 < len) split16(v.ptr + (k0 + 1) * v.row + nb * 16, split, h1, l1);
        const int64_t at = (nb * steps + ks) * kTile + r * 32;
        auto pair = [](__m256i a, __m256i b) {
          return _mm512_or_si512(_mm512_cvtepu16_epi32(a),
                                 _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
        };
        _mm512_storeu_si512(hi + at, pair(h0, h1));
        if (split) _mm512_storeu_si512(lo + at, pair(l0, l1));
      }
    }
}

// C[MB x 2 tiles] += sum over `steps` of A[MB row tiles] x B[2 column tiles], for the passes
// hi.hi, then hi.lo (b_lo set), then lo.hi (a_lo set). A row tile i, step t: a + i * 16 * lda
// + t * 32 (lda in elements); B column tile c, step t: b + (c * b_cstride + t) * kTile.
template <int MB>
TP_AMX TP_INLINE void tile_pass(const uint16_t* a, int64_t lda, const uint16_t* b,
                                int64_t b_cstride, int64_t steps) {
  for (int64_t t = 0; t < steps; ++t) {
    _tile_loadd(6, b + t * kTile, 64);
    _tile_loadd(7, b + (b_cstride + t) * kTile, 64);
    _tile_loadd(4, a + t * 32, lda * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (MB == 2) {
      _tile_loadd(5, a + 16 * lda + t * 32, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// One [MB * 16, 32] block of C = A B (bf16, split as above) stored to c (ldc floats per row).
template <int MB>
TP_AMX void tile_block(const uint16_t* a_hi, const uint16_t* a_lo, int64_t lda,
                       const uint16_t* b_hi, const uint16_t* b_lo, int64_t b_cstride,
                       int64_t steps, float* c, int64_t ldc) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (MB == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  tile_pass<MB>(a_hi, lda, b_hi, b_cstride, steps);
  if (b_lo != nullptr) tile_pass<MB>(a_hi, lda, b_lo, b_cstride, steps);
  if (a_lo != nullptr) tile_pass<MB>(a_lo, lda, b_hi, b_cstride, steps);
  _tile_stored(0, c, ldc * 4);
  _tile_stored(1, c + 16, ldc * 4);
  if constexpr (MB == 2) {
    _tile_stored(2, c + 16 * ldc, ldc * 4);
    _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
  }
}

// 2^t in float32: 2^n * p(f), n = round(t), |f| <= 1/2, p a near-minimax polynomial with
// p(0) = 1 (fitted to 2^f's relative error): degree 5 is within 1.1e-7 (exp_ps's accuracy, for
// bf16x3), degree 4 within 2.8e-6 (for bf16, whose P rounding is 2^-9). t is clamped at -100:
// no p below 2^-100 (a weight that small changes nothing), so neither p nor P's lo part
// (a multiple of p's ulp) is ever a denormal, whose handling costs a microcode assist per
// instruction (real attention rows span more than 100 bits of range; random test data does not).
// Lanes outside `keep` are 0.
template <int kDegree>
TP_INLINE __m512 exp2_ps(__m512 t, __mmask16 keep) {
  static_assert(kDegree == 4 || kDegree == 5);
  t = _mm512_max_ps(t, _mm512_set1_ps(-100.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p;
  if constexpr (kDegree == 5) {
    p = _mm512_set1_ps(0.001326472731307149f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.009671512991189957f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05550733581185341f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022242426872253f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931470036506653f));
  } else {
    p = _mm512_set1_ps(0.009582853876054287f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05590642988681793f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024099111557007f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931241750717163f));
  }
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

TP_INLINE __mmask16 first_n(int64_t n) {  // lanes [0, n) of 16
  return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1u);
}

// Softmax of one block's score rows [0, rows) over the len real keys, in float32: exp of the
// scaled scores (plus the bias) against the row maximum, as 2^(c s - c max) with c = scale
// log2(e) folded into one FMA; P written as bf16 hi (and lo) over all Lp columns (zero past
// len), 1 / the row sum into inv. P's rows [rows, 16 * ceil(rows / 16)) are zeroed (the last A
// tile reads them).
template <bool kSplit>
TP_AMX void softmax_block(float* s, int64_t rows, int64_t i0, int64_t len, int64_t Lp,
                          float scale, const float* bias, uint16_t* p_hi, uint16_t* p_lo,
                          float* inv) {
  const float log2e = 1.44269504088896341f;
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * Lp;
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    float c = scale * log2e;
    if (bias == nullptr) {  // scale > 0: the maximum of the raw scores
      for (int64_t j = 0; j < len; j += 16)
        mx = _mm512_mask_max_ps(mx, first_n(len - j), mx, _mm512_loadu_ps(sr + j));
    } else {  // the biased scores, stored for the exp pass
      const float* b = bias - (i0 + r);
      const __m512 vscale = _mm512_set1_ps(scale);
      for (int64_t j = 0; j < len; j += 16) {
        const __m512 t = _mm512_fmadd_ps(_mm512_loadu_ps(sr + j), vscale, _mm512_loadu_ps(b + j));
        _mm512_storeu_ps(sr + j, t);
        mx = _mm512_mask_max_ps(mx, first_n(len - j), mx, t);
      }
      c = log2e;
    }
    const __m512 vc = _mm512_set1_ps(c);
    const __m512 mc = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * c);
    __m512 sum = _mm512_setzero_ps();
    uint16_t* ph = p_hi + r * Lp;
    uint16_t* pl = p_lo + r * Lp;
    int64_t j = 0;
    for (; j < len; j += 16) {
      const __m512 t = _mm512_fmsub_ps(_mm512_loadu_ps(sr + j), vc, mc);
      const __m512 p = exp2_ps<kSplit ? 5 : 4>(t, first_n(len - j));
      const __m256i h = bf16_bits(p);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ph + j), h);
      if constexpr (kSplit)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pl + j), bf16_bits(_mm512_sub_ps(p, widen(h))));
      sum = _mm512_add_ps(sum, p);
    }
    for (; j < Lp; j += 16) {  // keys past the last one, up to the key block
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ph + j), _mm256_setzero_si256());
      if constexpr (kSplit) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pl + j), _mm256_setzero_si256());
    }
    inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  for (int64_t r = rows; r < (rows + 15) / 16 * 16; ++r) {
    std::fill(p_hi + r * Lp, p_hi + (r + 1) * Lp, 0);
    if constexpr (kSplit) std::fill(p_lo + r * Lp, p_lo + (r + 1) * Lp, 0);
  }
}

// attend() on AMX tiles: same arguments and output (kSplit: Matmul::kBf16x3).
template <typename T, int64_t D, bool kSplit>
TP_AMX void attend_amx(HeadRows<T> q, HeadRows<T> k, HeadRows<T> v, int64_t H, int64_t len,
                       int64_t q_len, int64_t h, float scale, const float* bias, T* out,
                       int64_t out_start, AmxScratch& sc) {
  constexpr bool kSplitInputs = kSplit && std::is_same_v<T, float>;  // bf16 inputs: lo = 0
  const int64_t Lp = (len + 31) / 32 * 32;
  const int64_t Lr = (q_len + 31) / 32 * 32;
  uint16_t* kh = aligned64(sc.kb, 2 * Lp * D);
  uint16_t* vh = aligned64(sc.vb, 2 * Lp * D);
  uint16_t* qh = aligned64(sc.q, 2 * Lr * D);
  uint16_t* ph = aligned64(sc.p, 4 * 32 * Lp);  // [hi, lo][2 blocks][32, Lp]
  float* s = aligned64(sc.s, 2 * 32 * Lp);
  float* o = aligned64(sc.o, 32 * D);
  uint16_t *kl = kh + Lp * D, *vl = vh + Lp * D, *ql = qh + Lr * D, *pl = ph + 2 * 32 * Lp;
  pack_keys<T, D>(k, len, Lp, kSplitInputs, kh, kl);
  pack_values<T, D>(v, len, Lp, kSplitInputs, vh, vl);
  for (int64_t i = 0; i < Lr; ++i) {
    for (int64_t c = 0; c < D / 16; ++c) {
      __m256i hi = _mm256_setzero_si256(), lo = hi;
      if (i < q_len) split16(q.ptr + i * q.row + 16 * c, kSplitInputs, hi, lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qh + i * D + 16 * c), hi);
      if (kSplitInputs) _mm256_storeu_si256(reinterpret_cast<__m256i*>(ql + i * D + 16 * c), lo);
    }
  }
  const uint16_t* klo = kSplitInputs ? kl : nullptr;
  const uint16_t* qlo = kSplitInputs ? ql : nullptr;
  const uint16_t* vlo = kSplitInputs ? vl : nullptr;
  const uint16_t* plo = kSplit ? pl : nullptr;
  // Query blocks of 32 rows, software-pipelined: block b + 1's scores, then block b's softmax,
  // then block b - 1's P V, so a tile load never reads what the vector stores just wrote (and
  // the vector loads not what the tile stores just wrote): double-buffered S, P and inv.
  const int64_t blocks = (q_len + 31) / 32;
  auto rows_of = [&](int64_t b) { return std::min<int64_t>(32, q_len - 32 * b); };
  auto scores = [&](int64_t b) {
    const int64_t i0 = 32 * b;
    const uint16_t* qa = qh + i0 * D;
    const uint16_t* qb = qlo == nullptr ? nullptr : qlo + i0 * D;
    float* sb = s + (b & 1) * 32 * Lp;
    for (int64_t j = 0; j < Lp; j += 32) {  // key blocks of 32: two key tiles, D / 32 steps
      const int64_t tile = (j / 16) * (D / 32) * kTile;
      const uint16_t* kb_lo = klo ? klo + tile : nullptr;
      if (rows_of(b) > 16)
        tile_block<2>(qa, qb, D, kh + tile, kb_lo, D / 32, D / 32, sb + j, Lp);
      else
        tile_block<1>(qa, qb, D, kh + tile, kb_lo, D / 32, D / 32, sb + j, Lp);
    }
  };
  auto outputs = [&](int64_t b) {
    const uint16_t* pa = ph + (b & 1) * 32 * Lp;
    const uint16_t* pb = plo == nullptr ? nullptr : plo + (b & 1) * 32 * Lp;
    for (int64_t d = 0; d < D; d += 32) {  // dim blocks of 32: two dim tiles, Lp / 32 steps
      const int64_t tile = (d / 16) * (Lp / 32) * kTile;
      const uint16_t* vb_lo = vlo ? vlo + tile : nullptr;
      if (rows_of(b) > 16)
        tile_block<2>(pa, pb, Lp, vh + tile, vb_lo, Lp / 32, Lp / 32, o + d, D);
      else
        tile_block<1>(pa, pb, Lp, vh + tile, vb_lo, Lp / 32, Lp / 32, o + d, D);
    }
    const float* inv = sc.inv + (b & 1) * 32;
    for (int64_t r = 0; r < rows_of(b); ++r) {
      const __m512 w = _mm512_set1_ps(inv[r]);
      T* dst = out + (out_start + 32 * b + r) * H * D + h * D;
      for (int64_t c = 0; c < D / 16; ++c)
        store16(dst + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + 16 * c), w));
    }
  };
  scores(0);
  for (int64_t b = 0; b < blocks; ++b) {
    if (b + 1 < blocks) scores(b + 1);
    const int64_t off = (b & 1) * 32 * Lp;
    softmax_block<kSplit>(s + off, rows_of(b), 32 * b, len, Lp, scale, bias, ph + off,
                          pl + off, sc.inv + (b & 1) * 32);
    if (b > 0) outputs(b - 1);
  }
  outputs(blocks - 1);
}

// A [rows, heads, D] view with unit stride in D: its row and head strides, in elements.
struct View {
  const void* data;
  int64_t row, head, heads;
};

// kKeyLens: whether key_lens is given; a template argument, so that the default path compiles to
// the code it had before key counts existed.
template <typename T, int64_t D, bool kKeyLens>
void run(View q, View k, View v, const at::Tensor& starts, const at::Tensor& lens,
         const at::Tensor& out_starts, bool first_only, double scale, const float* bias,
         int64_t bias_width, const int64_t* key_lens, Matmul matmul, at::Tensor& out) {
  const int64_t H = q.heads;
  const int64_t group = q.heads / k.heads;  // query heads per key/value head
  const int64_t num_seqs = starts.size(0);
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  const int64_t* os = out_starts.data_ptr<int64_t>();
  const T* qp = static_cast<const T*>(q.data);
  const T* kp = static_cast<const T*>(k.data);
  const T* vp = static_cast<const T*>(v.data);
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
    AmxScratch amx;
    if (matmul != kFloat32) amx_begin();  // tile configuration is per thread
    for (int64_t w = b; w < e; ++w) {
      for (int64_t t = next.fetch_add(1); t < num_tasks; t = next.fetch_add(1)) {
        const int64_t i = order[t / H];
        const int64_t h = t % H, kh = h / group;
        const int64_t len = ln[i], s0 = st[i];
        const int64_t num_keys = kKeyLens ? key_lens[i] : len;
        const HeadRows<T> qr{qp + s0 * q.row + h * q.head, q.row};
        const HeadRows<T> kr{kp + s0 * k.row + kh * k.head, k.row};
        const HeadRows<T> vr{vp + s0 * v.row + kh * v.head, v.row};
        const int64_t q_len = first_only ? 1 : len;
        const float* hb = bias == nullptr ? nullptr : bias + h * bias_width;
        const float sc_ = static_cast<float>(scale);
        if (matmul != kFloat32 && t + 1 < num_tasks) {  // into L2: the next task's rows
          // (a head's rows are a fused QKV row apart, which the hardware prefetchers do not
          // follow across pages; in the int8 MiniLM pass the AMX path's time fell ~5%)
          const int64_t ni = order[(t + 1) / H], nh = (t + 1) % H, nkh = nh / group;
          const int64_t nk = kKeyLens ? key_lens[ni] : ln[ni];
          for (int64_t r = 0; r < nk; ++r) {
            prefetch_row(kp + (st[ni] + r) * k.row + nkh * k.head, D);
            prefetch_row(vp + (st[ni] + r) * v.row + nkh * v.head, D);
          }
          for (int64_t r = 0; r < (first_only ? 1 : ln[ni]); ++r)
            prefetch_row(qp + (st[ni] + r) * q.row + nh * q.head, D);
        }
        if (matmul == kBf16x3)
          attend_amx<T, D, true>(qr, kr, vr, H, num_keys, q_len, h, sc_, hb, o, os[i], amx);
        else if (matmul == kBf16)
          attend_amx<T, D, false>(qr, kr, vr, H, num_keys, q_len, h, sc_, hb, o, os[i], amx);
        else
          attend<T, D>(qr, kr, vr, H, num_keys, q_len, h, sc_, hb, o, os[i], sc);
      }
    }
    if (matmul != kFloat32) amx_end();
  });
}

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
