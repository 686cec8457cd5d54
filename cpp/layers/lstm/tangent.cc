// The LSTM's tangent (forward mode) over the whole sequence. R is re-blocked once (its four
// gate panels, as the forward's rows of R), then per step t = 0 .. T-1, item (K-block, group
// of N-blocks):
//   tpre = th_{t-1} @ R (one BRGEMM per gate block, over the blocks of K, into a gate tile)
//          + tb + the incoming tangent pieces (tx_t @ W + x_t @ tW + h_{t-1} @ tR)
//   tc_t, th_t from the saved gates and cell states (the fused tangent cell, the tile hot)
// th_t goes to the next step's buffer (its bf16 parts, emulating); tc is kept in place.
#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "layers/common/emulation.h"
#include "layers/common/scratch.h"
#include "layers/lstm/plan.h"

namespace jb::lstm {

namespace {

void check_dtypes(const Shape& s, const TangentArgs& a) {
  auto ok = [&](InView v) { return !v || v.dt == s.dt; };
  if (!ok(a.gates) || !ok(a.tp[0]) || !ok(a.tp[1]) || !ok(a.th0) || !ok(a.ty) || !ok(a.th_last))
    throw std::invalid_argument("lstm tangent: gates, tp, th0, ty and th_last must have the compute dtype");
  check_products(s, "lstm tangent");
}

}  // namespace

void tangent(const Executor& ex, const Dispatch& dp, const Shape& s, const TangentArgs& a, const Blocking* force) {
  const int64_t K = s.k, G4 = kGates * s.k, N = s.n, T = s.t;
  if (N <= 0 || K <= 0) return;
  check_dtypes(s, a);
  check_last_step(s, a.last_step, "lstm tangent");
  const size_t es = dtype_size(s.dt);
  if (T <= 0) {  // an empty sequence: the carry's tangent passes through
    std::memcpy(a.tc_last, a.tc0, size_t(N * K) * sizeof(float));
    std::memcpy(a.th_last.data, a.th0.data, size_t(N * K) * es);
    return;
  }
  const auto plan = tangent_plan(dp, s, ex.num_threads, force);
  const TangentPlan& p = *plan;
  const Blocking& b = p.b;
  const size_t ks = p.mul_bytes;
  const emulation::Terms& tm = p.terms;

  // Scratch: R's panels, the two th buffers (all parts each), the gate tiles (one per item
  // running at once), the packing's split space (one per panel item) and, selecting each
  // row's carry, tc's own buffer (else tc runs in tc_last).
  const int64_t weight_items = kGates * p.k_blocks;
  const int64_t tmp_floats = tm.split ? 2 * p.depth * p.sub_width : 0;
  const int64_t copy = p.a_part * tm.parts[0];  // one th buffer's elements, all its parts
  const int64_t stages = std::max<int64_t>(1, ex.num_threads);
  const size_t tile = round_up(size_t(b.rows * p.tile_ld) * sizeof(float), 64);
  const auto buf = Scratch::get<5>({size_t(p.w_part * tm.parts[1]) * ks, size_t(2 * copy) * ks, size_t(stages) * tile,
                                    size_t(weight_items * tmp_floats) * sizeof(float),
                                    a.last_step ? size_t(N * K) * sizeof(float) : 0});
  char* const weights = buf[0];
  char* const th_bufs = buf[1];
  PanelPool tile_pool(buf[2], tile, stages);
  float* const tc = a.last_step ? reinterpret_cast<float*>(buf[4]) : a.tc_last;
  std::memcpy(tc, a.tc0, size_t(N * K) * sizeof(float));

  // R's panels (one item per gate and K-block), and th0 into the first buffer with both
  // buffers' padding zeroed (the cells write the first K columns only).
  parallel_for(ex, weight_items + 1, [&](int64_t i) {
    if (i == weight_items) {
      std::memset(th_bufs, 0, size_t(2 * copy) * ks);
      if (tm.split)
        emulation::split_rows(tm, 0, static_cast<const float*>(a.th0.data), K, th_bufs, p.mul_dt, p.a_ld, p.a_part, N,
                              K, K);
      else
        copy_rows(a.th0.data, s.dt, K, th_bufs, p.mul_dt, p.a_ld, N, K, K);
      return;
    }
    const int gate = int(i / p.k_blocks);
    const int64_t kb = i % p.k_blocks, k0 = kb * b.cols, cols = std::min(b.cols, K - k0);
    float* tmp = reinterpret_cast<float*>(buf[3]) + i * tmp_floats;
    for (int64_t j = 0; j < p.subpanels && j * p.sub_width < cols; ++j) {
      const int64_t col = gate * K + k0 + j * p.sub_width, w_cols = std::min(p.sub_width, cols - j * p.sub_width);
      char* dst = weights + p.panel(gate, kb, j) * ks;
      for (int64_t d = 0; d < p.depth_blocks; ++d) {
        const int64_t r0 = d * p.depth, rows = std::max<int64_t>(0, std::min(p.depth, K - r0));
        emulation::pack(tm, 1, a.r.at(r0 * G4 + col), a.r.dt, G4, false, rows, w_cols, p.depth, p.sub_width,
                        p.mul_dt, p.vnni, dst + d * p.block_elems * ks, p.w_part, p.isa, tmp);
      }
    }
  });

  // The time loop: one parallel_for per step (the step barrier).
  for (int64_t t = 0; t < T; ++t) {
    const char* th_prev = th_bufs + t % 2 * copy * ks;
    char* th_next = t + 1 < T ? th_bufs + (t + 1) % 2 * copy * ks : nullptr;
    const float* c_prev = t ? a.cs + (t - 1) * N * K : a.c0;
    const float* c_now = a.cs + t * N * K;
    parallel_for(ex, p.groups.items(), [&](int64_t i) {
      const int64_t kb = p.groups.panel(i), k0 = kb * b.cols, cols = std::min(b.cols, K - k0);
      const PanelPool::Lease lease(tile_pool);
      float* const pre = reinterpret_cast<float*>(lease.data);  // gate q at column q * b.cols
      for (int64_t nb = p.groups.first(i); nb < p.groups.last(i); ++nb) {
        const int64_t n0 = nb * b.rows, rows = std::min(b.rows, N - n0);
        const char* at = th_prev + n0 * p.a_ld * ks;
        for (int q = 0; q < kGates; ++q)
          for (int64_t j = 0; j * p.sub_width < cols; ++j) {
            const Brgemm& kernel = p.kernels(rows, std::min(p.sub_width, cols - j * p.sub_width));
            const char* panel = weights + p.panel(q, kb, j) * ks;
            float* out = pre + q * b.cols + j * p.sub_width;
            if (tm.split)  // the batch over (term, block)
              kernel.offsets(at, p.a_offs.data(), panel, p.w_offs.data(), int64_t(p.a_offs.size()), out);
            else
              kernel.strided(at, p.depth, panel, p.block_elems, p.depth_blocks, out);
          }
        // The cell per piece of the tile within one block of the saved gates.
        const int64_t row0 = row_of(s, t, n0), rstep = row_step(s);
        for_pieces(k0, cols, p.saved_gates.block, [&](int64_t k, int64_t w) {
          CellTangent c{rows, w, pre + (k - k0), p.tile_ld, b.cols,
                        {a.tp[0] ? a.tp[0].at(row0 * G4 + k) : nullptr, a.tp[1] ? a.tp[1].at(row0 * G4 + k) : nullptr},
                        rstep * G4, K, a.tb + (a.tb_rows ? n0 * G4 : 0) + k, a.tb_rows ? G4 : 0,
                        a.gates.at(p.saved_gates.at(t, n0, k)), p.saved_gates.row(), p.saved_gates.block,
                        c_now + n0 * K + k, c_prev + n0 * K + k, K, tc + n0 * K + k, a.ty.at(row0 * K + k), rstep * K,
                        th_next && !tm.split ? th_next + (n0 * p.a_ld + k) * ks : nullptr, p.a_ld};
          p.cell(c);
          if (th_next && tm.split)  // th_t's parts into the next step's buffer, from ty (fp32)
            emulation::split_rows(tm, 0, static_cast<const float*>(c.ty), c.ty_ld, th_next + (n0 * p.a_ld + k) * ks,
                                  p.mul_dt, p.a_ld, p.a_part, rows, w, w);
        });
        // The carry's tangent of the rows whose last step this is, while their pieces are hot.
        if (a.last_step)
          for (int64_t n = n0; n < n0 + rows; ++n)
            if (a.last_step[n] == t) {
              std::memcpy(a.tc_last + n * K + k0, tc + n * K + k0, size_t(cols) * sizeof(float));
              std::memcpy(a.th_last.at(n * K + k0), a.ty.at(row_of(s, t, n) * K + k0), size_t(cols) * es);
            }
      }
    });
  }
  // The final carry's tangent (each row's own, with last_step, is out already; tc is in
  // tc_last without).
  if (!a.last_step) copy_rows(a.ty.at(row_of(s, T - 1, 0) * K), s.dt, row_step(s) * K, a.th_last.data, s.dt, K, N, K, K);
}

}  // namespace jb::lstm
