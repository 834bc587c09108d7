// Bidirectional attention over packed, variable-length sequences on CPU (AVX-512 or AVX2 +
// FMA: one source, the ISA the build's, cpu_simd.h).
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
// instead, the softmax staying float32: attend_amx below; with matmul = 3 (bf16's rounding,
// where the CPU has avx512_bf16 but no AMX) on vdpbf16ps dot products: attend_dot.
//
// Why by hand: PyTorch's CPU flash-attention kernel tiles the work into many small GEMM calls,
// which for 32- and 64-wide heads run at 25-60 GFLOP/s here; see docs/performance.md.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_amx.h"
#include "cpu_simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// The vector ISA is the build's (cpu_simd.h: TP_ISA_AVX512 or TP_ISA_AVX2); the tile shapes
// below follow from its register count. AVX-512 (32 registers of 16 floats): score tiles of
// 8 query rows x 32 keys (16 accumulators). AVX2 (16 registers of 8 floats): 6 rows x 16 keys
// (12 accumulators, the 2 key vectors and the broadcast query: 15 of the 16).
#if defined(TP_ISA_AVX512)
constexpr int64_t kRows = 8;      // query rows per score tile
constexpr int64_t kKeyVecs = 2;   // key vectors per score tile (32 keys)
constexpr int64_t kOutAccs = 16;  // P V accumulators
constexpr int64_t kOutVecs = 8;   // P V: most output vectors per row and pass (all of D <= 128)
#else
constexpr int64_t kRows = 6;
constexpr int64_t kKeyVecs = 2;   // 16 keys
constexpr int64_t kOutAccs = 12;
constexpr int64_t kOutVecs = 2;   // P V in passes of 16 dims: 6 rows x 2 vectors
#endif
constexpr int64_t kKeyBlock = kKeyVecs * kW;  // keys per score tile

// The longest sequence the op accepts: one constant, attention/cpu_kernels.py's MAX_SEQ_LEN,
// passed by its build (-DTIDEPOOL_MAX_SEQ_LEN), so Python and C++ cannot disagree.
#ifndef TIDEPOOL_MAX_SEQ_LEN
#error "build through tidepool.attention.cpu_kernels, which defines TIDEPOOL_MAX_SEQ_LEN"
#endif
constexpr int64_t kMaxSeqLen = TIDEPOOL_MAX_SEQ_LEN;

struct Scratch {
  std::vector<float> kt;      // [Lp / KB, D, KB] keys, transposed in blocks of kKeyBlock
  std::vector<float> v;       // [len, D] values
  std::vector<float> q;       // [Lr, D] queries, scaled (Lr: q_len rounded up to kRows)
  std::vector<float> s;       // [Lr, Lp] scores, then probabilities
  std::vector<float> inv;     // [Lr] 1 / each row's softmax denominator
};

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
  constexpr int64_t V = D / kW;  // vectors per head row
  constexpr int64_t KB = kKeyBlock;
  const int64_t Lp = (len + KB - 1) / KB * KB;
  sc.kt.resize(D * Lp);
  float* kt = sc.kt.data();
  // Keys, kW at a time: kW rows x kW dims transposed in registers into the [D, KB] blocks.
  for (int64_t j = 0; j < Lp; j += kW) {
    float* ktb = kt + (j / KB) * D * KB + j % KB;
    for (int64_t c = 0; c < V; ++c) {
      vf r[kW];
#pragma GCC unroll 16
      for (int64_t i = 0; i < kW; ++i)
        r[i] = j + i < len ? vload(k.ptr + (j + i) * k.row + kW * c) : vzero();
      transpose(r);
#pragma GCC unroll 16
      for (int64_t i = 0; i < kW; ++i) vstoreu(ktb + (kW * c + i) * KB, r[i]);
    }
  }
  // Values contiguous in float32 (read in place, their rows are a page apart: 1.3x slower).
  sc.v.resize(len * D);
  float* vb = sc.v.data();
  for (int64_t j = 0; j < len; ++j)
    for (int64_t c = 0; c < V; ++c)
      vstore(vb + j * D + kW * c, vload(v.ptr + j * v.row + kW * c));
  const int64_t Lr = (q_len + kRows - 1) / kRows * kRows;
  sc.q.resize(Lr * D);
  sc.s.resize(Lr * Lp);
  sc.inv.resize(Lr);
  float* qb = sc.q.data();
  float* s = sc.s.data();
  float* inv = sc.inv.data();
  // Queries, scaled, all rows before any is used: broadcasting a float out of a vector that was
  // just stored stalls store forwarding (a per-tile copy made the scores 2x slower).
  const vf vscale = vset1(scale);
  for (int64_t i = 0; i < Lr; ++i)
    for (int64_t c = 0; c < V; ++c)
      vstore(qb + i * D + kW * c, i < q_len ? vmul(vload(q.ptr + i * q.row + kW * c), vscale) : vzero());
  // Phase 1, scores S = Q K^T: [kRows, KB] register tiles; the keys (D x Lp) stay in L1 while
  // every query tile passes over them. Each row's maximum over its real keys goes with it.
  const vf neg_inf = vset1(-std::numeric_limits<float>::infinity());
  for (int64_t i0 = 0; i0 < Lr; i0 += kRows) {
    const float* qt = qb + i0 * D;
    float* st = s + i0 * Lp;
    vf mx[kRows];
    for (int64_t r = 0; r < kRows; ++r) mx[r] = neg_inf;
    for (int64_t j = 0; j < Lp; j += KB) {
      vf acc[kRows][kKeyVecs];
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t u = 0; u < kKeyVecs; ++u) acc[r][u] = vzero();
      const float* ktb = kt + j * D;  // block j / KB: [D, KB]
      for (int64_t d = 0; d < D; ++d) {
        vf kv[kKeyVecs];
        for (int64_t u = 0; u < kKeyVecs; ++u) kv[u] = vloadu(ktb + d * KB + kW * u);
        for (int64_t r = 0; r < kRows; ++r) {
          const vf qv = vset1(qt[r * D + d]);
          for (int64_t u = 0; u < kKeyVecs; ++u) acc[r][u] = vfmadd(qv, kv[u], acc[r][u]);
        }
      }
      if (bias != nullptr) {
        for (int64_t r = 0; r < kRows; ++r) {
          const float* b = bias + j - (i0 + r);
          for (int64_t u = 0; u < kKeyVecs; ++u) acc[r][u] = vadd(acc[r][u], vloadu(b + kW * u));
        }
      }
      const int64_t real = len - j;  // real keys in this block (may exceed KB, or be <= 0)
      vmask m[kKeyVecs];
      for (int64_t u = 0; u < kKeyVecs; ++u) m[u] = lanes(real - kW * u);
      for (int64_t r = 0; r < kRows; ++r) {
        for (int64_t u = 0; u < kKeyVecs; ++u) {
          vstoreu(st + r * Lp + j + kW * u, acc[r][u]);
          mx[r] = vmask_max(mx[r], m[u], acc[r][u]);
        }
      }
    }
    // Phase 2 for the tile, while its scores are in L1: softmax over the len real keys.
    for (int64_t r = 0; r < kRows; ++r) {
      float* sr = st + r * Lp;
      const vf mr = vset1(vreduce_max(mx[r]));
      vf sum = vzero();
      int64_t j = 0;
      for (; j + kW <= len; j += kW) {
        const vf p = exp_ps(vsub(vloadu(sr + j), mr));
        vstoreu(sr + j, p);
        sum = vadd(sum, p);
      }
      if (j < len) {
        const vf p = vmaskz(lanes(len - j), exp_ps(vsub(vloadu(sr + j), mr)));
        vstoreu(sr + j, p);
        sum = vadd(sum, p);
      }
      inv[i0 + r] = 1.0f / vreduce_add(sum);
    }
  }
  // Phase 3, O = P V / sum: rows in groups of G, head dims in passes of C vectors, keeping
  // G x C accumulators (AVX-512: all of D in one pass).
  constexpr int64_t C = V < kOutVecs ? V : kOutVecs;
  constexpr int64_t G = kOutAccs / C < kRows ? kOutAccs / C : kRows;
  for (int64_t g = 0; g < q_len; g += G) {
    const int64_t gr = std::min(G, q_len - g);
    const float* pg = s + g * Lp;
    for (int64_t c0 = 0; c0 < V; c0 += C) {
      vf acc[G][C];
      for (int64_t r = 0; r < G; ++r)
        for (int64_t c = 0; c < C; ++c) acc[r][c] = vzero();
      for (int64_t j = 0; j < len; ++j) {
        vf vv[C];
        for (int64_t c = 0; c < C; ++c) vv[c] = vloadu(vb + j * D + kW * (c0 + c));
        for (int64_t r = 0; r < G; ++r) {
          const vf p = vset1(pg[r * Lp + j]);
          for (int64_t c = 0; c < C; ++c) acc[r][c] = vfmadd(p, vv[c], acc[r][c]);
        }
      }
      for (int64_t r = 0; r < gr; ++r) {
        const vf w = vset1(inv[g + r]);
        T* o = out + (out_start + g + r) * H * D + h * D + kW * c0;
        for (int64_t c = 0; c < C; ++c) vstore(o + kW * c, vmul(acc[r][c], w));
      }
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
  TORCH_CHECK(matmul >= kFloat32 && matmul <= kBf16Dot,
              "matmul: 0 (float32), 1 (bf16), 2 (bf16x3) or 3 (bf16 on vdpbf16ps), got ", matmul);
  // Where the CPU lacks a mode's instructions, the float32 path (amx_bf16_available() and
  // dot_bf16_available() say which run).
  const bool ready = matmul == kBf16Dot ? dot_bf16_ready() : amx_ready();
  const Matmul mode = ready ? static_cast<Matmul>(matmul) : kFloat32;
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
  m.def("dot_bf16_available() -> bool", &dot_bf16_ready);
}

TORCH_LIBRARY_IMPL(TP_NS, CPU, m) { m.impl("encoder_attention", &encoder_attention); }
