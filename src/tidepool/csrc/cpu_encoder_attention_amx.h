// The AMX-bf16 path of cpu_encoder_attention.cpp (both products on AMX tiles) and the task loop
// that picks a path per task, kept in its own
// file for size. Not a standalone header: the .cpp includes it inside its anonymous namespace,
// after the float32 path's helpers (exp_ps, HeadRows, Scratch, ...) it uses.
#pragma once

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

// kBf16 / kBf16x3 run on AMX tiles; kBf16Dot is kBf16's rounding with the products as AVX-512
// vdpbf16ps (CPUs with avx512_bf16 and no AMX: cpu_encoder_attention_dot.h).
enum Matmul : int64_t { kFloat32 = 0, kBf16 = 1, kBf16x3 = 2, kBf16Dot = 3 };
inline bool is_amx(int64_t m) { return m == kBf16 || m == kBf16x3; }

#if defined(TP_ISA_AVX512)

#define TP_AMX __attribute__((target("amx-tile,amx-bf16,avx512bf16")))
// The helpers that need AVX512-BF16 only (conversions, packing, the softmax): shared with the
// vdpbf16ps path (cpu_encoder_attention_dot.h), and inlined into the AMX code (a subset target).
#define TP_BF16 __attribute__((target("avx512bf16")))

constexpr int64_t kTile = 512;  // bf16 elements in one tile (16 rows x 32, 1 KiB)

// Whether this process may use AMX-bf16: the CPU has it and the kernel granted the tile state
// (ARCH_REQ_XCOMP_PERM for XTILEDATA; oneDNN usually asked already, asking again is harmless).
bool amx_ready() {
  static const bool ok = __builtin_cpu_supports("amx-bf16") &&
                         __builtin_cpu_supports("avx512bf16") && request_tile_data();
  return ok;
}

// Tiles 0-3: accumulators C[row block][column block]; 4-5: A (row blocks); 6-7: B (column blocks).
// The configuration is per thread: each worker loads it before its first task.
TP_AMX void amx_begin() { load_tile_config(); }

TP_AMX void amx_end() { _tile_release(); }

// The bf16 bits of 16 floats (round to nearest even).
TP_BF16 TP_INLINE __m256i bf16_bits(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
TP_BF16 TP_INLINE __m512 widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 elements as bf16 hi and lo (lo = bf16(x - hi); zero for bf16 inputs, never read then).
template <typename T>
TP_BF16 TP_INLINE void split16(const T* p, bool split, __m256i& hi, __m256i& lo) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_setzero_si256();
  } else {
    const __m512 x = _mm512_loadu_ps(p);
    hi = bf16_bits(x);
    lo = split ? bf16_bits(_mm512_sub_ps(x, widen(hi))) : _mm256_setzero_si256();
  }
}

TP_BF16 TP_INLINE __m512i join(__m256i a, __m256i b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
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
TP_BF16 void pack_keys(HeadRows<T> k, int64_t len, int64_t Lp, bool split, uint16_t* hi,
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
      transpose(rh);
      for (int64_t r = 0; r < 16; ++r) _mm512_storeu_ps(hi + tile + r * 32, rh[r]);
      if (split) {
        transpose(rl);
        for (int64_t r = 0; r < 16; ++r) _mm512_storeu_ps(lo + tile + r * 32, rl[r]);
      }
    }
}

// Values (rows [0, len), zero up to Lp) into B tiles: rows 2r and 2r + 1 of a key step
// interleaved element by element.
template <typename T, int64_t D>
TP_BF16 void pack_values(HeadRows<T> v, int64_t len, int64_t Lp, bool split, uint16_t* hi,
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
TP_BF16 void softmax_block(float* s, int64_t rows, int64_t i0, int64_t len, int64_t Lp,
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
        vstore(dst + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + 16 * c), w));
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

#include "cpu_encoder_attention_dot.h"  // the vdpbf16ps path (attend_dot)

#else  // AVX2: no AMX or vdpbf16ps path; the *_ready() are false, so run() never calls them.

bool amx_ready() { return false; }
inline bool dot_bf16_ready() { return false; }
struct AmxScratch {};
inline void amx_begin() {}
inline void amx_end() {}
template <typename T, int64_t D, bool kSplit>
void attend_amx(HeadRows<T>, HeadRows<T>, HeadRows<T>, int64_t, int64_t, int64_t, int64_t, float,
                const float*, T*, int64_t, AmxScratch&) {
  TORCH_CHECK(false, "the AMX-bf16 path is not in this build");
}
template <typename T, int64_t D>
void attend_dot(HeadRows<T>, HeadRows<T>, HeadRows<T>, int64_t, int64_t, int64_t, int64_t, float,
                const float*, T*, int64_t, AmxScratch&) {
  TORCH_CHECK(false, "the vdpbf16ps path is not in this build");
}

#endif  // TP_ISA_AVX512

// Into L2: one head row of D elements.
template <typename T>
TP_INLINE void prefetch_row(const T* p, int64_t D) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(c + b, _MM_HINT_T2);
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
    if (is_amx(matmul)) amx_begin();  // tile configuration is per thread
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
        else if (matmul == kBf16Dot)
          attend_dot<T, D>(qr, kr, vr, H, num_keys, q_len, h, sc_, hb, o, os[i], amx);
        else
          attend<T, D>(qr, kr, vr, H, num_keys, q_len, h, sc_, hb, o, os[i], sc);
      }
    }
    if (is_amx(matmul)) amx_end();
  });
}
