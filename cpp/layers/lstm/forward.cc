// The LSTM forward over the whole sequence. Execution takes its scratch on the calling
// thread, re-blocks the weights and lays out A once (a parallel pass), then runs one
// parallel_for per time step that only loops, calls kernels and the fused cell.
#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "layers/common/emulation.h"
#include "layers/common/reblock.h"
#include "layers/common/scratch.h"
#include "layers/lstm/plan.h"

namespace jb::lstm {

namespace {

// Packs rows [r0, r0 + depth) of the stacked weights [W; R; 0] (W: rows [0, h_col), R: rows
// [h_col, h_col + k)), columns [col, col + cols) of both (leading dimension ld), into one
// batch element (its parts `part` elements apart, emulating). A block straddling W and R is
// staged contiguously first, in `stage` (kMaxDepth x kMaxCols elements of the weights'
// dtype; then, emulating, 2 x kMaxDepth x kMaxCols floats for the split).
void pack_stacked(InView w, InView r, int64_t h_col, int64_t k, int64_t ld, int64_t col, int64_t r0, int64_t depth,
                  int64_t cols, int64_t sub_width, DType mul_dt, bool vnni, char* dst, char* stage, Isa isa,
                  const emulation::Terms& terms, int64_t part) {
  float* tmp = reinterpret_cast<float*>(stage + kMaxDepth * kMaxCols * int64_t(dtype_size(w.dt)));
  const int64_t r1 = r0 + depth;
  if (r1 <= h_col || r0 >= h_col) {  // all from W, or all from R and its zero pad
    const bool from_w = r1 <= h_col;
    const int64_t src_row = from_w ? r0 : r0 - h_col;
    const int64_t rows = std::max<int64_t>(0, std::min(depth, (from_w ? h_col : k) - src_row));
    emulation::pack(terms, 1, (from_w ? w : r).at(src_row * ld + col), w.dt, ld, false, rows, cols, depth, sub_width,
                    mul_dt, vnni, dst, part, isa, tmp);
    return;
  }
  const size_t ws = dtype_size(w.dt);
  const int64_t w_rows = h_col - r0, r_rows = std::min(r1 - h_col, k);
  for (int64_t q = 0; q < w_rows; ++q)
    std::memcpy(stage + q * cols * int64_t(ws), w.at((r0 + q) * ld + col), size_t(cols) * ws);
  for (int64_t q = 0; q < r_rows; ++q)
    std::memcpy(stage + (w_rows + q) * cols * int64_t(ws), r.at(q * ld + col), size_t(cols) * ws);
  emulation::pack(terms, 1, stage, w.dt, cols, false, w_rows + r_rows, cols, depth, sub_width, mul_dt, vnni, dst, part,
                  isa, tmp);
}

void check_dtypes(const Shape& s, const ForwardArgs& a) {
  const bool saved = bool(a.saved.gates);
  auto ok = [&](InView v) { return !v || v.dt == s.dt; };
  if (!ok(a.x) || !ok(a.h0) || !ok(a.y) || !ok(a.h_last) || !ok(a.saved.gates) || !ok(a.saved.xh))
    throw std::invalid_argument("lstm forward: x, h0, y, h_last and the saves must have the compute dtype");
  if (a.w.dt != a.r.dt) throw std::invalid_argument("lstm forward: w and r must share a dtype");
  if (saved != bool(a.saved.xh) || saved != (a.saved.cs != nullptr))
    throw std::invalid_argument("lstm forward: the saves are all set or all null");
  check_products(s, "lstm forward");
}

}  // namespace

void forward(const Executor& ex, const Dispatch& dp, const Shape& s, const ForwardArgs& a, const Blocking* force) {
  if (s.n <= 0 || s.k <= 0) return;
  check_dtypes(s, a);
  check_last_step(s, a.last_step, "lstm forward");
  if (s.t <= 0) {  // an empty sequence: the carry passes through
    std::memcpy(a.c_last, a.c0, size_t(s.n * s.k) * sizeof(float));
    std::memcpy(a.h_last.data, a.h0.data, size_t(s.n * s.k) * dtype_size(s.dt));
    return;
  }
  const auto plan = forward_plan(dp, s, ex.num_threads, force);
  const ForwardPlan& p = *plan;
  const Blocking& b = p.b;
  const bool save = bool(a.saved.gates);
  const int64_t K = s.k, G4 = kGates * s.k, N = s.n, T = s.t;
  const size_t ks = p.mul_bytes;
  // A is the saved xh itself when training in the multiply dtype; otherwise xh is filled
  // from x and y after the loop.
  const emulation::Terms& tm = p.terms;
  const bool a_is_xh = a.saved.xh && s.dt == p.mul_dt && !tm.split;

  // Scratch: the weight panels, A, the stages of pack_stacked and the gate tiles (one of
  // each per item running at once). The BRGEMMs write an item's gates to its own tile, hot
  // in L2, from which the cell reads them and saves them when training: fp32 streamed to
  // memory as they are, bf16 as bf16 copies.
  const size_t panels = size_t(p.w_part * tm.parts[1]) * ks;
  const size_t a_bytes = a_is_xh ? 0 : size_t(p.a_part * tm.parts[0]) * ks;
  const size_t stage = size_t(kMaxDepth * kMaxCols) * (dtype_size(a.w.dt) + (tm.split ? 2 * sizeof(float) : 0));
  const int64_t stages = std::max<int64_t>(1, ex.num_threads);
  const size_t tile = size_t(b.rows * p.tile_ld) * sizeof(float);
  // Selecting each row's carry without saving the cell states: c runs in a buffer of its own.
  const bool own_state = a.last_step && !save;
  const auto buf = Scratch::get<5>({panels, a_bytes, size_t(stages) * stage, size_t(stages) * round_up(tile, 64),
                                    own_state ? size_t(N * K) * sizeof(float) : 0});
  PanelPool stage_pool(buf[2], stage, stages), tile_pool(buf[3], tile, stages);
  char* const weights = buf[0];
  float* const state = own_state ? reinterpret_cast<float*>(buf[4]) : a.c_last;
  char* const a_all = a_is_xh ? static_cast<char*>(a.saved.xh.data) : buf[1];
  // Step t's A.
  auto a_step = [&](int64_t t) { return a_all + row_of(s, t, 0) * p.a_ld * ks; };

  // The cell state: the saved c_t, or `state` (c_last or a buffer) updated in place.
  if (!save) std::memcpy(state, a.c0, size_t(N * K) * sizeof(float));

  // Re-blocking, once per call: the weight panels (one item per gate and K-block), and A
  // (one item per step: x_t, h0 into step 0's h part, zero pads).
  const int64_t weight_items = kGates * p.k_blocks;
  parallel_for(ex, weight_items + T, [&](int64_t i) {
    if (i < weight_items) {
      const int gate = int(i / p.k_blocks);
      const int64_t kb = i % p.k_blocks, k0 = kb * b.cols, cols = std::min(b.cols, K - k0);
      // Rows [0, h_col) of the panel come from W, [h_col, h_col + K) from R (a block may
      // straddle the two), zeros after.
      const PanelPool::Lease st(stage_pool);
      for (int64_t j = 0; j < p.subpanels && j * p.sub_width < cols; ++j) {
        const int64_t col = gate * K + k0 + j * p.sub_width, w_cols = std::min(p.sub_width, cols - j * p.sub_width);
        char* dst = weights + p.panel(gate, kb, j) * ks;
        for (int64_t d = 0; d < p.depth_blocks; ++d)
          pack_stacked(a.w, a.r, p.h_col, K, G4, col, d * p.depth, p.depth, w_cols, p.sub_width, p.mul_dt, p.vnni,
                       dst + d * p.block_elems * ks, st.data, p.isa, tm, p.w_part);
      }
      return;
    }
    const int64_t t = i - weight_items;  // step t's A: [x_t | h0 (t = 0) | 0]
    char* dst = a_step(t);
    if (tm.split) {  // each part's, from fp32 x and h0 (emulation takes fp32 only)
      emulation::split_rows(tm, 0, reinterpret_cast<const float*>(a.x.at(row_of(s, t, 0) * s.c)), row_step(s) * s.c, dst,
                            p.mul_dt, p.a_stride, p.a_part, N, s.c, s.c);
      for (int q = 0; q < tm.parts[0]; ++q)
        for (int64_t n = 0; n < N; ++n)  // the h part's padding, and for t = 0 h0 (below)
          std::memset(dst + (q * p.a_part + n * p.a_stride + s.c) * ks, 0, size_t(p.a_ld - s.c) * ks);
      if (t == 0)
        emulation::split_rows(tm, 0, static_cast<const float*>(a.h0.data), K, dst + s.c * ks, p.mul_dt, p.a_stride,
                              p.a_part, N, K, K);
      return;
    }
    copy_rows(a.x.at(row_of(s, t, 0) * s.c), s.dt, row_step(s) * s.c, dst, p.mul_dt, p.a_stride, N, s.c, s.c);
    if (t == 0) {
      copy_rows(a.h0.data, s.dt, K, dst + s.c * ks, p.mul_dt, p.a_stride, N, K, p.a_ld - s.c);
    } else if (p.a_ld > s.c + K) {
      for (int64_t n = 0; n < N; ++n) std::memset(dst + (n * p.a_stride + s.c + K) * ks, 0, size_t(p.a_ld - s.c - K) * ks);
    }
  });

  // The time loop: one parallel_for per step (the step barrier).
  for (int64_t t = 0; t < T; ++t) {
    const char* a_t = a_step(t);
    char* h_next = t + 1 < T ? a_step(t + 1) + p.h_col * ks : nullptr;
    const float* c_prev = save ? (t ? a.saved.cs + (t - 1) * N * K : a.c0) : state;
    float* c_next = save ? a.saved.cs + t * N * K : state;
    parallel_for(ex, p.groups.items(), [&](int64_t i) {
      const int64_t kb = p.groups.panel(i), k0 = kb * b.cols, cols = std::min(b.cols, K - k0);
      const PanelPool::Lease lease(tile_pool);
      float* const gates = reinterpret_cast<float*>(lease.data);  // gate q at column q * b.cols
      for (int64_t nb = p.groups.first(i); nb < p.groups.last(i); ++nb) {
        const int64_t n0 = nb * b.rows, rows = std::min(b.rows, N - n0);
        for (int q = 0; q < kGates; ++q)
          for (int64_t j = 0; j * p.sub_width < cols; ++j) {
            const Brgemm& kernel = (*p.gate_kernels[q])(rows, std::min(p.sub_width, cols - j * p.sub_width));
            const char* at = a_t + n0 * p.a_stride * ks;
            const char* panel = weights + p.panel(q, kb, j) * ks;
            float* out = gates + q * b.cols + j * p.sub_width;
            const float* bias = a.bias + q * K + k0 + j * p.sub_width;
            if (tm.split)  // the batch over (term, block)
              kernel.offsets(at, p.a_offs.data(), panel, p.w_offs.data(), int64_t(p.a_offs.size()), out, bias);
            else
              kernel.strided(at, p.depth, panel, p.block_elems, p.depth_blocks, out, bias);
          }
        // The cell per piece of the tile within one block of the saved gates.
        for_pieces(k0, cols, save ? p.saved_gates.block : K, [&](int64_t k, int64_t w) {
          CellForward c{rows, w, gates + (k - k0), p.tile_ld, b.cols, c_prev + n0 * K + k, c_next + n0 * K + k, K,
                        a.y.at(row_of(s, t, n0) * K + k), row_step(s) * K,
                        h_next && !tm.split ? h_next + (n0 * p.a_stride + k) * ks : nullptr, p.a_stride,
                        save ? a.saved.gates.at(p.saved_gates.at(t, n0, k)) : nullptr, p.saved_gates.row(),
                        p.saved_gates.block};
          p.cell(c);
          if (h_next && tm.split)  // h_t's parts into the next step's A, from y (fp32)
            emulation::split_rows(tm, 0, static_cast<const float*>(c.y), c.y_ld, h_next + (n0 * p.a_stride + k) * ks,
                                  p.mul_dt, p.a_stride, p.a_part, rows, w, w);
        });
        // The carry of the rows whose last step this is, while their pieces are hot.
        if (a.last_step)
          for (int64_t n = n0; n < n0 + rows; ++n)
            if (a.last_step[n] == t) {
              std::memcpy(a.c_last + n * K + k0, c_next + n * K + k0, size_t(cols) * sizeof(float));
              std::memcpy(a.h_last.at(n * K + k0), a.y.at(row_of(s, t, n) * K + k0), size_t(cols) * dtype_size(s.dt));
            }
      }
      stream_fence();
    });
  }

  // The final carry (each row's own, with last_step, is out already).
  if (!a.last_step) {
    copy_rows(a.y.at(row_of(s, T - 1, 0) * K), s.dt, row_step(s) * K, a.h_last.data, s.dt, K, N, K, K);
    if (save) std::memcpy(a.c_last, a.saved.cs + (T - 1) * N * K, size_t(N * K) * sizeof(float));
  }

  // xh when the loop did not run in it: [x_t | h_{t-1} | 0] from x, h0 and y, one item a step.
  if (a.saved.xh && !a_is_xh) {
    const int64_t ld = p.a_ld, stride = row_step(s) * ld;
    const size_t es = dtype_size(s.dt);
    parallel_for(ex, T, [&](int64_t t) {
      char* dst = a.saved.xh.at(row_of(s, t, 0) * ld);
      copy_rows(a.x.at(row_of(s, t, 0) * s.c), s.dt, row_step(s) * s.c, dst, s.dt, stride, N, s.c, s.c);
      if (t == 0)
        copy_rows(a.h0.data, s.dt, K, dst + s.c * es, s.dt, stride, N, K, ld - s.c);
      else
        copy_rows(a.y.at(row_of(s, t - 1, 0) * K), s.dt, row_step(s) * K, dst + s.c * es, s.dt, stride, N, K,
                  ld - s.c);
    });
  }
}

}  // namespace jb::lstm
