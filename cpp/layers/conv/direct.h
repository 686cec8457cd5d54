// The skeleton the convolution's forward and backward by data share (the paper's Algorithm
// 4): a work item re-blocks one weight panel (a block of output channels, every (R, S,
// C-block)) into L2 and computes its group of output blocks with it. An output block is
// consecutive pixels of one output row x a block of channels: one BRGEMM call whose batch
// walks the valid (r, s, C-block) triples with static offsets, so the output tile stays in
// registers across the whole reduction. The backward by data is the dual convolution: the
// same skeleton with the roles of input and output swapped and the weights transposed, one
// stride phase of output columns at a time.
//
// Padding is never materialized when the borders are cheap: a row near the top or bottom
// border simply has a shorter batch (only its valid r), and the pixels near the left or
// right border form their own short blocks with their valid s. Only when those border
// blocks would be a large part of a row (small images) is the input copied once with zero
// columns around it, so that every pixel of a row shares one block (the copy also widens
// bf16 to fp32 where the multiply path is fp32). A 1x1 convolution with unit stride and no
// padding collapses N, H and W into one pixel row.
//
// Emulated fp32 products (Shape::products, emulation.h): the copy splits the input into its
// bf16 parts, one plane each, and the panels hold the weights' parts side by side; a block's
// batch walks every (term, r, s, C-block), so one BRGEMM call sums all of a tile's products.
// Groups of few channels would make each term a batch element of a few products: there the
// copy stacks each term's part of a group's channels side by side, and the panels the
// matching parts of the weights' rows, so a term is more of the reduction, not more batch.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "layers/common/emulation.h"
#include "layers/common/operand.h"
#include "layers/common/reblock.h"
#include "layers/common/scratch.h"
#include "layers/common/view.h"
#include "layers/common/work.h"
#include "layers/conv/conv.h"
#include "parallel/job.h"

namespace jb::conv {

// ---------------------------------------------------------------------------------------
// One spatial axis of a direct-convolution pass. Output index o reads input index i with
// weight tap t:
//   forward  i = o * stride - pad + t * dil
//   dual     i = (o + pad - t * dil) / stride, where it divides (the backward by data)
// A tap is valid where lo <= i < hi: [0, in) in place; a copy with zero columns widens it.

using Taps = std::vector<std::pair<int64_t, int64_t>>;  // (tap, input index)

struct Axis {
  int64_t in = 0, out = 0, taps = 0, stride = 1, pad = 0;
  bool dual = false;
  int64_t lo = 0, hi = 0;
  int64_t dil = 1;  // kernel dilation

  Taps of(int64_t o) const {
    Taps v;
    for (int64_t t = 0; t < taps; ++t) {
      int64_t i;
      if (dual) {
        const int64_t u = o + pad - t * dil;
        if (u % stride) continue;
        i = u / stride;
      } else {
        i = o * stride - pad + t * dil;
      }
      if (i >= lo && i < hi) v.push_back({t, i});
    }
    return v;
  }
  // A block of pixels steps over output indices by out_step (the dual pass takes one
  // stride phase at a time) and over input indices by in_step.
  int64_t out_step() const { return dual ? stride : 1; }
  int64_t in_step() const { return dual ? 1 : stride; }
  // Zero columns a copy needs before / after the input so that no tap is clipped.
  std::pair<int64_t, int64_t> full_pads() const {
    Axis a = *this;
    a.lo = std::numeric_limits<int64_t>::min() / 4;
    a.hi = std::numeric_limits<int64_t>::max() / 4;
    int64_t mn = 0, mx = in - 1;
    for (int64_t o = 0; o < out; ++o)
      for (auto [t, i] : a.of(o)) mn = std::min(mn, i), mx = std::max(mx, i);
    return {-mn, mx - (in - 1)};
  }
};

// A block of output pixels of one row: tap class, first output column, the input column
// of its first tap, pixel count.
struct PixelBlock {
  int64_t cls, o, i, m;
};

// ---------------------------------------------------------------------------------------
// The skeleton of the forward and the backward by data: an output [n][hout][wout][co]
// computed from an input [n][hin][win][ci] and weights re-blocked into panels of bo output
// channels, [Ob][Ib][R][S][bi][bo] (the forward's [Kb][Cb][R][S][bc][bk]).

struct Dims {
  int64_t n, ci, co;  // input and output channels of one feature group
  int64_t groups = 1;
  Axis h, w;  // h.in, h.out: input and output rows; w likewise for columns
  DType dt = DType::f32;  // dtype of the input
  DType out_dt = DType::f32;  // and of the output
  bool bias = false;
  Activation act = Activation::none;  // in the epilogue (gelu: none, applied after)
  int64_t products = 0;  // fp32 input and weights: emulated products (Shape::products)
};

// The multiply path, with the ISA of the register tiles for a block `cols` wide.
struct MultiplyNarrow : MultiplyPath {
  using MultiplyPath::MultiplyPath;
  Isa tile_isa(int64_t cols) const;
};

struct DirectPlan : MultiplyNarrow {
  DirectPlan(const Dims& d, const Dispatch& dp, const Blocking* force, int64_t threads);

  // Runs the pass: each item packs its panels with pack(group, o0, cols, c, r, s, dst, tmp)
  // (one block per reduced block c and tap (r, s); with emulated products its parts,
  // panel_elems apart, split through tmp), then for every output block calls
  // tile(out_offset, pixels, cols, multiply), where multiply(out, bias) is its BRGEMM call.
  // The panels of all groups are one sequence, so an item of small groups (grouped and
  // depthwise layers) covers many of them and its input pixels stay in cache across them.
  // The pass as phases of `job` (parallel/job.h): the copy, then the items. The caller
  // keeps the plan alive in job.keep; pack and tile are copied into the job (values only).
  template <class Pack, class Tile>
  void add(Job& job, const void* in_src, DType in_dt, Pack pack, Tile tile) const {
    const size_t lease = panel_bytes * size_t(per_item) + split_bytes;
    const auto buf = job_scratch<2>(job, {copy_bytes, lease * size_t(groups_.concurrency())});
    const DirectPlan* p = this;
    const char* in = static_cast<const char*>(in_src);
    if (copy) {
      char* dst0 = buf[0];
      job.add(n * hin, [p, dst0, in_src, in_dt](int64_t row) {
        const size_t px = size_t(p->ldi) * p->mul_bytes;
        const int64_t ld = p->ci * p->groups, len = p->win_src * ld;  // of the source
        char* dst = dst0 + size_t(row * p->win) * px;
        for (int part = 0; part < p->planes(); ++part) {
          char* d = dst + size_t(part * p->in_elems) * p->mul_bytes;
          std::memset(d, 0, size_t(p->pad_l) * px);
          std::memset(d + size_t(p->pad_l + p->win_src) * px, 0, size_t(p->pad_r) * px);
        }
        const float* src = static_cast<const float*>(in_src) + row * len;
        if (p->stacked)  // pixel j, group g: term t's part of the group's channels at (g * terms + t) * ci
          for (int t = 0; t < p->terms.count; ++t)
            emulation::part_of(src, p->terms.of[0][t], dst + size_t(p->pad_l) * px + size_t(t * p->ci) * p->mul_bytes,
                               p->mul_dt, len, p->ci, p->terms.count * p->ci);
        else if (p->terms.split)
          emulation::split_rows(p->terms, 0, src, len, dst + size_t(p->pad_l) * px, p->mul_dt, len, p->in_elems, 1, len,
                                len);
        else
          reblock::pack(at(in_src, in_dt, row * len), in_dt, len, false, 1, len, 1, len, p->mul_dt, false,
                        dst + size_t(p->pad_l) * px, p->isa);
      });
      in = buf[0];
    }
    auto pool = std::make_shared<PanelPool>(buf[1], lease, groups_.concurrency());
    PanelPool* pp = pool.get();
    job.keep.push_back(std::move(pool));
    job.add(groups_.items(), [p, in, pp, pack, tile](int64_t item) {
      const int64_t nb = int64_t(p->blocks.size()), mb = int64_t(p->mul_bytes);
      // g: a panel of the sequence over groups x ob, fg its group, o0 its first channel
      const int64_t g0 = p->groups_.panel(item) * p->per_item, g1 = std::min(p->groups * p->ob, g0 + p->per_item);
      const PanelPool::Lease panel(*pp);
      const View<char, 6> pv(panel.data, {p->per_item, p->panel_parts(), p->ib, p->rt, p->st, p->blk * mb});
      float* tmp = reinterpret_cast<float*>(panel.data + p->panel_bytes * size_t(p->per_item));
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t fg = g / p->ob, o0 = g % p->ob * p->bo;
        for (int64_t c = 0; c < p->ib; ++c)
          for (int64_t r = 0; r < p->rt; ++r)
            for (int64_t s = 0; s < p->st; ++s)
              pack(fg, o0, std::min(p->bo, p->co - o0), c, r, s, pv.at(g - g0, 0, c, r, s), tmp);
      }
      for (int64_t u = p->groups_.first(item); u < p->groups_.last(item); ++u) {
        const int64_t j = u % nb, row = u / nb % p->hout, img = u / nb / p->hout;
        const PixelBlock& b = p->blocks[j];
        const char* a = in + ((img * p->hin + p->hbase[row]) * p->win + b.i) * p->ldi * mb;
        for (int64_t g = g0; g < g1; ++g) {
          const int64_t fg = g / p->ob, o0 = g % p->ob * p->bo, cols = std::min(p->bo, p->co - o0);
          const Brgemm& k = p->kernels[p->kid[row * nb + j] + (cols != p->bo)];
          const char* ag = a + fg * p->cr * mb;
          tile(((img * p->hout + row) * p->wout + b.o) * p->ldo + fg * p->co + o0, b.m, cols,
               [&](void* out, const float* bias) { k.static_offsets(ag, pv.at(g - g0), out, bias); });
        }
      }
    });
  }

  // Packs reduced block c of a weight panel, cols wide, from w0, the group's reduced row 0
  // (rows ld apart in w, or columns with trans): with emulated products, its parts.
  void pack_block(const void* w0, DType w_dt, int64_t ld, bool trans, int64_t c, int64_t cols, char* dst,
                  float* tmp) const {
    if (stacked)
      emulation::pack_stacked(terms, 1, ci, static_cast<const float*>(w0), ld, trans, c * bi, bi, cols, bi, bo, mul_dt,
                              vnni, dst, isa, tmp);
    else
      emulation::pack(terms, 1, at(w0, w_dt, c * bi * (trans ? 1 : ld)), w_dt, ld, trans, bi, cols, bi, bo, mul_dt,
                      vnni, dst, panel_elems, isa, tmp);
  }
  int planes() const { return stacked ? 1 : terms.parts[0]; }  // of the input's copy
  int panel_parts() const { return stacked ? 1 : terms.parts[1]; }

  const int64_t n, ci, co, groups, ldo, hin, hout, wout, rt, st;  // ld: channels of a pixel
  int64_t bi = 0, bo = 0, ib = 0, ob = 0, blk = 0, panel_elems = 0;
  emulation::Terms terms;  // of the emulated products; parts[0] input planes, parts[1] panel parts
  bool stacked = false;    // the terms' parts side by side in a group's channels (few of them)
  int64_t cr = 0, ldi = 0;  // a group's reduced channels as the kernel reads them, and a pixel's
  bool copy = false;
  int64_t pad_l = 0, pad_r = 0, win = 0, win_src = 0, in_elems = 0;  // in_elems: one plane of the copy
  std::vector<PixelBlock> blocks;
  std::vector<int64_t> hcls, hbase;
  struct Table {
    std::vector<int64_t> a, b;
  };
  std::vector<Table> tables;  // moved with the plan: the kernels' pointers stay valid
  std::vector<Brgemm> kernels;
  std::vector<int64_t> kid;
  int64_t per_item = 1, units = 0;  // channel blocks per work item, output blocks
  WorkGroups groups_{1, 1, 1};
  size_t panel_bytes = 0, copy_bytes = 0, split_bytes = 0;  // split_bytes: emulation::pack's tmp
};

// A 1x1 convolution with unit strides and no padding is one pixel row: N x H x W pixels.
inline bool pointwise(const Shape& s) {
  return s.r == 1 && s.s == 1 && s.sh == 1 && s.sw == 1 && !s.pt && !s.pb && !s.pl && !s.pr;
}

// The cache key of a pass: everything its plan depends on. `extra` is the pass's own (the
// forward's bias, the update's dw dtype).
using PlanKey = std::array<int64_t, 26>;
inline PlanKey key_of(const Shape& s, int64_t extra, int64_t threads, const Dispatch& dp, const Blocking* force) {
  return {s.n, s.h, s.w, s.c, s.k, s.r, s.s, s.sh, s.sw, s.pt, s.pb, s.pl, s.pr, s.dil_h, s.dil_w, s.groups,
          int64_t(s.dt), s.products, int64_t(s.act), extra, threads, int64_t(dp.isa), int64_t(dp.bf16_multiply),
          force ? force->rows : -1, force ? force->cols : -1, force ? force->red : -1};
}

}  // namespace jb::conv
