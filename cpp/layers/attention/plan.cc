#include "layers/attention/plan.h"

#include <algorithm>
#include <initializer_list>
#include <stdexcept>

#include "layers/common/plan_cache.h"
#include "layers/common/scratch.h"

namespace jb::attention {

namespace {

// Query rows per block: whole AMX tile rows, about 64 (the reduction of the backward's dK
// and dV updates, and every block re-reads the panel's K and V).
constexpr int64_t kRows = 64;
// Keys per chunk: a chunk's fp32 score tiles (64 x 512 x 4 bytes) stay in L2, and sequences
// up to this long run the forward's softmax in one pass, without rescaling.
constexpr int64_t kChunk = 512;

bool amx_bf16(const Dispatch& dp, DType kd) { return dp.isa == Isa::amx && kd == DType::bf16; }

Blocking blocks(const Shape& s, DType kd, const Dispatch& dp, const Blocks* force, int64_t kq) {
  Blocking b;
  const int64_t tile = amx_bf16(dp, kd) ? 16 : 4;
  b.rows = std::min(s.t, round_up(ceil_div(s.t, ceil_div(s.t, kRows)), tile));
  b.cols = std::min(round_up(s.s, kq), kChunk);
  if (force && force->rows > 0) b.rows = std::min(s.t, force->rows);
  if (force && force->keys > 0) b.cols = std::min(round_up(s.s, kq), round_up(force->keys, kq));
  return b;
}

}  // namespace

void check_shape(const Shape& s) {
  if (s.items < 0 || s.t < 0 || s.s < 1 || s.heads < 0 || s.kv_heads < 1 || s.h < 1 ||
      s.heads % s.kv_heads != 0)
    throw std::invalid_argument("attention: T, N and the batch must be >= 0, S, K and H >= 1, and K must divide N");
  emulation::terms(s.products);  // throws for a count it does not know
  if (s.products && s.dt != DType::f32)
    throw std::invalid_argument("attention: emulated products take float32 operands");
}

Plan::Plan(const Dispatch& dp, const Shape& sh, bool bias, bool mask, int64_t threads, const Blocks* force,
           Pass pass)
    : isa(dp.isa),
      terms(emulation::terms(sh.products)),
      kd(multiply_dtype(terms.split ? DType::bf16 : sh.dt, dp)),
      vnni(kd == DType::bf16),
      ks(dtype_size(kd)),
      t(sh.t),
      s(sh.s),
      h(sh.h),
      group(sh.heads / sh.kv_heads),
      kq(amx_bf16(dp, kd) ? 32 : 16),
      skip(sh.causal && !bias && !mask),
      groups(sh.items * sh.kv_heads, group * ceil_div(sh.t, blocks(sh, kd, dp, force, kq).rows), threads) {
  const Blocking b = blocks(sh, kd, dp, force, kq);
  bm = b.rows;
  bn = b.cols;
  nqb = ceil_div(t, bm);
  last_rows = t - (nqb - 1) * bm;
  sp = round_up(s, kq);
  // AMX multiplies whole 32-deep steps in place; other bf16 kernels whole VNNI pairs.
  const int64_t kpad = amx_bf16(dp, kd) ? 32 : vnni ? 2 : 1;
  hp = round_up(h, kpad);
  bmp = round_up(bm, kpad);
  last_rp = round_up(last_rows, kpad);
  const bool backward = pass == Pass::backward;
  split = backward && groups.items() > sh.items * sh.kv_heads;
  q_in_place = kd == sh.dt && hp == h && !terms.split;

  const bool has_last = last_rows != bm;
  BrgemmDesc base;
  base.ab = kd;
  base.c = DType::f32;
  qk = KernelTable(kq, bn, has_last, [&](bool last, int64_t w) {
    BrgemmDesc q = base;
    q.m = last ? last_rows : bm, q.n = w, q.k = hp;
    q.lda = q_in_place ? sh.heads * h : hp, q.ldb = vnni ? 2 * sp : sp, q.ldc = bn;
    return q;
  }, isa);
  pv = KernelTable(kq, bn, has_last, [&](bool last, int64_t w) {
    BrgemmDesc q = base;
    q.m = last ? last_rows : bm, q.n = h, q.k = w;
    q.lda = bn, q.ldb = vnni ? 2 * h : h, q.ldc = h, q.accumulate = true;
    return q;
  }, isa);

  const size_t f4 = sizeof(float);
  // Each packed operand holds the parts its side multiplies (one block, unless emulated).
  const int64_t pa = terms.parts[0], pb = terms.parts[1];
  kt_step = hp * sp, kv_step = sp * h, q_step = bm * hp, qt_step = h * bmp, pa_step = bm * bn, pb_step = bmp * bn;
  const auto tmp_for = [&](std::initializer_list<int64_t> blocks) {
    if (terms.split) tmp = lease.add(2 * size_t(std::max(blocks)) * f4);
  };
  if (!backward) {
    kt = lease.add(size_t(kt_step * pb) * ks);
    vv = lease.add(size_t(kv_step * pb) * ks);
    if (!q_in_place) qt = lease.add(size_t(q_step * pa) * ks);
    st = lease.add(size_t(bm * bn) * f4);
    if (kd != DType::f32 || terms.split) pt = lease.add(size_t(pa_step * pa) * ks);
    acc = lease.add(size_t(bm * h) * f4);
    m = lease.add(size_t(bm) * f4);
    l = lease.add(size_t(bm) * f4);
    alpha = lease.add(size_t(bm) * f4);
    tmp_for({kt_step, kv_step, q_step, pa_step});
    if (pass == Pass::tangent) {
      tkt = lease.add(size_t(kt_step * pb) * ks);
      tvv = lease.add(size_t(kv_step * pb) * ks);
      if (!q_in_place) tqt = lease.add(size_t(q_step * pa) * ks);
      tsa = lease.add(size_t(bm * bn) * f4);
      tsb = lease.add(size_t(bm * bn) * f4);
      wt = lease.add(size_t(pa_step * pa) * ks);
      c = lease.add(size_t(bm) * f4);
    }
    return;
  }
  kv = KernelTable(kq, bn, has_last, [&](bool last, int64_t w) {
    BrgemmDesc q = base;
    q.m = h, q.n = w, q.k = last ? last_rp : bmp;
    q.lda = bmp, q.ldb = vnni ? 2 * w : bn, q.ldc = sp, q.accumulate = true;
    return q;
  }, isa);
  kt = lease.add(size_t(kt_step * pb) * ks);  // K^T
  vv = lease.add(size_t(kt_step * pb) * ks);  // V^T
  kb = lease.add(size_t(kv_step * pb) * ks);  // K
  if (!q_in_place) {
    qt = lease.add(size_t(q_step * pa) * ks);
    dot = lease.add(size_t(q_step * pa) * ks);
  }
  q_t = lease.add(size_t(qt_step * pa) * ks);
  do_t = lease.add(size_t(qt_step * pa) * ks);
  st = lease.add(size_t(bm * bn) * f4);
  dpt = lease.add(size_t(bm * bn) * f4);
  if (kd != DType::f32 || terms.split) {
    pvn = lease.add(size_t(pb_step * pb) * ks);
    dsv = lease.add(size_t(pb_step * pb) * ks);
    dsa = lease.add(size_t(pa_step * pa) * ks);
  }
  acc = lease.add(size_t(bm * h) * f4);
  m = lease.add(size_t(bm) * f4);
  l = lease.add(size_t(bm) * f4);
  d = lease.add(size_t(bm) * f4);
  kv_out = lease.add(size_t(s * h) * dtype_size(sh.dt));
  part_bytes = 2 * Scratch::aligned(size_t(h * sp) * f4);
  if (!split) {
    dkt = lease.add(size_t(h * sp) * f4);
    dvt = lease.add(size_t(h * sp) * f4);
  }
  tmp_for({kt_step, kv_step, q_step, qt_step, pb_step});
}

ScoreTile score_tile(const Shape& s, const Inputs& in, const Plan& p, const Block& b, float* st, int64_t c0,
                     int64_t width) {
  ScoreTile tile;
  tile.s = st, tile.ld = p.bn, tile.rows = b.rows, tile.cols = std::min(width, s.s - c0), tile.width = width;
  tile.scale = s.scale, tile.causal = s.causal, tile.limit0 = b.i0 - c0 + 1;
  // Each operand's element (item, n, i0, c0).
  auto first = [&](const Broadcast& o) { return o.offs[b.item] + b.n * o.sn + b.i0 * o.st + c0 * o.ss; };
  if (in.bias.data) {
    tile.bias = static_cast<const float*>(in.bias.data) + first(in.bias);
    tile.bias_rs = in.bias.st, tile.bias_cs = in.bias.ss;
  }
  if (in.mask.data) {
    tile.mask = static_cast<const uint8_t*>(in.mask.data) + first(in.mask);
    tile.mask_rs = in.mask.st, tile.mask_cs = in.mask.ss;
  }
  if (in.keep.data) {  // bits: c0, a multiple of the key quantum, starts a byte
    const Broadcast& k = in.keep;
    tile.keep = static_cast<const uint8_t*>(k.data) + k.offs[b.item] + b.n * k.sn + b.i0 * k.st + c0 / 8;
    tile.keep_rs = k.st, tile.keep_scale = in.keep_scale;
  }
  return tile;
}

int64_t Plan::keys_end(int64_t qb) const {
  if (!skip) return sp;
  return std::min(sp, round_up(std::min(s, qb * bm + rows_of(qb)), kq));
}

std::shared_ptr<const Plan> plan_for(const Dispatch& dp, const Shape& s, bool bias, bool mask,
                                     int64_t threads, const Blocks* force, Pass pass) {
  static PlanCache<17, Plan> plans;
  return plans.get({s.items, s.t, s.s, s.heads, s.kv_heads, s.h, int64_t(s.dt), s.causal, bias, mask, threads, s.products,
                    int64_t(dp.isa), int64_t(dp.bf16_multiply), force ? force->rows : -1,
                    force ? force->keys : -1, int64_t(pass)},
                   [&] { return Plan(dp, s, bias, mask, threads, force, pass); });
}

}  // namespace jb::attention
