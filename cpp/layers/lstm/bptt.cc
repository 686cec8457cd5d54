// The LSTM's backward through time. Per step t = T-1 .. 0, item (K-block, group of N-blocks):
//   dh  = dy_t + (da_{t+1} @ R^T: one BRGEMM over the 4K-blocks; at T-1 dh_last or 0)
//         (with last_step, row n's dh_last and dc_last are added at its step last_step[n])
//   da_t, dc_{t-1} from the saved gates and cell states (the fused cell, the tile hot in L1)
// then dh0 = da_0 @ R^T. dc is kept in dc0 in place (each tile has one owner per step).
#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "layers/common/emulation.h"
#include "layers/common/scratch.h"
#include "layers/lstm/plan.h"

namespace jb::lstm {

namespace {

void check_dtypes(const Shape& s, const BpttArgs& a) {
  auto ok = [&](InView v) { return !v || v.dt == s.dt; };
  if (!ok(a.gates) || !ok(a.dy) || !ok(a.dh_last) || !ok(a.da) || !ok(a.dh0))
    throw std::invalid_argument("lstm bptt: gates, dy, dh_last, da and dh0 must have the compute dtype");
  check_products(s, "lstm bptt");
}

}  // namespace

void bptt(const Executor& ex, const Dispatch& dp, const Shape& s, const BpttArgs& a, const Blocking* force) {
  const int64_t K = s.k, G4 = kGates * s.k, N = s.n, T = s.t;
  if (K <= 0) return;
  check_dtypes(s, a);
  const size_t es = dtype_size(s.dt);
  std::memset(a.db, 0, size_t(G4) * sizeof(float));
  if (N <= 0) return;
  check_last_step(s, a.last_step, "lstm bptt");
  // With last_step the carry's gradients enter at each row's step (below), else at T-1.
  if (a.dc_last && !a.last_step) std::memcpy(a.dc0, a.dc_last, size_t(N * K) * sizeof(float));
  else std::memset(a.dc0, 0, size_t(N * K) * sizeof(float));
  if (T <= 0) {
    if (a.dh_last) std::memcpy(a.dh0.data, a.dh_last.data, size_t(N * K) * es);
    else std::memset(a.dh0.data, 0, size_t(N * K) * es);
    return;
  }
  const auto plan = bptt_plan(dp, s, ex.num_threads, force);
  const BpttPlan& p = *plan;
  const Blocking& b = p.b;
  const size_t ks = p.mul_bytes;

  // Emulating, the cell writes da_t in fp32 to a stage, whose pieces are split into the
  // copies' parts; R^T is split per K-block with tmp (2 x depth x sub-panel floats each).
  const emulation::Terms& tm = p.terms;
  const int64_t tmp_floats = tm.split ? 2 * p.depth * p.sub_width : 0;
  const auto buf = Scratch::get<6>({size_t(p.r_part * tm.parts[1]) * ks, size_t(2 * p.da_part * tm.parts[0]) * ks,
                                    size_t(N * K) * sizeof(float), size_t(p.n_blocks * G4) * sizeof(float),
                                    tm.split ? size_t(p.da_part) * sizeof(float) : 0,
                                    size_t(p.k_blocks * tmp_floats) * sizeof(float)});
  char* const r_t = buf[0];      // R^T panels [K-block][sub-panel][4K / depth] blocks
  char* const da_copy = buf[1];  // da_t for the next step's A, alternating
  auto* const da_stage = reinterpret_cast<float*>(buf[4]);
  float* const dh_rec = reinterpret_cast<float*>(buf[2]);
  float* const db_partial = reinterpret_cast<float*>(buf[3]);  // per N-block
  std::memset(db_partial, 0, size_t(p.n_blocks * G4) * sizeof(float));

  // R^T panel kb, sub-panel j, block d: element (q, jj) = R[k0 + j * sub + jj, d * depth + q].
  parallel_for(ex, p.k_blocks, [&](int64_t kb) {
    const int64_t k0 = kb * b.cols, cols = std::min(b.cols, K - k0);
    for (int64_t j = 0; j * p.sub_width < cols; ++j)
      for (int64_t d = 0; d < p.depth_blocks; ++d)
        emulation::pack(tm, 1, a.r.at((k0 + j * p.sub_width) * G4 + d * p.depth), a.r.dt, G4, true, p.depth,
                        std::min(p.sub_width, cols - j * p.sub_width), p.depth, p.sub_width, p.mul_dt, p.vnni,
                        r_t + ((kb * p.subpanels + j) * p.depth_blocks + d) * p.block_elems * ks, p.r_part, p.isa,
                        reinterpret_cast<float*>(buf[5]) + kb * tmp_floats);
  });

  // dh_rec's tile at (n0, K-block kb) = da @ R^T from a step's da copy.
  auto recurrent = [&](int64_t kb, int64_t n0, int64_t rows, int64_t cols, const char* da) {
    for (int64_t j = 0; j * p.sub_width < cols; ++j) {
      const Brgemm& kernel = p.kernels(rows, std::min(p.sub_width, cols - j * p.sub_width));
      const char* at = da + n0 * p.copy_ld * ks;
      const char* panel = r_t + (kb * p.subpanels + j) * p.depth_blocks * p.block_elems * ks;
      float* out = dh_rec + n0 * K + kb * b.cols + j * p.sub_width;
      if (tm.split)  // the batch over (term, block)
        kernel.offsets(at, p.da_offs.data(), panel, p.r_offs.data(), int64_t(p.da_offs.size()), out);
      else
        kernel.strided(at, p.depth, panel, p.block_elems, p.depth_blocks, out);
    }
  };
  for (int64_t t = T - 1; t >= 0; --t) {
    const int64_t copy = p.da_part * tm.parts[0];  // one copy's elements, all its parts
    const char* da_later = da_copy + (t + 1) % 2 * copy * ks;
    char* da_now = da_copy + t % 2 * copy * ks;
    const float* c_prev = t ? a.cs + (t - 1) * N * K : a.c0;
    parallel_for(ex, p.groups.items(), [&](int64_t i) {
      const int64_t kb = p.groups.panel(i), k0 = kb * b.cols, cols = std::min(b.cols, K - k0);
      for (int64_t nb = p.groups.first(i); nb < p.groups.last(i); ++nb) {
        const int64_t n0 = nb * b.rows, rows = std::min(b.rows, N - n0);
        float* dh_in = dh_rec + n0 * K + k0;
        if (t + 1 < T) recurrent(kb, n0, rows, cols, da_later);
        else if (a.dh_last && !a.last_step) copy_rows(a.dh_last.at(n0 * K + k0), s.dt, K, dh_in, DType::f32, K, rows, cols, cols);
        else for (int64_t q = 0; q < rows; ++q) std::fill_n(dh_in + q * K, cols, 0.0f);
        if (a.last_step)
          for (int64_t n = n0; n < n0 + rows; ++n)
            if (a.last_step[n] == t) {
              const int64_t at = n * K + k0;
              if (a.dc_last) add_row(a.dc_last + at, DType::f32, a.dc0 + at, cols);
              if (a.dh_last) add_row(a.dh_last.at(at), s.dt, dh_rec + at, cols);
            }
        for_pieces(k0, cols, p.saved_gates.block, [&](int64_t k, int64_t w) {
          CellBackward c{rows, w, K, a.gates.at(p.saved_gates.at(t, n0, k)), p.saved_gates.row(), p.saved_gates.block,
                         a.cs + (t * N + n0) * K + k, c_prev + n0 * K + k, K, dh_rec + n0 * K + k,
                         a.dy.at(row_of(s, t, n0) * K + k), row_step(s) * K, a.dc0 + n0 * K + k,
                         a.da.at(row_of(s, t, n0) * p.da_ld + k), row_step(s) * p.da_ld,
                         tm.split ? static_cast<void*>(da_stage + n0 * p.copy_ld + k) : da_now + (n0 * p.copy_ld + k) * ks,
                         p.copy_ld, db_partial + nb * G4 + k};
          p.cell(c);
          if (tm.split)  // da_t's parts, gate by gate
            for (int q = 0; q < kGates; ++q)
              emulation::split_rows(tm, 0, da_stage + n0 * p.copy_ld + q * K + k, p.copy_ld,
                                    da_now + (n0 * p.copy_ld + q * K + k) * ks, p.mul_dt, p.copy_ld, p.da_part, rows, w,
                                    w);
        });
      }
      stream_fence();
    });
  }
  // dh0 = da_0 @ R^T, and the bias gradient from the per-N-block partials.
  parallel_for(ex, p.groups.items(), [&](int64_t i) {
    const int64_t kb = p.groups.panel(i), k0 = kb * b.cols, cols = std::min(b.cols, K - k0);
    for (int64_t nb = p.groups.first(i); nb < p.groups.last(i); ++nb) {
      const int64_t n0 = nb * b.rows, rows = std::min(b.rows, N - n0);
      recurrent(kb, n0, rows, cols, da_copy);
      copy_rows(dh_rec + n0 * K + k0, DType::f32, K, a.dh0.at(n0 * K + k0), s.dt, K, rows, cols, cols);
    }
  });
  for (int64_t nb = 0; nb < p.n_blocks; ++nb)
    for (int64_t j = 0; j < G4; ++j) a.db[j] += db_partial[nb * G4 + j];
}

}  // namespace jb::lstm
