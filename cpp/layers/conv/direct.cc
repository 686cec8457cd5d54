// The direct skeleton's plan: the tap classes and offset tables of every output row and
// pixel block, their kernels, the panel grouping and the work split.
#include "layers/conv/direct.h"

#include <map>

namespace jb::conv {

namespace {

constexpr int64_t kMaxPixels = 96;          // output pixels per block (whole register tiles)
constexpr int64_t kPanelBytes = 640 << 10;  // a weight panel above this takes 32 channels
constexpr int64_t kStackedBelow = 16;       // a group's channels: emulated parts stacked (direct.h)

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

}  // namespace

Isa MultiplyNarrow::tile_isa(int64_t cols) const {
  // fp32 blocks at most 8 columns wide (ResNeXt's groups): AVX-512 would fill half of each
  // zmm FMA; 8-lane ymm FMAs issue two per cycle on Zen 4 and fill theirs.
  return isa == Isa::avx512 && mul_dt == DType::f32 && cols <= 8 ? Isa::avx2 : isa;
}

DirectPlan::DirectPlan(const Dims& d, const Dispatch& dp, const Blocking* force, int64_t threads)
    : MultiplyNarrow(d.products ? DType::bf16 : d.dt, dp),
      n(d.n), ci(d.ci), co(d.co), groups(d.groups), ldo(d.co * d.groups),
      hin(d.h.in), hout(d.h.out), wout(d.w.out), rt(d.h.taps), st(d.w.taps) {
  terms = emulation::terms(d.products);
  stacked = terms.split && ci < kStackedBelow;
  cr = stacked ? terms.count * ci : ci;
  ldi = cr * groups;
  // Blocking: reduced channels per batch element (dividing them), output channels per
  // panel (64 while the panel fits L2 comfortably), pixels per block.
  bi = force && force->red > 0 && cr % force->red == 0 ? force->red : reduction_block(cr, vnni);
  bo = force && force->cols > 0 ? force->cols : 64;
  if (!force && rt * st * cr * bo * panel_parts() * int64_t(mul_bytes) > kPanelBytes) bo = 32;
  bo = std::min(bo, co);
  ib = cr / bi;
  ob = ceil_div(co, bo);
  blk = reblock::block_elems(bi, bo, vnni);
  panel_elems = ib * rt * st * blk;

  // Columns: in place, or a copy with zero columns when border blocks would be too large
  // a part of every row (or the input must be widened to fp32 or split into parts anyway).
  Axis w = d.w;
  w.lo = 0, w.hi = w.in;
  Classes probe;
  const auto in_place = segments(w, probe);
  const int64_t per_phase = ceil_div(w.out, w.out_step());
  const auto [padl, padr] = w.full_pads();
  copy = d.dt != mul_dt || terms.split;
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

  // One offset table per (row class, column class): the valid (r, s, C-block) triples, for
  // every emulated term its parts' (input planes in_elems apart, panel parts panel_elems).
  in_elems = n * hin * win * ldi;
  const int64_t nwc = int64_t(wc.keys.size());
  tables.resize(hc.keys.size() * size_t(nwc));
  for (size_t a = 0; a < hc.keys.size(); ++a)
    for (int64_t b = 0; b < nwc; ++b) {
      Table& t = tables[a * nwc + b];
      for (int i = 0; i < (stacked ? 1 : terms.count); ++i)
        for (auto [th, dh] : hc.keys[a])
          for (auto [tw, dw] : wc.keys[b])
            for (int64_t c = 0; c < ib; ++c) {
              t.a.push_back((stacked ? 0 : terms.of[0][i] * in_elems) + (dh * win + dw) * ldi + c * bi);
              t.b.push_back((stacked ? 0 : terms.of[1][i] * panel_elems) + ((c * rt + th) * st + tw) * blk);
            }
    }

  // The kernels of every (row class, pixel block), full and last channel block.
  BrgemmDesc desc = MultiplyPath::desc(bi, w.in_step() * ldi, bo, w.out_step() * ldo, d.out_dt);
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
          kernels.emplace_back(desc, tile_isa(cols));
        }
      }
      kid[row * blocks.size() + j] = it->second;
    }

  // Panels of a work item: as many channel blocks as fit the panel budget together, so
  // that small weights (pointwise layers) are read once per pixel block for all of them.
  panel_bytes = Scratch::aligned(size_t(panel_elems * panel_parts()) * mul_bytes);
  split_bytes = terms.split ? size_t(2 * bi * bo) * sizeof(float) : 0;
  // Feature groups continue the sequence of panels: small groups share an item.
  const int64_t panels = groups * ob;
  per_item = force ? 1 : std::max<int64_t>(1, std::min<int64_t>(panels, kPanelBytes / int64_t(panel_bytes)));
  per_item = ceil_div(panels, ceil_div(panels, per_item));  // groups of equal size
  units = n * hout * int64_t(blocks.size());
  groups_ = WorkGroups(ceil_div(panels, per_item), units, threads);
  copy_bytes = copy ? size_t(in_elems * planes()) * mul_bytes : 0;
}

}  // namespace jb::conv
