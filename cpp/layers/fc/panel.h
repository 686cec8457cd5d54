// The panel pass the forward, the backward and the update of a long batch share, and what
// every fc pass's plan cache keys on.
//
// The pass computes an N x `out_cols` output reducing over `reduced`. The A operand is an
// activation matrix (N x reduced, rows `lda` apart), read in place or copied once. Work items
// are a weight panel of `cols` output columns, re-blocked by the item into a leased buffer
// (reduced / red blocks of red x cols), and the group of N-blocks computed with it; or, with
// weights_first, every panel is re-blocked by a first parallel loop and an item is one
// N-block computed against all of them.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

#include "layers/common/kernels.h"
#include "layers/common/operand.h"
#include "layers/common/reblock.h"
#include "layers/common/scratch.h"
#include "layers/common/work.h"
#include "layers/fc/fc.h"

namespace jb::fc {

// Output block width: weight panels of 512 contiguous bytes per fp32 row pack faster than
// narrower ones, and the update writes its dw in longer row pieces.
constexpr int64_t kCols = 128;

// Activations this large stream from memory: the forward and backward then take turns of
// N-blocks over re-blocked panels (weights_first), and an update whose re-blocked operands
// are larger (and larger than dw) runs as the forward's pass over x^T (long_update).
constexpr int64_t kLargeBytes = int64_t(8) << 20;

// The cache key of a pass: everything its plan depends on. `extra` is the pass's own
// (the forward's bias, the update's dw dtype).
using PlanKey = std::array<int64_t, 14>;
inline PlanKey key_of(const Shape& s, int64_t extra, int64_t threads, const Dispatch& dp, const Blocking* force) {
  return {s.n, s.c, s.k, s.ldz, int64_t(s.dt), int64_t(s.act), extra, threads, int64_t(dp.isa),
          int64_t(dp.bf16_multiply), force ? force->rows : -1, force ? force->cols : -1,
          force ? force->red : -1, force ? force->weights_first : -1};
}

struct PanelPlan : MultiplyPath {
  // `act` is fused into the output (forward only).
  PanelPlan(const Dispatch& dp, const Shape& s, Blocking chosen, int64_t out_cols, int64_t reduced, int64_t lda,
            bool bias, Activation act, int64_t threads, DType out_dt)
      : MultiplyPath(s.dt, dp),
        b(fixed(chosen, s.n, out_cols, reduced)),
        blk(reblock::block_elems(b.red, b.cols, vnni)),
        n(s.n),
        out_cols(out_cols),
        rblk(reduced / b.red),
        aop(s.dt, mul_dt, s.n, reduced, lda),
        kernels(epilogue_desc(out_dt, out_cols, bias, act), s.n, out_cols, b.rows, b.cols, dp.isa),
        groups(ceil_div(out_cols, b.cols), ceil_div(s.n, b.rows), threads),
        panel_bytes(Scratch::aligned(size_t(rblk * blk) * mul_bytes)) {}

  // Runs the pass on the A operand a_src: pack(c0, cols, r, dst) re-blocks reduction block
  // r of the panel of output columns [c0, c0 + cols) into dst; tile(n0, rows, c0, cols,
  // multiply) computes one output block, where multiply(out, bias) is the block's BRGEMM
  // call.
  template <class Pack, class Tile>
  void run(const Executor& ex, const void* a_src, Pack&& pack, Tile&& tile) const {
    run_with(
        ex, aop.bytes(),
        [&](char* dst) {
          if (!aop.copied()) return static_cast<const char*>(a_src);
          parallel_for(ex, aop.items(), [&](int64_t i) { aop.copy(i, a_src, dst); });
          return const_cast<const char*>(dst);
        },
        pack, tile);
  }

  // run's body, with A laid out by the caller: prepare(dst) returns the A operand (rows
  // aop.ld() apart, the multiply dtype), written to dst (a_bytes of scratch) if need be.
  template <class Prepare, class Pack, class Tile>
  void run_with(const Executor& ex, size_t a_bytes, Prepare&& prepare, Pack&& pack, Tile&& tile) const {
    const int64_t npanels = ceil_div(out_cols, b.cols);
    const auto buf = Scratch::get<2>({a_bytes, panel_bytes * size_t(b.weights_first ? npanels : groups.concurrency())});
    const char* a = prepare(buf[0]);
    auto block = [&](int64_t n0, int64_t c0, const char* panel) {
      const int64_t rows = std::min(b.rows, n - n0), cols = std::min(b.cols, out_cols - c0);
      tile(n0, rows, c0, cols, [&](void* out, const float* bias) {
        kernels(rows, cols).strided(a + n0 * aop.ld() * mul_bytes, b.red, panel, blk, rblk, out, bias);
      });
    };
    if (b.weights_first) {
      parallel_for(ex, npanels, [&](int64_t i) {
        const int64_t c0 = i * b.cols, cols = std::min(b.cols, out_cols - c0);
        for (int64_t r = 0; r < rblk; ++r) pack(c0, cols, r, buf[1] + i * panel_bytes + r * blk * mul_bytes);
      });
      parallel_for(ex, ceil_div(n, b.rows), [&](int64_t nb) {
        for (int64_t i = 0; i < npanels; ++i) block(nb * b.rows, i * b.cols, buf[1] + i * panel_bytes);
      });
      return;
    }
    PanelPool panels(buf[1], panel_bytes, groups.concurrency());
    parallel_for(ex, groups.items(), [&](int64_t i) {
      const int64_t c0 = groups.panel(i) * b.cols, cols = std::min(b.cols, out_cols - c0);
      const PanelPool::Lease panel(panels);
      for (int64_t r = 0; r < rblk; ++r) pack(c0, cols, r, panel.data + r * blk * mul_bytes);
      for (int64_t nb = groups.first(i); nb < groups.last(i); ++nb) block(nb * b.rows, c0, panel.data);
    });
  }

  const Blocking b;  // the block of the reduced dimension divides it
  const int64_t blk;  // elements of one re-blocked reduction block
  const int64_t n, out_cols, rblk;
  const ActivationOperand aop;
  const KernelSet kernels;
  const WorkGroups groups;
  const size_t panel_bytes;

 private:
  static Blocking fixed(Blocking b, int64_t n, int64_t out_cols, int64_t reduced) {
    b = clamped(b, n, out_cols);
    if (b.red <= 0 || reduced % b.red) b.red = reduced;
    return b;
  }
  BrgemmDesc epilogue_desc(DType out_dt, int64_t out_cols, bool bias, Activation act) const {
    BrgemmDesc d = desc(b.red, aop.ld(), b.cols, out_cols, out_dt);
    d.bias = bias;
    d.act = act;
    return d;
  }
};

}  // namespace jb::fc
