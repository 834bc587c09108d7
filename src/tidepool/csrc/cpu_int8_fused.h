// Shared by tidepool's two int8 GEMMs with the epilogue inside their blocked loop
// (cpu_int8_gemm.cpp on AMX tiles, cpu_int8_vnni.cpp on VNNI vector registers): what one call
// computes (Gemm) and its set-up from the op's arguments, the row pass after the blocks
// (multiply / residual, LayerNorm, the next layer's quantization, the row written once), and
// the two ways of splitting a call across the threads. A kernel source supplies only its
// register / tile blocks, as a policy type:
//
//   struct Kernel {
//     static constexpr int64_t kRows;       // rows per block (the split path's strip)
//     static constexpr int64_t kBlockCols;  // columns per block
//     static constexpr int64_t kGroupBytes; // a row group's float32 rows (in L2)
//     static constexpr int64_t kMaxGroupBlocks;  // at most this many blocks of rows per group
//     static void enter();  // once per parallel task, before any block (AMX: the tile config)
//     static void leave();  // once per task, after its blocks
//     // rows [r0, r1) x columns [n0, n1), finished by e, into dst (row r0 at dst, stride N)
//     static void blocks(const Gemm&, const Epilogue& e, int64_t r0, int64_t r1, int64_t n0,
//                        int64_t n1, float* dst);
//   };
#pragma once

#include "cpu_int8_common.h"

#include <vector>

namespace {

// What one call computes (pointers into the op's tensors).
struct Gemm {
  const uint8_t* q;  // [T, K] (int8 bits when !asym)
  const int8_t* w;
  const int8_t* w_lo;      // null: one-part weights
  const int32_t* comp;     // VNNI: [N] 128 · Σ_k W_nk (symmetric inputs); AMX: null
  const int32_t* comp_lo;  // the same for W_lo
  const float* w_scale;
  int64_t T, K, N;
  bool asym;
  Epilogue e;
  Handoff h;
  const float* gamma;  // null: no LayerNorm
  const float* beta;
  double eps;
  float* out;      // [T, N]
  bool write_out;  // false: only the handoff is needed (the rows stay in a per-thread buffer)
  Epilogue core;   // e without the multiply / residual (the row-group path's block phase)
};

// The input q [T, K] and the output out [T, N] of one call, checked before anything reads them.
void check_input(const at::Tensor& q, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() &&
                  (q.scalar_type() == at::kByte || q.scalar_type() == at::kChar),
              "q: contiguous int8 / uint8 [T, K]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == q.size(0), "out: [T, N]");
}

// The op's arguments checked and gathered, after check_input and the caller's checks of the
// shapes and of the packed weights' layout (comp / comp_lo are left null).
Gemm make_gemm(const at::Tensor& q, const at::Tensor& w, const c10::optional<at::Tensor>& w_lo,
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
  const int64_t N = out.size(1);
  Gemm g{};
  g.q = static_cast<const uint8_t*>(q.data_ptr());
  g.w = w.data_ptr<int8_t>();
  g.w_lo = w_lo.has_value() ? w_lo->data_ptr<int8_t>() : nullptr;
  g.w_scale = optional_ptr(w_scale, N, "w_scale");
  g.T = q.size(0), g.K = q.size(1), g.N = N;
  g.asym = q.scalar_type() == at::kByte;
  g.e = make_epilogue(out, scale, scaled_zero, wsum, bias, act, multiply, residual);
  TORCH_CHECK(g.asym == (g.e.scaled_zero != nullptr), "uint8 inputs come with scaled_zero");
  g.core = g.e;
  g.core.multiply = g.core.residual = nullptr;
  g.h = make_handoff(out, next_smoothing, q_next, q_scale, q_scaled_zero);
  TORCH_CHECK(gamma.has_value() == beta.has_value(), "gamma and beta come together");
  g.gamma = optional_ptr(gamma, N, "gamma");
  g.beta = optional_ptr(beta, N, "beta");
  g.eps = eps;
  g.out = out.data_ptr<float>();
  g.write_out = write_out || g.h.q == nullptr;
  return g;
}

// LayerNorm of one row in place in two passes (the sum and sum of squares together, then the
// normalisation), returning the normalised row's range after `sm` (the handoff's smoothing):
// the handoff then needs one more pass, not two. E[v²] - mean² in float32 over the lanes is
// exact enough for LayerNorm inputs (|mean| well below the spread; tests compare with torch).
// N % kW == 0 (both GEMMs need N % 16 == 0).
std::pair<float, float> layer_norm_row_range(float* row, int64_t N, const float* g,
                                             const float* b, double eps, const float* sm) {
  vf s1 = vzero(), s2 = vzero();
  for (int64_t n = 0; n < N; n += kW) {
    const vf v = vloadu(row + n);
    s1 = vadd(s1, v);
    s2 = vfmadd(v, v, s2);
  }
  const float mean = vreduce_add(s1) / static_cast<float>(N);
  const float var = std::max(vreduce_add(s2) / static_cast<float>(N) - mean * mean, 0.f);
  const vf mu = vset1(mean);
  const vf rstd = vset1(1.f / std::sqrt(var + static_cast<float>(eps)));
  vf lo = vset1(std::numeric_limits<float>::infinity());
  vf hi = vset1(-std::numeric_limits<float>::infinity());
  for (int64_t n = 0; n < N; n += kW) {
    const vf d = vmul(vsub(vloadu(row + n), mu), rstd);
    const vf v = vfmadd(d, vloadu(g + n), vloadu(b + n));
    vstoreu(row + n, v);
    const vf vs = sm == nullptr ? v : vmul(v, vloadu(sm + n));
    lo = vmin(lo, vs);
    hi = vmax(hi, vs);
  }
  return {vreduce_min(lo), vreduce_max(hi)};
}

// The row pass of rows [r0, r1) of a finished block range in src (row r0 at src): multiply /
// residual when `sides` (read sequentially, row by row, not in pieces of a block's rows),
// LayerNorm, the handoff, and the row written to out when it is wanted (else it stays in src).
void finish_rows(const Gemm& g, int64_t r0, int64_t r1, float* src, bool sides) {
  const Epilogue& e = g.e;
  const bool any_side = sides && (e.multiply != nullptr || e.residual != nullptr);
  for (int64_t t = r0; t < r1; ++t) {
    float* row = src + (t - r0) * g.N;
    float* dst = g.write_out ? g.out + t * g.N : row;
    if (dst != row || any_side) {
      for (int64_t n = 0; n < g.N; n += kW) {
        vf v = vloadu(row + n);
        if (sides && e.multiply != nullptr)
          v = vmul(v, vloadu(e.multiply + t * e.multiply_row + n));
        if (sides && e.residual != nullptr)
          v = vadd(v, vloadu(e.residual + t * e.residual_row + n));
        vstoreu(dst + n, v);
      }
    }
    if (g.gamma != nullptr) {
      const auto [mn, mx] = layer_norm_row_range(dst, g.N, g.gamma, g.beta, g.eps, g.h.smoothing);
      g.h.row_given(dst, t, g.N, mn, mx);
    } else {
      g.h.row(dst, t, g.N);
    }
  }
}

// Rows per row group: about kGroupBytes of float32 rows, whole blocks of rows.
template <class Kernel>
inline int64_t group_rows(int64_t N) {
  constexpr int64_t R = Kernel::kRows;
  return std::clamp<int64_t>(Kernel::kGroupBytes / (4 * N) / R * R, R,
                             Kernel::kMaxGroupBlocks * R);
}

// Whether a call has a row pass at all: multiply / residual, LayerNorm or a handoff. Without
// one, the blocks' finished values are the output (a plain QKV projection).
inline bool has_row_pass(const Gemm& g) {
  return g.gamma != nullptr || g.h.q != nullptr || g.e.multiply != nullptr ||
         g.e.residual != nullptr;
}

// Many rows: each task does whole row groups, blocks into a per-thread L2-resident buffer, then
// rows from it to out (the only writes to memory: row by row). A call without a row pass
// writes its blocks straight to out instead (copying the rows from the buffer was a second
// pass over the output: QKV at K = 384 ran ~15% slower with it).
template <class Kernel>
void run_fused(const Gemm& g) {
  const int64_t G = group_rows<Kernel>(g.N), groups = (g.T + G - 1) / G;
  const bool direct = !has_row_pass(g);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    Kernel::enter();
    thread_local std::vector<float> rows;
    if (!direct && rows.size() < static_cast<size_t>(G * g.N)) rows.resize(G * g.N);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r0 = i * G, r1 = std::min(g.T, r0 + G);
      float* dst = direct ? g.out + r0 * g.N : rows.data();
      Kernel::blocks(g, g.core, r0, r1, 0, g.N, dst);
      if (!direct) finish_rows(g, r0, r1, rows.data(), true);
    }
    Kernel::leave();
  });
}

// Few rows (one short text): the blocks split by columns too, then the row pass; out is written.
template <class Kernel>
void run_split(const Gemm& g) {
  constexpr int64_t R = Kernel::kRows, C = Kernel::kBlockCols;
  const int64_t strips = (g.T + R - 1) / R, col_blocks = (g.N + C - 1) / C;
  const int64_t threads = at::get_num_threads();
  const int64_t parts = std::min<int64_t>(col_blocks, std::max<int64_t>(1, 2 * threads / strips));
  at::parallel_for(0, strips * parts, 1, [&](int64_t begin, int64_t end) {
    Kernel::enter();
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / parts, p = i % parts;
      const int64_t r0 = s * R, r1 = std::min(g.T, r0 + R);
      const int64_t n0 = col_blocks * p / parts * C;
      const int64_t n1 = std::min(g.N, col_blocks * (p + 1) / parts * C);
      Kernel::blocks(g, g.e, r0, r1, n0, n1, g.out + r0 * g.N);
    }
    Kernel::leave();
  });
  if (g.gamma != nullptr || g.h.q != nullptr) {
    at::parallel_for(0, g.T, kGrain, [&](int64_t begin, int64_t end) {
      finish_rows(g, begin, end, g.out + begin * g.N, false);
    });
  }
}

// The call on its path: row groups when every thread gets two, else the column split.
template <class Kernel>
void run_gemm(const Gemm& g) {
  if (g.T == 0) return;
  const int64_t G = group_rows<Kernel>(g.N);
  ((g.T + G - 1) / G >= 2 * at::get_num_threads()) ? run_fused<Kernel>(g) : run_split<Kernel>(g);
}

}  // namespace
