// The vdpbf16ps path of cpu_encoder_attention.cpp (Matmul::kBf16Dot): the AMX path's bf16
// rounding (Q, K, V and P rounded to bf16 once, float32 accumulation, float32 softmax) with both
// products as AVX-512 BF16 dot products (_mm512_dpbf16_ps: 16 lanes, each adds a pair of bf16
// products, 32 multiply-adds per instruction against the float32 FMA's 16), for CPUs with
// avx512_bf16 and no AMX (AMD Zen 4 / 5, Intel Cooper Lake). Not a standalone header: included
// by cpu_encoder_attention_amx.h inside its TP_ISA_AVX512 block, after the packing and softmax
// helpers it shares with the AMX path.
//
// Layouts are the AMX path's (pack_keys / pack_values, one bf16 copy, no lo part): keys
// [Lp / 16 key blocks][D / 2 dim pairs][16 keys][2], so one vector is 16 keys x one dim pair;
// values [D / 16 dim blocks][Lp / 2 key pairs][16 dims][2], one vector 16 dims x one key pair.
// A query's (or a probability row's) pair is one 32-bit word, broadcast into the instruction.
// Queries go in blocks of 32 rows: scores [32, Lp] float32 in scratch, the softmax over them,
// then P V, so a block's scores and probabilities stay in L1 / L2.
#pragma once

// Whether the CPU has the vdpbf16ps instruction (AVX512-BF16).
inline bool dot_bf16_ready() {
  static const bool ok = __builtin_cpu_supports("avx512bf16");
  return ok;
}

TP_BF16 TP_INLINE __m512 dot2(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

TP_BF16 TP_INLINE __m512i pair_at(const uint16_t* p) {  // the bf16 pair at p, in every lane
  return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}

// Scores of query rows [0, 8) of qh (bf16 [.., D]) against every key: s[r * Lp + j], Lp keys.
template <int64_t D>
TP_BF16 void dot_scores(const uint16_t* qh, const uint16_t* kh, int64_t Lp, float* s) {
  constexpr int64_t kR = 8;
  for (int64_t j = 0; j < Lp; j += 32) {  // two key blocks of 16
    __m512 acc[kR][2];
    for (int64_t r = 0; r < kR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint16_t* k0 = kh + (j / 16) * D * 16;
    const uint16_t* k1 = k0 + D * 16;
    for (int64_t dp = 0; dp < D / 2; ++dp) {
      const __m512i a = _mm512_loadu_si512(k0 + dp * 32);
      const __m512i b = _mm512_loadu_si512(k1 + dp * 32);
      for (int64_t r = 0; r < kR; ++r) {
        const __m512i q = pair_at(qh + r * D + 2 * dp);
        acc[r][0] = dot2(acc[r][0], a, q);
        acc[r][1] = dot2(acc[r][1], b, q);
      }
    }
    for (int64_t r = 0; r < kR; ++r) {
      _mm512_storeu_ps(s + r * Lp + j, acc[r][0]);
      _mm512_storeu_ps(s + r * Lp + j + 16, acc[r][1]);
    }
  }
}

// Output rows [0, rows) of a block, P V / sum, to out (ldo elements per row): P bf16 [.., Lp]
// (zero past the len keys and past `rows` up to 16), V packed (pack_values); C dim vectors of
// 16 per pass and G rows per group: 16 accumulators.
template <typename T, int64_t D>
TP_BF16 void dot_outputs(const uint16_t* ph, const uint16_t* vh, int64_t len, int64_t Lp,
                         int64_t rows, const float* inv, T* out, int64_t ldo) {
  constexpr int64_t V = D / 16;
  constexpr int64_t C = V < 8 ? V : 8;
  constexpr int64_t G = 16 / C;
  const int64_t pairs = (len + 1) / 2;
  for (int64_t g = 0; g < rows; g += G) {
    const int64_t gr = std::min(G, rows - g);
    for (int64_t c0 = 0; c0 < V; c0 += C) {
      __m512 acc[G][C];
      for (int64_t r = 0; r < G; ++r)
        for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
      for (int64_t jp = 0; jp < pairs; ++jp) {
        __m512i vv[C];
        for (int64_t c = 0; c < C; ++c)
          vv[c] = _mm512_loadu_si512(vh + ((c0 + c) * (Lp / 2) + jp) * 32);
        for (int64_t r = 0; r < G; ++r) {
          const __m512i p = pair_at(ph + (g + r) * Lp + 2 * jp);
          for (int64_t c = 0; c < C; ++c) acc[r][c] = dot2(acc[r][c], vv[c], p);
        }
      }
      for (int64_t r = 0; r < gr; ++r) {
        const __m512 w = _mm512_set1_ps(inv[g + r]);
        T* o = out + (g + r) * ldo + 16 * c0;
        for (int64_t c = 0; c < C; ++c) vstore(o + 16 * c, _mm512_mul_ps(acc[r][c], w));
      }
    }
  }
}

// attend() with the products on vdpbf16ps (Matmul::kBf16Dot): same arguments and output.
template <typename T, int64_t D>
TP_BF16 void attend_dot(HeadRows<T> q, HeadRows<T> k, HeadRows<T> v, int64_t H, int64_t len,
                        int64_t q_len, int64_t h, float scale, const float* bias, T* out,
                        int64_t out_start, AmxScratch& sc) {
  const int64_t Lp = (len + 31) / 32 * 32;
  uint16_t* kh = aligned64(sc.kb, Lp * D);
  uint16_t* vh = aligned64(sc.vb, Lp * D);
  uint16_t* qh = aligned64(sc.q, 32 * D);
  uint16_t* ph = aligned64(sc.p, 32 * Lp);
  float* s = aligned64(sc.s, 32 * Lp);
  pack_keys<T, D>(k, len, Lp, false, kh, nullptr);
  pack_values<T, D>(v, len, Lp, false, vh, nullptr);
  for (int64_t i0 = 0; i0 < q_len; i0 += 32) {
    const int64_t rows = std::min<int64_t>(32, q_len - i0);
    for (int64_t r = 0; r < (rows + 7) / 8 * 8; ++r)
      for (int64_t c = 0; c < D / 16; ++c) {
        __m256i hi = _mm256_setzero_si256(), lo = hi;
        if (r < rows) split16(q.ptr + (i0 + r) * q.row + 16 * c, false, hi, lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qh + r * D + 16 * c), hi);
      }
    for (int64_t r = 0; r < rows; r += 8) dot_scores<D>(qh + r * D, kh, Lp, s + r * Lp);
    softmax_block<false>(s, rows, i0, len, Lp, scale, bias, ph, ph, sc.inv);  // no lo part
    T* dst = out + (out_start + i0) * H * D + h * D;
    dot_outputs<T, D>(ph, vh, len, Lp, rows, sc.inv, dst, H * D);
  }
}
