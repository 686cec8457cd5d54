// The panel pass the forward, the backward and the update of a long batch share, and what
// every fc pass's plan cache keys on.
//
// The pass computes an N x `out_cols` output reducing over `reduced`. The A operand is an
// activation matrix (N x reduced, rows `lda` apart), read in place or copied once. It is
// added to a Job as phases whose items only capture values (see parallel/job.h). Work items
// are a weight panel of `cols` output columns, re-blocked by the item into a leased buffer
// (reduced / red blocks of red x cols), and the group of N-blocks computed with it; or, with
// weights_first, every panel is re-blocked by a first parallel loop and an item is one
// N-block computed against all of them. Emulated products (Shape::products) split A as it
// is copied and each panel block as it is re-blocked; a tile's batch then walks every
// (term, reduction block) pair.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "layers/common/kernels.h"
#include "layers/common/operand.h"
#include "layers/common/reblock.h"
#include "layers/common/scratch.h"
#include "layers/common/work.h"
#include "layers/fc/fc.h"
#include "parallel/job.h"

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
using PlanKey = std::array<int64_t, 15>;
inline PlanKey key_of(const Shape& s, int64_t extra, int64_t threads, const Dispatch& dp, const Blocking* force) {
  return {s.n, s.c, s.k, s.ldz, int64_t(s.dt), int64_t(s.act), extra, threads, int64_t(dp.isa),
          int64_t(dp.bf16_multiply), force ? force->rows : -1, force ? force->cols : -1,
          force ? force->red : -1, force ? force->weights_first : -1, s.products};
}

struct PanelPlan : MultiplyPath {
  // `act` is fused into the output (forward only).
  PanelPlan(const Dispatch& dp, const Shape& s, Blocking chosen, int64_t out_cols, int64_t reduced, int64_t lda,
            bool bias, Activation act, int64_t threads, DType out_dt)
      : MultiplyPath(operand_dtype(s), dp),
        terms(emulation::terms(s.products)),
        b(fixed(chosen, s.n, out_cols, reduced)),
        blk(reblock::block_elems(b.red, b.cols, vnni)),
        n(s.n),
        out_cols(out_cols),
        rblk(reduced / b.red),
        part_step(rblk * blk),
        aop(s.dt, mul_dt, s.n, reduced, lda, terms, 0),
        kernels(epilogue_desc(out_dt, out_cols, bias, act), s.n, out_cols, b.rows, b.cols, dp.isa),
        groups(ceil_div(out_cols, b.cols), ceil_div(s.n, b.rows), threads),
        tmp_offset(Scratch::aligned(size_t(part_step * terms.parts[1]) * mul_bytes)),
        panel_bytes(tmp_offset + (terms.split ? Scratch::aligned(size_t(2 * b.red * b.cols) * sizeof(float)) : 0)) {
    // term-major, as ops/emulation.py sums them: the small products first
    for (int t = 0; terms.split && t < terms.count; ++t)
      for (int64_t r = 0; r < rblk; ++r) {
        a_offs.push_back(r * b.red + terms.of[0][t] * aop.step());
        b_offs.push_back(r * blk + terms.of[1][t] * part_step);
      }
  }

  // Adds the pass on the A operand a_src to `job` (whose keep must hold this plan):
  // pack(c0, cols, r, dst, tmp) re-blocks reduction block r of the panel of output columns
  // [c0, c0 + cols) into dst (its parts part_step elements apart; tmp: 2 * b.red * b.cols
  // floats for emulation::pack); tile(n0, rows, c0, cols, multiply) computes one output block,
  // where multiply(out, bias) is the block's BRGEMM call. Both are copied into the job.
  template <class Pack, class Tile>
  void add(Job& job, const void* a_src, Pack pack, Tile tile) const {
    const auto buf = job_scratch<2>(job, {aop.bytes(), scratch_bytes()});
    const char* a = static_cast<const char*>(a_src);
    if (aop.copied()) {
      const ActivationOperand* op = &aop;
      char* dst = buf[0];
      job.add(aop.items(), [op, a_src, dst](int64_t i) { op->copy(i, a_src, dst); });
      a = dst;
    }
    add_with(job, a, buf[1], std::move(pack), std::move(tile));
  }

  // Panel buffers add_with needs.
  size_t scratch_bytes() const {
    return panel_bytes * size_t(b.weights_first ? ceil_div(out_cols, b.cols) : groups.concurrency());
  }

  // add's phases, with the A operand laid out by the caller at `a` (rows aop.ld() apart, the
  // multiply dtype, parts aop.step() apart, ready when the job's earlier phases are done)
  // and scratch_bytes() of panel buffers at `panels`.
  template <class Pack, class Tile>
  void add_with(Job& job, const char* a, char* panels, Pack pack, Tile tile) const {
    const PanelPlan* p = this;
    const int64_t npanels = ceil_div(out_cols, b.cols);
    auto block = [p, a, tile](int64_t n0, int64_t c0, const char* panel) {
      const int64_t rows = std::min(p->b.rows, p->n - n0), cols = std::min(p->b.cols, p->out_cols - c0);
      tile(n0, rows, c0, cols, [&](void* out, const float* bias) {
        const char* an = a + n0 * p->aop.ld() * p->mul_bytes;
        if (p->terms.split)
          p->kernels(rows, cols).offsets(an, p->a_offs.data(), panel, p->b_offs.data(), int64_t(p->a_offs.size()),
                                         out, bias);
        else
          p->kernels(rows, cols).strided(an, p->b.red, panel, p->blk, p->rblk, out, bias);
      });
    };
    if (b.weights_first) {
      job.add(npanels, [p, pack, panels](int64_t i) {
        const ReblockTimer timer;
        const int64_t c0 = i * p->b.cols, cols = std::min(p->b.cols, p->out_cols - c0);
        char* panel = panels + i * p->panel_bytes;
        for (int64_t r = 0; r < p->rblk; ++r) pack(c0, cols, r, panel + r * p->blk * p->mul_bytes, p->tmp(panel));
      });
      job.add(ceil_div(n, b.rows), [p, block, npanels, panels](int64_t nb) {
        for (int64_t i = 0; i < npanels; ++i) block(nb * p->b.rows, i * p->b.cols, panels + i * p->panel_bytes);
      });
      return;
    }
    auto pool = std::make_shared<PanelPool>(panels, panel_bytes, groups.concurrency());
    PanelPool* pp = pool.get();
    job.keep.push_back(std::move(pool));
    job.add(groups.items(), [p, pack, block, pp](int64_t i) {
      const int64_t c0 = p->groups.panel(i) * p->b.cols, cols = std::min(p->b.cols, p->out_cols - c0);
      const PanelPool::Lease panel(*pp);
      {
        const ReblockTimer timer;
        for (int64_t r = 0; r < p->rblk; ++r) pack(c0, cols, r, panel.data + r * p->blk * p->mul_bytes, p->tmp(panel.data));
      }
      for (int64_t nb = p->groups.first(i); nb < p->groups.last(i); ++nb) block(nb * p->b.rows, c0, panel.data);
    });
  }

  // emulation::pack's scratch, after a panel's blocks
  float* tmp(char* panel) const { return reinterpret_cast<float*>(panel + tmp_offset); }

  const emulation::Terms terms;  // the products of every multiplication (one, unless emulated)
  const Blocking b;  // the block of the reduced dimension divides it
  const int64_t blk;  // elements of one re-blocked reduction block
  const int64_t n, out_cols, rblk;
  const int64_t part_step;  // elements from one part of a panel to the next
  const ActivationOperand aop;
  const KernelSet kernels;
  const WorkGroups groups;
  const size_t tmp_offset, panel_bytes;
  std::vector<int64_t> a_offs, b_offs;  // emulated: a tile's batch, (term, block) pairs

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
