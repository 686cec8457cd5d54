// The convolution layer's three passes: loops around the BRGEMM kernel, nothing else.
//
//   forward, backward  one skeleton (DirectPlan), the paper's Algorithm 4: a work item
//                      re-blocks one weight panel (a block of output channels, every
//                      (R, S, C-block)) into L2 and computes its group of output blocks
//                      with it. An output block is bq consecutive pixels of one output
//                      row x bk channels: one BRGEMM call whose batch walks the valid
//                      (r, s, C-block) triples with static offsets, so the output tile
//                      stays in registers across the whole reduction; bias and activation
//                      run in the epilogue. The backward by data is the dual convolution:
//                      the same skeleton with the roles of input and output swapped and
//                      the weights transposed, one stride phase of output columns at a time
//                      (the pixels of a phase read consecutive dz pixels).
//   update             x is re-blocked once, transposed (channels x pixels, padded with
//                      zeros so every tap reads a whole row); every (C-block, K-block,
//                      batch split) item owns its blocks of dw for every (r, s) and reduces
//                      over its output rows, chunk by chunk, with the chunk's dz rows
//                      staying in L2 across the R x S taps. Splits of the batch (only when
//                      the weights alone give too few items) write per-split fp32 partials
//                      that a last parallel loop sums: no atomics, no races.
//
// Padding is never materialized in the forward and backward when the borders are cheap:
// a row near the top or bottom border simply has a shorter batch (only its valid r), and
// the pixels near the left or right border form their own short blocks with their valid
// s. Only when those border blocks would be a large part of a row (small images) is the
// input copied once with zero columns around it, so that every pixel of a row shares one
// block (the copy also widens bf16 to fp32 where the multiply path is fp32). A 1x1
// convolution with unit stride and no padding collapses N, H and W into one pixel row.
//
// The tap tables, kernels, work split and scratch sizes are the plan of a pass, built once
// per shape and cached; execution only loops and calls kernels.
#include "layers/conv.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "layers/common/eltwise.h"
#include "layers/common/kernels.h"
#include "layers/common/operand.h"
#include "layers/common/plan_cache.h"
#include "layers/common/reblock.h"
#include "layers/common/scratch.h"
#include "layers/common/view.h"
#include "layers/common/work.h"

namespace jb::conv {

namespace {

constexpr int64_t kMaxPixels = 96;     // output pixels per block (whole register tiles)
constexpr int64_t kPanelBytes = 640 << 10;  // a weight panel above this takes 32 channels
constexpr int64_t kChunkBytes = 192 << 10;  // update: operand rows reduced at once (L2)

// ---------------------------------------------------------------------------------------
// One spatial axis of a direct-convolution pass. Output index o reads input index i with
// weight tap t:
//   forward  i = o * stride - pad + t
//   dual     i = (o + pad - t) / stride, where it divides (the backward by data)
// A tap is valid where lo <= i < hi: [0, in) in place; a copy with zero columns widens it.

using Taps = std::vector<std::pair<int64_t, int64_t>>;  // (tap, input index)

struct Axis {
  int64_t in = 0, out = 0, taps = 0, stride = 1, pad = 0;
  bool dual = false;
  int64_t lo = 0, hi = 0;

  Taps of(int64_t o) const {
    Taps v;
    for (int64_t t = 0; t < taps; ++t) {
      int64_t i;
      if (dual) {
        const int64_t u = o + pad - t;
        if (u % stride) continue;
        i = u / stride;
      } else {
        i = o * stride - pad + t;
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

// Tap classes: outputs whose valid taps are the same (tap, input index - base) pairs, base
// being their smallest input index, share one offset table.
struct Classes {
  std::map<Taps, int64_t> ids;
  std::vector<Taps> keys;
  int64_t intern(const Taps& taps, int64_t* base) {
    *base = 0;
    for (size_t j = 0; j < taps.size(); ++j) *base = j ? std::min(*base, taps[j].second) : taps[j].second;
    Taps key;
    for (auto [t, i] : taps) key.push_back({t, i - *base});
    auto it = ids.find(key);
    if (it != ids.end()) return it->second;
    ids.emplace(key, int64_t(keys.size()));
    keys.push_back(key);
    return int64_t(keys.size()) - 1;
  }
};

// A block of output pixels of one row: tap class, first output column, the input column
// of its first tap, pixel count.
struct PixelBlock {
  int64_t cls, o, i, m;
};

// Runs of consecutive pixels (per stride phase) of one tap class whose inputs advance by
// in_step: the longest blocks the kernel can take.
std::vector<PixelBlock> segments(const Axis& ax, Classes& cls) {
  std::vector<PixelBlock> seg;
  for (int64_t ph = 0; ph < ax.out_step(); ++ph) {
    const size_t first = seg.size();
    for (int64_t o = ph; o < ax.out; o += ax.out_step()) {
      int64_t base;
      const int64_t id = cls.intern(ax.of(o), &base);
      if (seg.size() > first) {
        PixelBlock& b = seg.back();
        if (b.cls == id && (cls.keys[id].empty() || base == b.i + b.m * ax.in_step())) {
          ++b.m;
          continue;
        }
      }
      seg.push_back({id, o, base, 1});
    }
  }
  return seg;
}

// Pixels in runs too short to fill a register tile: the cost of not padding.
int64_t short_pixels(const std::vector<PixelBlock>& seg, const Classes& cls, int64_t per_phase) {
  int64_t n = 0;
  for (const auto& b : seg)
    if (!cls.keys[b.cls].empty() && b.m < std::min(kRowQuantum, per_phase)) n += b.m;
  return n;
}

// Splits runs into blocks: bq pixels when forced, else equal blocks of whole register tiles.
std::vector<PixelBlock> split_blocks(const std::vector<PixelBlock>& seg, const Classes& cls,
                                     const Axis& ax, int64_t bq) {
  std::vector<PixelBlock> out;
  for (const auto& s : seg) {
    int64_t m = bq;
    if (m <= 0) {
      const int64_t nb = ceil_div(s.m, kMaxPixels);
      m = std::min(s.m, round_up(ceil_div(s.m, nb), kRowQuantum));
    }
    const bool empty = cls.keys[s.cls].empty();
    for (int64_t j = 0; j < s.m; j += m)
      out.push_back({s.cls, s.o + j * ax.out_step(), empty ? 0 : s.i + j * ax.in_step(), std::min(m, s.m - j)});
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// The skeleton of the forward and the backward by data: an output [n][hout][wout][co]
// computed from an input [n][hin][win][ci] and weights re-blocked into panels of bo output
// channels, [Ob][Ib][R][S][bi][bo] (the forward's [Kb][Cb][R][S][bc][bk]).

struct Dims {
  int64_t n, ci, co;
  Axis h, w;  // h.in, h.out: input and output rows; w likewise for columns
  DType dt;   // dtype of input and output
  bool bias;
  Activation act;  // in the epilogue (gelu: none, applied after)
};

struct DirectPlan {
  DirectPlan(const Dims& d, const Dispatch& dp, const Blocking* force, int64_t threads)
      : isa(dp.isa), kd(multiply_dtype(d.dt, dp)), vnni(kd == DType::bf16), ks(dtype_size(kd)),
        n(d.n), ci(d.ci), co(d.co), hin(d.h.in), hout(d.h.out), wout(d.w.out),
        rt(d.h.taps), st(d.w.taps) {
    // Blocking: reduced channels per batch element (dividing them), output channels per
    // panel (64 while the panel fits L2 comfortably), pixels per block.
    bi = force && force->red > 0 && ci % force->red == 0 ? force->red : reduction_block(ci, vnni);
    bo = force && force->cols > 0 ? force->cols : 64;
    if (!force && rt * st * ci * bo * int64_t(ks) > kPanelBytes) bo = 32;
    bo = std::min(bo, co);
    ib = ci / bi;
    ob = ceil_div(co, bo);
    blk = reblock::block_elems(bi, bo, vnni);
    panel_elems = ib * rt * st * blk;

    // Columns: in place, or a copy with zero columns when border blocks would be too large
    // a part of every row (or the input must be widened to fp32 anyway).
    Axis w = d.w;
    w.lo = 0, w.hi = w.in;
    Classes probe;
    const auto in_place = segments(w, probe);
    const int64_t per_phase = ceil_div(w.out, w.out_step());
    const auto [padl, padr] = w.full_pads();
    copy = d.dt != kd;
    pad_l = pad_r = 0;
    if ((copy || 10 * short_pixels(in_place, probe, per_phase) > w.out) && padl + padr > 0) {
      copy = true;
      pad_l = padl, pad_r = padr;
      w.lo = -padl, w.hi = w.in + padr;
    }
    win = w.in + pad_l + pad_r;
    win_src = w.in;
    Classes wc;
    blocks = split_blocks(segments(w, wc), wc, w, force && force->rows > 0 ? force->rows : 0);
    for (auto& b : blocks)
      if (!wc.keys[b.cls].empty()) b.i += pad_l;

    // Rows: the valid taps of every output row.
    Classes hc;
    hcls.resize(size_t(hout));
    hbase.resize(size_t(hout));
    for (int64_t o = 0; o < hout; ++o) hcls[o] = hc.intern(d.h.of(o), &hbase[o]);

    // One offset table per (row class, column class): the valid (r, s, C-block) triples.
    const int64_t nwc = int64_t(wc.keys.size());
    tables.resize(hc.keys.size() * size_t(nwc));
    for (size_t a = 0; a < hc.keys.size(); ++a)
      for (int64_t b = 0; b < nwc; ++b) {
        Table& t = tables[a * nwc + b];
        for (auto [th, dh] : hc.keys[a])
          for (auto [tw, dw] : wc.keys[b])
            for (int64_t c = 0; c < ib; ++c) {
              t.a.push_back((dh * win + dw) * ci + c * bi);
              t.b.push_back(((c * rt + th) * st + tw) * blk);
            }
      }

    // The kernels of every (row class, pixel block), full and last channel block.
    BrgemmDesc desc;
    desc.k = bi;
    desc.lda = w.in_step() * ci;
    desc.ldb = vnni ? 2 * bo : bo;
    desc.ldc = w.out_step() * co;
    desc.ab = kd;
    desc.c = d.dt;
    desc.bias = d.bias;
    desc.act = d.act;
    std::map<std::pair<int64_t, int64_t>, int64_t> made;
    kid.resize(size_t(hout) * blocks.size());
    const int64_t tail = co % bo;
    for (int64_t row = 0; row < hout; ++row)
      for (size_t j = 0; j < blocks.size(); ++j) {
        const int64_t tid = hcls[row] * nwc + blocks[j].cls;
        auto [it, fresh] = made.emplace(std::make_pair(tid, blocks[j].m), int64_t(kernels.size()));
        if (fresh) {
          desc.m = blocks[j].m;
          desc.static_offs_a = tables[tid].a.data();
          desc.static_offs_b = tables[tid].b.data();
          desc.static_batch = int64_t(tables[tid].a.size());
          for (int64_t cols : {bo, tail ? tail : bo}) {
            desc.n = cols;
            kernels.emplace_back(desc, isa);
          }
        }
        kid[row * blocks.size() + j] = it->second;
      }

    // Panels of a work item: as many channel blocks as fit the panel budget together, so
    // that small weights (pointwise layers) are read once per pixel block for all of them.
    panel_bytes = Scratch::aligned(size_t(panel_elems) * ks);
    per_item = force ? 1 : std::max<int64_t>(1, std::min<int64_t>(ob, kPanelBytes / int64_t(panel_bytes)));
    per_item = ceil_div(ob, ceil_div(ob, per_item));  // groups of equal size
    units = n * hout * int64_t(blocks.size());
    groups_ = WorkGroups(ceil_div(ob, per_item), units, threads);
    copy_bytes = copy ? size_t(n * hin * win * ci) * ks : 0;
  }

  // Runs the pass: each item packs its panel with pack(o0, cols, c, r, s, dst) (one block
  // per reduced block c and tap (r, s)), then for every output block calls
  // tile(out_offset, pixels, cols, multiply), where multiply(out, bias) is its BRGEMM call.
  template <class Pack, class Tile>
  void run(const Executor& ex, const void* in_src, DType in_dt, Pack&& pack, Tile&& tile) const {
    const size_t lease = panel_bytes * size_t(per_item);
    const auto buf = Scratch::get<2>({copy_bytes, lease * size_t(groups_.concurrency())});
    const char* in = static_cast<const char*>(in_src);
    if (copy) {
      const size_t px = size_t(ci) * ks;
      parallel_for(ex, n * hin, [&](int64_t row) {
        char* dst = buf[0] + size_t(row * win) * px;
        std::memset(dst, 0, size_t(pad_l) * px);
        reblock::pack(at(in_src, in_dt, row * win_src * ci), in_dt, win_src * ci, false, 1, win_src * ci, 1,
                      win_src * ci, kd, false, dst + size_t(pad_l) * px, isa);
        std::memset(dst + size_t(pad_l + win_src) * px, 0, size_t(pad_r) * px);
      });
      in = buf[0];
    }
    PanelPool panels(buf[1], lease, groups_.concurrency());
    const int64_t nb = int64_t(blocks.size());
    parallel_for(ex, groups_.items(), [&](int64_t item) {
      const int64_t g0 = groups_.panel(item) * per_item, g1 = std::min(ob, g0 + per_item);
      const PanelPool::Lease panel(panels);
      const View<char, 5> pv(panel.data, {per_item, ib, rt, st, blk * int64_t(ks)});
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t c = 0; c < ib; ++c)
          for (int64_t r = 0; r < rt; ++r)
            for (int64_t s = 0; s < st; ++s) pack(g * bo, std::min(bo, co - g * bo), c, r, s, pv.at(g - g0, c, r, s));
      for (int64_t u = groups_.first(item); u < groups_.last(item); ++u) {
        const int64_t j = u % nb, row = u / nb % hout, img = u / nb / hout;
        const PixelBlock& b = blocks[j];
        const char* a = in + ((img * hin + hbase[row]) * win + b.i) * ci * int64_t(ks);
        for (int64_t g = g0; g < g1; ++g) {
          const int64_t o0 = g * bo, cols = std::min(bo, co - o0);
          const Brgemm& k = kernels[kid[row * nb + j] + (cols != bo)];
          tile(((img * hout + row) * wout + b.o) * co + o0, b.m, cols,
               [&](void* out, const float* bias) { k.static_offsets(a, pv.at(g - g0), out, bias); });
        }
      }
    });
  }

  const Isa isa;
  const DType kd;
  const bool vnni;
  const size_t ks;
  const int64_t n, ci, co, hin, hout, wout, rt, st;
  int64_t bi = 0, bo = 0, ib = 0, ob = 0, blk = 0, panel_elems = 0;
  bool copy = false;
  int64_t pad_l = 0, pad_r = 0, win = 0, win_src = 0;
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
  size_t panel_bytes = 0, copy_bytes = 0;
};

// A 1x1 convolution with unit strides and no padding is one pixel row: N x H x W pixels.
bool pointwise(const Shape& s) {
  return s.r == 1 && s.s == 1 && s.sh == 1 && s.sw == 1 && !s.pt && !s.pb && !s.pl && !s.pr;
}

Dims forward_dims(const Shape& s, bool bias, Activation act) {
  Dims d;
  const bool pw = pointwise(s);
  d.n = pw ? 1 : s.n;
  d.ci = s.c;
  d.co = s.k;
  d.h = Axis{pw ? 1 : s.h, pw ? 1 : s.p(), s.r, s.sh, s.pt, false, 0, pw ? 1 : s.h};
  d.w = Axis{pw ? s.n * s.h * s.w : s.w, pw ? s.n * s.h * s.w : s.q(), s.s, s.sw, s.pl, false, 0, 0};
  d.dt = s.dt;
  d.bias = bias;
  d.act = act;
  return d;
}

Dims backward_dims(const Shape& s) {
  Dims d;
  const bool pw = pointwise(s);
  d.n = pw ? 1 : s.n;
  d.ci = s.k;
  d.co = s.c;
  d.h = Axis{pw ? 1 : s.p(), pw ? 1 : s.h, s.r, s.sh, s.pt, true, 0, pw ? 1 : s.p()};
  d.w = Axis{pw ? s.n * s.h * s.w : s.q(), pw ? s.n * s.h * s.w : s.w, s.s, s.sw, s.pl, true, 0, 0};
  d.dt = s.dt;
  d.bias = false;
  d.act = Activation::none;
  return d;
}

// The cache key of a pass: everything its plan depends on.
using Key = std::array<int64_t, 24>;
Key key_of(const Shape& s, int64_t extra, int64_t threads, const Dispatch& dp, const Blocking* force) {
  return {s.n, s.h, s.w, s.c, s.k, s.r, s.s, s.sh, s.sw, s.pt, s.pb, s.pl, s.pr, int64_t(s.dt),
          int64_t(s.act), extra, threads, int64_t(dp.isa), int64_t(dp.bf16_multiply),
          force ? force->rows : -1, force ? force->cols : -1, force ? force->red : -1, 0, 0};
}

PlanCache<24, DirectPlan> forward_plans, backward_plans;

// ---------------------------------------------------------------------------------------
// The update's plan. The output rows are reduced in (n, p) rows of Q pixels (a pointwise
// convolution regroups its N x H x W pixels into rows of at most 256). x is transposed into
// xt [N][Hp][sw][C][Wq]: for every padded input row and column phase, channels x columns,
// zeros in the padding, so the A operand of tap (r, s) for output row (n, p) is the
// C-block's rows starting at column s / sw of phase s % sw of padded row p * sh + r, and
// every batch element reduces over exactly Q pixels. dz is the B operand: read in place
// (fp32) or re-blocked [Kb][rows][Q][bk] (VNNI pairs of pixels for bf16 multiplies).

struct UpdateView {  // the convolution the update reduces over
  int64_t n, h, w, p, q;
};

UpdateView update_view(const Shape& s) {
  if (!pointwise(s)) return {s.n, s.h, s.w, s.p(), s.q()};
  const int64_t px = s.n * s.h * s.w;
  int64_t l = std::min<int64_t>(px, 256);
  while (px % l) --l;
  return {1, px / l, l, px / l, l};
}

struct UpdatePlan {
  UpdatePlan(const Shape& s, const Dispatch& dp, DType dw_dt, const Blocking* force, int64_t threads)
      : isa(dp.isa), kd(multiply_dtype(s.dt, dp)), vnni(kd == DType::bf16), ks(dtype_size(kd)),
        v(update_view(s)), c(s.c), k(s.k), rt(s.r), st(s.s),
        sh(pointwise(s) ? 1 : s.sh), sw(pointwise(s) ? 1 : s.sw),
        pt(pointwise(s) ? 0 : s.pt), pl(pointwise(s) ? 0 : s.pl) {
    bm = std::min(c, force && force->rows > 0 ? force->rows : 64);
    bn = std::min(k, force && force->cols > 0 ? force->cols : 64);
    cb = ceil_div(c, bm);
    kb = ceil_div(k, bn);
    rows = v.n * v.p;
    hp = (v.p - 1) * sh + rt;
    wq = ceil_div((v.q - 1) * sw + st, sw);
    slack = round_up(ceil_div(pl, sw) + 1, 32);
    bstride = c * wq + slack;
    packed = s.dt != DType::f32;
    blk_q = packed ? reblock::block_elems(v.q, bn, vnni) : 0;
    splits = std::max<int64_t>(1, std::min(rows, ceil_div(4 * threads, cb * kb)));
    direct = splits == 1 && dw_dt == DType::f32;
    chunk = std::max<int64_t>(1, kChunkBytes / int64_t((bm * ((v.q - 1) * sw + st) + v.q * bn) * ks));
    for (int64_t img = 0; img < v.n; ++img)
      for (int64_t p = 0; p < v.p; ++p) {
        a_rows.push_back((img * hp + p * sh) * sw * bstride);
        b_rows.push_back((img * v.p + p) * (packed ? blk_q : v.q * k));
      }
    BrgemmDesc d;
    d.k = v.q;
    d.lda = wq;
    d.ldb = packed ? (vnni ? 2 * bn : bn) : k;
    d.ldc = k;
    d.ab = kd;
    d.c = DType::f32;
    first.emplace(d, c, k, bm, bn, isa);
    d.accumulate = true;
    more.emplace(d, c, k, bm, bn, isa);
    xt_bytes = size_t(v.n * hp * sw * bstride) * ks;
    dz_bytes = packed ? size_t(kb * rows * blk_q) * ks : 0;
    part_bytes = direct ? 0 : size_t(splits * rt * st * c * k) * sizeof(float);
  }

  const Isa isa;
  const DType kd;
  const bool vnni;
  const size_t ks;
  const UpdateView v;
  const int64_t c, k, rt, st, sh, sw, pt, pl;
  int64_t bm = 0, bn = 0, cb = 0, kb = 0, rows = 0, hp = 0, wq = 0, slack = 0, bstride = 0;
  bool packed = false, direct = false;
  int64_t blk_q = 0, splits = 1, chunk = 1;
  std::vector<int64_t> a_rows, b_rows;  // per output row: its xt row, its dz row
  std::optional<KernelSet> first, more;  // the first chunk of a split, the others
  size_t xt_bytes = 0, dz_bytes = 0, part_bytes = 0;
};

PlanCache<24, UpdatePlan> update_plans;

}  // namespace

void validate(const Shape& s) {
  auto bad = [](const std::string& what) { throw std::invalid_argument("conv: " + what); };
  if (s.n < 0) bad("negative batch size");
  if (s.h < 1 || s.w < 1 || s.c < 1 || s.k < 1 || s.r < 1 || s.s < 1)
    bad("sizes must be >= 1 (H, W, C, K, R, S)");
  if (s.sh < 1 || s.sw < 1) bad("strides must be >= 1");
  if (s.pt < 0 || s.pb < 0 || s.pl < 0 || s.pr < 0) bad("paddings must be >= 0");
  if (s.h + s.pt + s.pb < s.r || s.w + s.pl + s.pr < s.s) bad("the filter is larger than the padded input");
}

Saved saved_for(Activation act) {
  switch (act) {
    case Activation::none: return Saved::none;
    case Activation::gelu: return Saved::preactivation;
    default: return Saved::output;
  }
}

// ---------------------------------------------------------------------------------------
// Forward: x is the A operand (a block of pixels: lda = stride_w * C), a weight block the
// B operand, the output tile (ldc = K) the accumulator.

void forward(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* w,
             DType w_dt, const float* bias, void* y, void* z, const Blocking* force) {
  validate(s);
  if (s.n == 0) return;
  const bool gelu = s.act == Activation::gelu;
  const auto plan = forward_plans.get(key_of(s, bias != nullptr, ex.num_threads, dp, force), [&] {
    return DirectPlan(forward_dims(s, bias != nullptr, gelu ? Activation::none : s.act), dp, force,
                      ex.num_threads);
  });
  const DirectPlan& p = *plan;
  const size_t es = dtype_size(s.dt);
  char* out = static_cast<char*>(gelu ? z : y);
  p.run(
      ex, x, s.dt,
      [&](int64_t k0, int64_t cols, int64_t cb, int64_t r, int64_t t, char* dst) {
        reblock::pack(at(w, w_dt, ((r * s.s + t) * s.c + cb * p.bi) * s.k + k0), w_dt, s.k, false, p.bi,
                      cols, p.bi, p.bo, p.kd, p.vnni, dst, p.isa);
      },
      [&](int64_t off, int64_t pixels, int64_t cols, auto&& multiply) {
        multiply(out + off * es, bias ? bias + off % s.k : nullptr);
        if (gelu)  // the tile is still in L1: y = gelu(z) costs no memory traffic
          for (int64_t i = 0; i < pixels; ++i)
            eltwise::activate(Activation::gelu, s.dt, at(z, s.dt, off + i * s.k),
                              static_cast<char*>(y) + (off + i * s.k) * es, cols, p.isa);
      });
}

// ---------------------------------------------------------------------------------------
// Backward by data: the dual convolution. dz is the A operand (consecutive dz pixels of
// one stride phase: lda = K), the transposed weight block ([Cb][Kb][R][S][bk][bc], VNNI
// pairs of k) the B operand, and the dx pixels of the phase (ldc = stride_w * C) the
// accumulator. Output pixels that no tap reaches (strides larger than the filter) get a
// batch of zero elements: zeros.

void backward(const Executor& ex, const Dispatch& dp, const Shape& s, const void* dz, const void* w,
              DType w_dt, void* dx, const Blocking* force) {
  validate(s);
  if (s.n == 0) return;
  const auto plan = backward_plans.get(key_of(s, 0, ex.num_threads, dp, force), [&] {
    return DirectPlan(backward_dims(s), dp, force, ex.num_threads);
  });
  const DirectPlan& p = *plan;
  const size_t es = dtype_size(s.dt);
  p.run(
      ex, dz, s.dt,
      [&](int64_t c0, int64_t cols, int64_t kb, int64_t r, int64_t t, char* dst) {
        reblock::pack(at(w, w_dt, ((r * s.s + t) * s.c + c0) * s.k + kb * p.bi), w_dt, s.k, true, p.bi,
                      cols, p.bi, p.bo, p.kd, p.vnni, dst, p.isa);
      },
      [&](int64_t off, int64_t, int64_t, auto&& multiply) {
        multiply(static_cast<char*>(dx) + off * es, nullptr);
      });
}

// ---------------------------------------------------------------------------------------
// Weight update: see UpdatePlan. Items (K-block, C-block, split) own dw's blocks (or the
// split's partial), for every (r, s).

void update(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
            void* dw, DType dw_dt, float* db, const Blocking* force) {
  validate(s);
  const int64_t welems = s.r * s.s * s.c * s.k;
  if (s.n == 0) {  // an empty batch: zero gradients
    std::memset(dw, 0, size_t(welems) * dtype_size(dw_dt));
    if (db) std::memset(db, 0, size_t(s.k) * sizeof(float));
    return;
  }
  const auto plan = update_plans.get(key_of(s, int64_t(dw_dt), ex.num_threads, dp, force), [&] {
    return UpdatePlan(s, dp, dw_dt, force, ex.num_threads);
  });
  const UpdatePlan& p = *plan;
  const UpdateView& v = p.v;
  const size_t ks = p.ks;
  const auto buf = Scratch::get<3>({p.xt_bytes, p.dz_bytes, p.part_bytes});

  // Re-blocking: x^T per (image, padded row, column phase), dz per (K-block, row), db per
  // 64 columns (summed from dz in place, by the item owning the columns).
  const View<char, 4> xt(buf[0], {v.n, p.hp, p.sw, p.bstride * int64_t(ks)});
  const int64_t nxt = v.n * p.hp * p.sw, ndz = p.packed ? p.kb * p.rows : 0;
  const int64_t pix = v.n * v.p * v.q;
  constexpr int64_t kDbCols = 64;
  const int64_t ndb = db ? ceil_div(s.k, kDbCols) : 0;
  parallel_for(ex, nxt + ndz + ndb, [&](int64_t i) {
    if (i < nxt) {
      const int64_t img = i / (p.hp * p.sw), hr = i / p.sw % p.hp, ph = i % p.sw;
      char* dst = xt.at(img, hr, ph);
      const int64_t ih = hr - p.pt;
      const int64_t j_lo = std::max<int64_t>(0, ceil_div(p.pl - ph, p.sw));
      const int64_t j_hi = std::min(p.wq, ceil_div(v.w + p.pl - ph, p.sw));
      if (ih < 0 || ih >= v.h || j_hi <= j_lo) {
        std::memset(dst, 0, size_t(p.c * p.wq) * ks);
        return;
      }
      // Rows of wq columns starting at column j_lo: the zero fill of each row's end runs
      // into the next row's left padding (and the block's slack after the last row).
      std::memset(dst, 0, size_t(j_lo) * ks);
      reblock::pack(at(x, s.dt, ((img * v.h + ih) * v.w + j_lo * p.sw + ph - p.pl) * s.c), s.dt,
                    p.sw * s.c, true, s.c, j_hi - j_lo, s.c, p.wq, p.kd, false, dst + j_lo * ks, p.isa);
      return;
    }
    if (i < nxt + ndz) {
      const int64_t kb = (i - nxt) / p.rows, row = (i - nxt) % p.rows, k0 = kb * p.bn;
      reblock::pack(at(dz, s.dt, row * v.q * s.k + k0), s.dt, s.k, false, v.q, std::min(p.bn, s.k - k0),
                    v.q, p.bn, p.kd, p.vnni, buf[1] + ((kb * p.rows + row) * p.blk_q) * ks, p.isa);
      return;
    }
    with_type(s.dt, [&](auto ts) {
      using T = decltype(ts);
      const int64_t j0 = (i - nxt - ndz) * kDbCols, width = std::min(kDbCols, s.k - j0);
      const T* src = static_cast<const T*>(dz) + j0;
      float acc[kDbCols] = {};
      for (int64_t q = 0; q < pix; ++q)
        for (int64_t j = 0; j < width; ++j) acc[j] += to_f32(src[q * s.k + j]);
      std::memcpy(db + j0, acc, size_t(width) * sizeof(float));
    });
  });

  // The reduction: item (kb, cb, split) over its rows, chunk by chunk, every tap (r, s).
  float* part = p.direct ? static_cast<float*>(dw) : reinterpret_cast<float*>(buf[2]);
  const int64_t per_split = ceil_div(p.rows, p.splits);
  parallel_for(ex, p.kb * p.cb * p.splits, [&](int64_t i) {
    const int64_t sp = i % p.splits, cbi = i / p.splits % p.cb, kbi = i / p.splits / p.cb;
    const int64_t c0 = cbi * p.bm, k0 = kbi * p.bn;
    const int64_t m = std::min(p.bm, s.c - c0), cols = std::min(p.bn, s.k - k0);
    const int64_t r0 = sp * per_split, r1 = std::min(p.rows, r0 + per_split);
    float* out = part + (p.direct ? 0 : sp * welems);
    const char* b = p.packed ? buf[1] + kbi * p.rows * p.blk_q * int64_t(ks)
                             : static_cast<const char*>(at(dz, s.dt, k0));
    if (r0 >= r1) {  // a split without rows (more splits than rows): zero partials
      for (int64_t t = 0; t < s.r * s.s; ++t)
        for (int64_t cc = 0; cc < m; ++cc)
          std::memset(out + (t * s.c + c0 + cc) * s.k + k0, 0, size_t(cols) * sizeof(float));
      return;
    }
    for (int64_t ch = r0; ch < r1; ch += p.chunk) {
      const int64_t count = std::min(p.chunk, r1 - ch);
      const Brgemm& kern = (ch == r0 ? *p.first : *p.more)(m, cols);
      for (int64_t r = 0; r < s.r; ++r)
        for (int64_t t = 0; t < s.s; ++t) {
          const char* a = buf[0] + ((r * p.sw + t % p.sw) * p.bstride + c0 * p.wq + t / p.sw) * int64_t(ks);
          kern.offsets(a, p.a_rows.data() + ch, b, p.b_rows.data() + ch, count,
                       out + ((r * s.s + t) * s.c + c0) * s.k + k0);
        }
    }
  });
  if (p.direct) return;

  // Partials of the splits summed into dw.
  const int64_t chunk = 4096;
  parallel_for(ex, ceil_div(welems, chunk), [&](int64_t i) {
    const int64_t a = i * chunk, count = std::min(chunk, welems - a);
    with_type(dw_dt, [&](auto ts) {
      using T = decltype(ts);
      T* dst = static_cast<T*>(dw) + a;
      for (int64_t e = 0; e < count; ++e) {
        float acc = part[a + e];
        for (int64_t sp = 1; sp < p.splits; ++sp) acc += part[sp * welems + a + e];
        dst[e] = from_f32<T>(acc);
      }
    });
  });
}

}  // namespace jb::conv
