// The float32 vector layer of tidepool's CPU kernels: one source, built once per ISA. The build
// defines TP_ISA_AVX512 (16 lanes; -mavx512f/bw/dq/vl) or TP_ISA_AVX2 (8 lanes; -mavx2 -mfma),
// attention/cpu_kernels.py's ISA_CFLAGS; the kernels are written against `vf` (kW float lanes)
// and the functions below. Under AVX-512 each function is the one intrinsic the kernels called
// before this layer existed, so that build's code is unchanged.
//
// Masks: `vmask` selects the first n lanes (lanes(n)); AVX-512 keeps it in a k register, AVX2
// as a lane-wide all-ones vector (masked loads / stores through vmaskmovps).
#pragma once

#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#define TP_INLINE inline __attribute__((always_inline))

namespace {

#if defined(TP_ISA_AVX512) == defined(TP_ISA_AVX2)
#error "build with exactly one of TP_ISA_AVX512, TP_ISA_AVX2 (attention/cpu_kernels.py)"
#endif

#if defined(TP_ISA_AVX512)

using vf = __m512;
using vi = __m512i;
using vmask = __mmask16;
constexpr int64_t kW = 16;

TP_INLINE vf vzero() { return _mm512_setzero_ps(); }
TP_INLINE vf vset1(float x) { return _mm512_set1_ps(x); }
TP_INLINE vf vloadu(const float* p) { return _mm512_loadu_ps(p); }
TP_INLINE void vstoreu(float* p, vf v) { _mm512_storeu_ps(p, v); }
TP_INLINE vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
TP_INLINE vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
TP_INLINE vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
TP_INLINE vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
TP_INLINE vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
TP_INLINE vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
TP_INLINE vf vfnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
TP_INLINE float vreduce_add(vf v) { return _mm512_reduce_add_ps(v); }
TP_INLINE float vreduce_max(vf v) { return _mm512_reduce_max_ps(v); }

// The first n lanes (n <= 0: none, n >= kW: all).
TP_INLINE vmask lanes(int64_t n) {
  return n >= 16 ? static_cast<vmask>(0xFFFF)
                 : (n <= 0 ? static_cast<vmask>(0) : static_cast<vmask>((1u << n) - 1u));
}
TP_INLINE vf vmaskz(vmask m, vf v) { return _mm512_maskz_mov_ps(m, v); }
// m ? max(a, b) : a, lane by lane.
TP_INLINE vf vmask_max(vf a, vmask m, vf b) { return _mm512_mask_max_ps(a, m, a, b); }

// exp_ps's two ISA-specific steps: rounding to an integer, and p * 2^n.
TP_INLINE vf round_nearest(vf x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
TP_INLINE vf times_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }

TP_INLINE vf vload(const float* p) { return _mm512_loadu_ps(p); }
TP_INLINE vf vload(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
TP_INLINE void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
TP_INLINE void vstore(c10::BFloat16* p, vf v) {
  // Round to nearest even, as torch's float -> bfloat16 conversion does (no NaN inputs here).
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

// Masked loads / stores (masked-off lanes read as 0, never touched in memory) and the integer
// side of the int8 kernels (cpu_int8_common.h).
TP_INLINE vf vload_masked(const float* p, vmask m) { return _mm512_maskz_loadu_ps(m, p); }
TP_INLINE void vstore_masked(float* p, vmask m, vf v) { _mm512_mask_storeu_ps(p, m, v); }
TP_INLINE vf vabs(vf v) { return _mm512_abs_ps(v); }
TP_INLINE vf vmask_min(vf a, vmask m, vf b) { return _mm512_mask_min_ps(a, m, a, b); }
TP_INLINE vf vmaskz_sub(vmask m, vf a, vf b) { return _mm512_maskz_sub_ps(m, a, b); }
TP_INLINE float vreduce_min(vf v) { return _mm512_reduce_min_ps(v); }
// 1 / v to 14 bits (then one Newton step in the callers).
TP_INLINE vf vrcp(vf v) { return _mm512_rcp14_ps(v); }
// Round to nearest even (the default MXCSR mode), as torch.round.
TP_INLINE vi vround_int(vf v) { return _mm512_cvtps_epi32(v); }
TP_INLINE vi vi_set1(int32_t x) { return _mm512_set1_epi32(x); }
TP_INLINE vi vi_zero() { return _mm512_setzero_si512(); }
TP_INLINE vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
TP_INLINE vi vi_min(vi a, vi b) { return _mm512_min_epi32(a, b); }
TP_INLINE vi vi_max(vi a, vi b) { return _mm512_max_epi32(a, b); }
// The first min(left, kW) lanes as bytes, saturated to int8 / uint8.
TP_INLINE void store_s8(int8_t* p, vi v, int64_t left) {
  _mm_mask_storeu_epi8(p, lanes(left), _mm512_cvtsepi32_epi8(v));
}
TP_INLINE void store_u8(uint8_t* p, vi v, int64_t left) {
  _mm_mask_storeu_epi8(p, lanes(left), _mm512_cvtusepi32_epi8(v));
}

// kW x kW transpose in registers: r[i] holds row i on entry, column i on exit.
TP_INLINE void transpose(vf r[16]) {
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

#else  // TP_ISA_AVX2

using vf = __m256;
using vi = __m256i;
using vmask = __m256i;
constexpr int64_t kW = 8;

TP_INLINE vf vzero() { return _mm256_setzero_ps(); }
TP_INLINE vf vset1(float x) { return _mm256_set1_ps(x); }
TP_INLINE vf vloadu(const float* p) { return _mm256_loadu_ps(p); }
TP_INLINE void vstoreu(float* p, vf v) { _mm256_storeu_ps(p, v); }
TP_INLINE vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
TP_INLINE vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
TP_INLINE vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
TP_INLINE vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
TP_INLINE vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
TP_INLINE vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
TP_INLINE vf vfnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
TP_INLINE float vreduce_add(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
TP_INLINE float vreduce_max(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

TP_INLINE vmask lanes(int64_t n) {
  const int32_t c = n >= 8 ? 8 : (n <= 0 ? 0 : static_cast<int32_t>(n));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
TP_INLINE vf vmaskz(vmask m, vf v) { return _mm256_and_ps(_mm256_castsi256_ps(m), v); }
TP_INLINE vf vmask_max(vf a, vmask m, vf b) {
  return _mm256_blendv_ps(a, _mm256_max_ps(a, b), _mm256_castsi256_ps(m));
}

TP_INLINE vf round_nearest(vf x) {
  return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// p * 2^n for integral n in [-126, 127] (the exponent field built directly; outside that range
// the result is garbage, which only the masked-off lanes past a row's last key ever see).
TP_INLINE vf times_pow2(vf p, vf n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

TP_INLINE vf vload(const float* p) { return _mm256_loadu_ps(p); }
TP_INLINE vf vload(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
TP_INLINE void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
TP_INLINE void vstore(c10::BFloat16* p, vf v) {
  // Round to nearest even, as torch's float -> bfloat16 conversion does (no NaN inputs here).
  __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  // Each lane now <= 0xFFFF: the unsigned saturating pack is exact.
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// Masked loads / stores (masked-off lanes read as 0, never touched in memory: vmaskmovps) and
// the integer side of the int8 kernels (cpu_int8_common.h).
// (Full vectors take the plain load / store: vmaskmovps is slow on some CPUs, AMD's stores.)
TP_INLINE bool all_lanes(vmask m) { return _mm256_movemask_ps(_mm256_castsi256_ps(m)) == 0xFF; }
TP_INLINE vf vload_masked(const float* p, vmask m) {
  return all_lanes(m) ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, m);
}
TP_INLINE void vstore_masked(float* p, vmask m, vf v) {
  if (all_lanes(m))
    _mm256_storeu_ps(p, v);
  else
    _mm256_maskstore_ps(p, m, v);
}
TP_INLINE vf vabs(vf v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
TP_INLINE vf vmask_min(vf a, vmask m, vf b) {
  return _mm256_blendv_ps(a, _mm256_min_ps(a, b), _mm256_castsi256_ps(m));
}
TP_INLINE vf vmaskz_sub(vmask m, vf a, vf b) { return vmaskz(m, _mm256_sub_ps(a, b)); }
TP_INLINE float vreduce_min(vf v) {
  __m128 s = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_min_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_min_ss(s, _mm_movehdup_ps(s)));
}
// 1 / v to ~23 bits: vrcpps's 12 and one Newton step, so that the callers' own Newton step
// ends at float32's precision as AVX-512's 14-bit start does (with 12 bits, GELU's 1 + erf(x)
// for x < -4, a difference of nearly equal numbers, was off by 1e-7 relative to 1).
TP_INLINE vf vrcp(vf v) {
  const vf r = _mm256_rcp_ps(v);
  return _mm256_mul_ps(r, _mm256_fnmadd_ps(v, r, _mm256_set1_ps(2.f)));
}
TP_INLINE vi vround_int(vf v) { return _mm256_cvtps_epi32(v); }
TP_INLINE vi vi_set1(int32_t x) { return _mm256_set1_epi32(x); }
TP_INLINE vi vi_zero() { return _mm256_setzero_si256(); }
TP_INLINE vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
TP_INLINE vi vi_min(vi a, vi b) { return _mm256_min_epi32(a, b); }
TP_INLINE vi vi_max(vi a, vi b) { return _mm256_max_epi32(a, b); }
// The first min(left, kW) lanes as bytes, saturated to int8 / uint8 (packs: 32 -> 16 -> 8
// bits); a tail of fewer than 8 goes through memcpy (AVX2 has no byte-masked store).
TP_INLINE void store_bytes(void* p, __m128i bytes, int64_t left) {
  if (left >= 8)
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), bytes);
  else
    std::memcpy(p, &bytes, static_cast<size_t>(left));
}
TP_INLINE void store_s8(int8_t* p, vi v, int64_t left) {
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  store_bytes(p, _mm_packs_epi16(w, w), left);
}
TP_INLINE void store_u8(uint8_t* p, vi v, int64_t left) {
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  store_bytes(p, _mm_packus_epi16(w, w), left);
}

// 8 x 8 transpose in registers: r[i] holds row i on entry, column i on exit.
TP_INLINE void transpose(vf r[8]) {
  __m256 t[8], u[8];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}

#endif

// exp(x) for x <= 0 (scores minus the row's maximum): 2^n * p(r), r = x - n ln2, |r| <= ln2/2,
// degree-6 polynomial; relative error ~2e-7, underflows to 0 below -87 (n >= -126 there, so
// AVX2's 2^n stays a normal number).
TP_INLINE vf exp_ps(vf x) {
  const vf log2e = vset1(1.44269504088896341f);
  const vf ln2_hi = vset1(0.693359375f);
  const vf ln2_lo = vset1(-2.12194440e-4f);
  x = vmax(x, vset1(-87.0f));
  const vf n = round_nearest(vmul(x, log2e));
  vf r = vfnmadd(n, ln2_hi, x);
  r = vfnmadd(n, ln2_lo, r);
  vf p = vset1(1.9875691500e-4f);
  p = vfmadd(p, r, vset1(1.3981999507e-3f));
  p = vfmadd(p, r, vset1(8.3334519073e-3f));
  p = vfmadd(p, r, vset1(4.1665795894e-2f));
  p = vfmadd(p, r, vset1(1.6666665459e-1f));
  p = vfmadd(p, r, vset1(5.0000001201e-1f));
  const vf r2 = vmul(r, r);
  p = vfmadd(p, r2, vadd(r, vset1(1.0f)));
  return times_pow2(p, n);
}

}  // namespace
