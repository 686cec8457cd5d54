// The convolution's weight update: x re-blocked once, transposed (channels x pixels, padded
// with zeros so every tap reads a whole row); every (C-block, K-block, batch split) item owns
// its blocks of dw for every (r, s) and reduces over its output rows, chunk by chunk, with
// the chunk's dz rows staying in L2 across the R x S taps. Splits of the batch (only when
// the weights alone give too few items) write per-split fp32 partials that a last parallel
// loop sums: no atomics, no races. Emulated products (Shape::products): the re-blocking
// splits x^T and dz into their bf16 parts, and each output row's batch walks its terms.
#include <numeric>
#include <optional>

#include "layers/common/kernels.h"
#include "layers/common/plan_cache.h"
#include "layers/conv/depthwise.h"
#include "layers/conv/direct.h"
#include "layers/conv/narrow.h"

namespace jb::conv {

namespace {

constexpr int64_t kChunkBytes = 192 << 10;  // operand rows reduced at once (L2)
constexpr int64_t kSplitChannels = 64;      // x^T split into parts this many channels at a time

// ---------------------------------------------------------------------------------------
// The update's plan. The output rows are reduced in (n, p) rows of Q pixels (a pointwise
// convolution regroups its N x H x W pixels into rows of at most 256). x is transposed into
// xt [N][Hp][sw][C][Wq]: for every padded input row and column phase, channels x columns,
// zeros in the padding, so the A operand of tap (r, s) for output row (n, p) is the
// C-block's rows starting at column s' / sw of phase s' % sw of padded row p * sh + r', with
// (r', s') = (r * dh, s * dw) the dilated tap, and
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

// Groups of at most 8 output channels on AVX-512 multiply bf16 in fp32 (exact products):
// 8-lane ymm FMA tiles fill their lanes where vdpbf16ps tiles would fill half.
Dispatch update_dispatch(const Shape& s, const Dispatch& dp) {
  Dispatch d = dp;
  if (s.groups > 1 && s.kg() <= 8 && dp.isa == Isa::avx512) d.bf16_multiply = DType::f32;
  return d;
}

// dz read in place (fp32) has its rows k * 4 bytes apart: a batch element's q rows fall on
// 4096 / gcd(stride, 4096) distinct offsets of an L1 way (4 KiB); with more rows on each than
// L1 has ways (8), they evict each other. Packed (when the block fits half of L1), they don't:
// 1.25x the update of a 64-wide row of 256 channels (DeepLab's dilated 3x3, AMD Zen 3).
bool aliases_in_l1(int64_t q, int64_t stride_bytes, int64_t bn) {
  constexpr int64_t kWay = 4096, kWays = 8, kHalfL1 = 16 << 10;
  return q > kWays * (kWay / std::gcd(stride_bytes, kWay)) && q * bn * int64_t(sizeof(float)) <= kHalfL1;
}

struct UpdatePlan : MultiplyNarrow {
  UpdatePlan(const Shape& s, const Dispatch& dp, DType dw_dt, const Blocking* force, int64_t threads)
      : MultiplyNarrow(s.products ? DType::bf16 : s.dt, update_dispatch(s, dp)),
        v(update_view(s)), terms(emulation::terms(s.products)), c(s.cg()), k(s.kg()), groups(s.groups), rt(s.r),
        st(s.s),
        sh(pointwise(s) ? 1 : s.sh), sw(pointwise(s) ? 1 : s.sw),
        pt(pointwise(s) ? 0 : s.pt), pl(pointwise(s) ? 0 : s.pl), dil_h(s.dil_h), dil_w(s.dil_w) {
    bm = std::min(c, force && force->rows > 0 ? force->rows : 64);
    bn = std::min(k, force && force->cols > 0 ? force->cols : 64);
    cb = ceil_div(c, bm);
    kb = ceil_div(k, bn);
    rows = v.n * v.p;
    hp = (v.p - 1) * sh + (rt - 1) * dil_h + 1;
    wq = ceil_div((v.q - 1) * sw + (st - 1) * dil_w + 1, sw);
    slack = round_up(ceil_div(pl, sw) + 1, 32);
    bstride = c * groups * wq + slack;  // every group's channels
    // dz re-blocked for bf16 (VNNI pairs), and for groups: a group's few columns of every
    // pixel read in place would drag the other groups' through the cache again and again.
    packed = s.dt != DType::f32 || terms.split || groups > 1 || aliases_in_l1(v.q, k * int64_t(sizeof(float)), bn);
    blk_q = packed ? reblock::block_elems(v.q, bn, vnni) : 0;
    splits = std::max<int64_t>(1, std::min(rows, ceil_div(4 * threads, cb * kb * groups)));
    direct = splits == 1 && dw_dt == DType::f32;
    const int64_t parts = std::max(terms.parts[0], terms.parts[1]);
    chunk = std::max<int64_t>(1, kChunkBytes / int64_t((bm * wq * sw + v.q * bn) * parts * mul_bytes));
    xt_elems = v.n * hp * sw * bstride;
    dz_elems = packed ? groups * kb * rows * blk_q : 0;
    for (int64_t img = 0; img < v.n; ++img)
      for (int64_t p = 0; p < v.p; ++p)
        for (int i = 0; i < terms.count; ++i) {  // the row's terms: parts xt_elems / dz_elems apart
          a_rows.push_back(terms.of[0][i] * xt_elems + (img * hp + p * sh) * sw * bstride);
          b_rows.push_back(terms.of[1][i] * dz_elems + (img * v.p + p) * (packed ? blk_q : v.q * k * groups));
        }
    tmp_floats = terms.split ? 2 * std::max(kSplitChannels * wq, v.q * bn) : 0;
    BrgemmDesc d;
    d.k = v.q;
    d.lda = wq;
    d.ldb = packed ? (vnni ? 2 * bn : bn) : k * groups;
    d.ldc = k * groups;
    d.ab = mul_dt;
    d.c = DType::f32;
    first.emplace(d, c, k, bm, bn, tile_isa(bn));
    d.accumulate = true;
    more.emplace(d, c, k, bm, bn, tile_isa(bn));
    xt_bytes = size_t(xt_elems * terms.parts[0]) * mul_bytes;
    dz_bytes = size_t(dz_elems * terms.parts[1]) * mul_bytes;
    part_bytes = direct ? 0 : size_t(splits * rt * st * c * k * groups) * sizeof(float);
  }

  const UpdateView v;
  const emulation::Terms terms;
  const int64_t c, k, groups, rt, st, sh, sw, pt, pl, dil_h, dil_w;  // c, k: of one group
  int64_t bm = 0, bn = 0, cb = 0, kb = 0, rows = 0, hp = 0, wq = 0, slack = 0, bstride = 0;
  bool packed = false, direct = false;
  int64_t blk_q = 0, splits = 1, chunk = 1;
  int64_t xt_elems = 0, dz_elems = 0, tmp_floats = 0;  // one part of xt, of dz; emulation::pack's scratch
  std::vector<int64_t> a_rows, b_rows;  // per (output row, term): its xt row, its dz row
  std::optional<KernelSet> first, more;  // the first chunk of a split, the others
  size_t xt_bytes = 0, dz_bytes = 0, part_bytes = 0;
};

PlanCache<26, UpdatePlan> update_plans;

// The paths that take bf16 operands only (depthwise, narrow) emulate fp32 products over the
// operands' parts stacked along the mini-batch: image block i holds term i's part of x and of
// dz, so one bf16 update over the blocks sums every term's products. db sums dz itself.
void stack_parts(Job& job, const Shape& s, const void* x, const void* dz, const void** xs, const void** dzs,
                 float* db) {
  const emulation::Terms t = emulation::terms(s.products);
  const int64_t ne[2] = {s.n * s.h * s.w * s.c, s.n * s.p() * s.q() * s.k};
  const auto buf = job_scratch<2>(job, {size_t(ne[0] * t.count) * 2, size_t(ne[1] * t.count) * 2});
  constexpr int64_t kChunk = 4096;
  const int64_t chunks[2] = {ceil_div(ne[0], kChunk), ceil_div(ne[1], kChunk)};
  const float* src[2] = {static_cast<const float*>(x), static_cast<const float*>(dz)};
  uint16_t* dst[2] = {reinterpret_cast<uint16_t*>(buf[0]), reinterpret_cast<uint16_t*>(buf[1])};
  constexpr int64_t kDbCols = 64;
  const int64_t ndb = db ? ceil_div(s.k, kDbCols) : 0;
  job.add(t.count * (chunks[0] + chunks[1]) + ndb, [=](int64_t i) {
    if (i >= t.count * (chunks[0] + chunks[1])) {  // db, 64 columns at a time
      const int64_t j0 = (i - t.count * (chunks[0] + chunks[1])) * kDbCols, width = std::min(kDbCols, s.k - j0);
      float acc[kDbCols] = {};
      add_column_sums(src[1] + j0, DType::f32, s.k, s.n * s.p() * s.q(), width, acc);
      std::memcpy(db + j0, acc, size_t(width) * sizeof(float));
      return;
    }
    const int64_t term = i / (chunks[0] + chunks[1]), j = i % (chunks[0] + chunks[1]);
    const int side = j < chunks[0] ? 0 : 1;
    const int64_t e0 = (side ? j - chunks[0] : j) * kChunk, n = std::min(kChunk, ne[side] - e0);
    emulation::part_of(src[side] + e0, t.of[side][term], dst[side] + term * ne[side] + e0, DType::bf16, n);
  });
  *xs = buf[0], *dzs = buf[1];
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Weight update: see UpdatePlan. Items (K-block, C-block, split) own dw's blocks (or the
// split's partial), for every (r, s).

Job update_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* dz, void* dw,
               DType dw_dt, float* db, const Blocking* force) {
  validate(s);
  Job job;
  job.name = "conv_upd";
  const int64_t welems = s.r * s.s * s.cg() * s.k;
  if (s.n == 0) {  // an empty batch: zero gradients
    std::memset(dw, 0, size_t(welems) * dtype_size(dw_dt));
    if (db) std::memset(db, 0, size_t(s.k) * sizeof(float));
    return job;
  }
  job.flops = 2.0 * double(s.n) * double(s.p()) * double(s.q()) * double(s.k) * double(s.r * s.s) * double(s.cg());
  Shape stacked = s;  // emulated products on the bf16-only paths: stack_parts
  stacked.n = s.n * emulation::terms(s.products).count, stacked.dt = DType::bf16, stacked.products = 0;
  const bool bf16_only = s.products && (depthwise(stacked) || narrow_update_fits(stacked, dp));
  if (bf16_only) stack_parts(job, s, x, dz, &x, &dz, db);
  const Shape& u = bf16_only ? stacked : s;
  if (depthwise(u) && !u.products) {  // emulated products take the general path below
    depthwise_update(job, threads, dp, u, x, dz, dw, dw_dt, bf16_only ? nullptr : db);
    return job;
  }
  if (!u.products && narrow_update_fits(u, dp)) {
    narrow_update(job, threads, dp, u, x, dz, dw, dw_dt, bf16_only ? nullptr : db);
    return job;
  }
  const auto plan = update_plans.get(key_of(s, int64_t(dw_dt), threads, dp, force), [&] {
    return UpdatePlan(s, dp, dw_dt, force, threads);
  });
  const UpdatePlan* p = plan.get();
  job.keep.push_back(plan);
  const UpdateView v = p->v;
  const size_t mul_bytes = p->mul_bytes;
  const auto buf = job_scratch<3>(job, {p->xt_bytes, p->dz_bytes, p->part_bytes});
  // emulation::pack's scratch, one per running item
  PanelPool* tmps = p->terms.split ? job_leases(job, size_t(p->tmp_floats) * sizeof(float), threads) : nullptr;

  // Re-blocking: x^T per (image, padded row, column phase), dz per (K-block, row), db per
  // 64 columns (summed from dz in place, by the item owning the columns).
  const View<char, 4> xt(buf[0], {v.n, p->hp, p->sw, p->bstride * int64_t(mul_bytes)});
  const int64_t nxt = v.n * p->hp * p->sw, ndz = p->packed ? p->groups * p->kb * p->rows : 0;
  const int64_t pix = v.n * v.p * v.q;
  static constexpr int64_t kDbCols = 64;
  const int64_t ndb = db ? ceil_div(s.k, kDbCols) : 0;
  char* dzb = buf[1];
  job.add(nxt + ndz + ndb, [p, v, s, xt, nxt, ndz, pix, mul_bytes, x, dz, db, dzb, tmps](int64_t i) {
    std::optional<PanelPool::Lease> lease;
    if (tmps && i < nxt + ndz) lease.emplace(*tmps);
    float* tmp = lease ? reinterpret_cast<float*>(lease->data) : nullptr;
    if (i < nxt) {
      const int64_t img = i / (p->hp * p->sw), hr = i / p->sw % p->hp, ph = i % p->sw;
      char* dst = xt.at(img, hr, ph);
      const size_t part_bytes = size_t(p->xt_elems) * mul_bytes;
      const int64_t ih = hr - p->pt;
      const int64_t j_lo = std::max<int64_t>(0, ceil_div(p->pl - ph, p->sw));
      const int64_t j_hi = std::min(p->wq, ceil_div(v.w + p->pl - ph, p->sw));
      const bool empty = ih < 0 || ih >= v.h || j_hi <= j_lo;
      for (int part = 0; part < p->terms.parts[0]; ++part)
        std::memset(dst + part * part_bytes, 0, size_t(empty ? s.c * p->wq : j_lo) * mul_bytes);
      if (empty) return;
      // Rows of wq columns starting at column j_lo: the zero fill of each row's end runs
      // into the next row's left padding (and the block's slack after the last row).
      const int64_t step = p->terms.split ? kSplitChannels : s.c;  // tmp holds this many
      for (int64_t c0 = 0; c0 < s.c; c0 += step)
        emulation::pack(p->terms, 0, at(x, s.dt, ((img * v.h + ih) * v.w + j_lo * p->sw + ph - p->pl) * s.c + c0),
                        s.dt, p->sw * s.c, true, std::min(step, s.c - c0), j_hi - j_lo, std::min(step, s.c - c0),
                        p->wq, p->mul_dt, false, dst + (c0 * p->wq + j_lo) * int64_t(mul_bytes), p->xt_elems,
                        p->isa, tmp);
      return;
    }
    if (i < nxt + ndz) {
      // K-block kb of every group in turn: columns g * kg + k0
      const int64_t kb = (i - nxt) / p->rows, row = (i - nxt) % p->rows, k0 = kb % p->kb * p->bn;
      emulation::pack(p->terms, 1, at(dz, s.dt, row * v.q * s.k + kb / p->kb * p->k + k0), s.dt, s.k, false, v.q,
                      std::min(p->bn, p->k - k0), v.q, p->bn, p->mul_dt, p->vnni,
                      dzb + ((kb * p->rows + row) * p->blk_q) * mul_bytes, p->dz_elems, p->isa, tmp);
      return;
    }
    const int64_t j0 = (i - nxt - ndz) * kDbCols, width = std::min(kDbCols, s.k - j0);
    float acc[kDbCols] = {};
    add_column_sums(at(dz, s.dt, j0), s.dt, s.k, pix, width, acc);
    std::memcpy(db + j0, acc, size_t(width) * sizeof(float));
  });

  // The reduction: item (group, kb, cb, split) over its rows, chunk by chunk, every tap (r, s);
  // c0 and k0 within the group, dw's rows c0 (of the group's cg) and columns g * kg + k0.
  float* part = p->direct ? static_cast<float*>(dw) : reinterpret_cast<float*>(buf[2]);
  const int64_t per_split = ceil_div(p->rows, p->splits);
  char* xtb = buf[0];
  job.add(p->groups * p->kb * p->cb * p->splits, [p, s, part, per_split, welems, mul_bytes, dz, dzb, xtb](int64_t i) {
    const int64_t sp = i % p->splits, cbi = i / p->splits % p->cb, gkb = i / p->splits / p->cb;
    const int64_t g = gkb / p->kb, c0 = cbi * p->bm, k0 = gkb % p->kb * p->bn;
    const int64_t m = std::min(p->bm, p->c - c0), cols = std::min(p->bn, p->k - k0), kg0 = g * p->k + k0;
    const int64_t r0 = sp * per_split, r1 = std::min(p->rows, r0 + per_split);
    float* out = part + (p->direct ? 0 : sp * welems);
    const char* b = p->packed ? dzb + gkb * p->rows * p->blk_q * int64_t(mul_bytes)
                              : static_cast<const char*>(at(dz, s.dt, kg0));
    if (r0 >= r1) {  // a split without rows (more splits than rows): zero partials
      for (int64_t t = 0; t < s.r * s.s; ++t)
        for (int64_t cc = 0; cc < m; ++cc)
          std::memset(out + (t * p->c + c0 + cc) * s.k + kg0, 0, size_t(cols) * sizeof(float));
      return;
    }
    for (int64_t ch = r0; ch < r1; ch += p->chunk) {
      const int64_t count = std::min(p->chunk, r1 - ch);
      const Brgemm& kern = (ch == r0 ? *p->first : *p->more)(m, cols);
      const int64_t t0 = ch * p->terms.count, batch = count * p->terms.count;  // (row, term) pairs
      for (int64_t r = 0; r < s.r; ++r)
        for (int64_t t = 0; t < s.s; ++t) {
          const int64_t rr = r * p->dil_h, tt = t * p->dil_w;  // the dilated tap's input offsets
          const char* a = xtb + ((rr * p->sw + tt % p->sw) * p->bstride + (g * p->c + c0) * p->wq + tt / p->sw) *
                                    int64_t(mul_bytes);
          kern.offsets(a, p->a_rows.data() + t0, b, p->b_rows.data() + t0, batch,
                       out + ((r * s.s + t) * p->c + c0) * s.k + kg0);
        }
    }
  });
  if (p->direct) return job;

  // Partials of the splits summed into dw.
  const int64_t chunk = 4096;
  job.add(ceil_div(welems, chunk), [p, part, welems, dw, dw_dt, chunk](int64_t i) {
    const int64_t a = i * chunk, count = std::min(chunk, welems - a);
    with_type(dw_dt, [&](auto ts) {
      using T = decltype(ts);
      T* dst = static_cast<T*>(dw) + a;
      for (int64_t e = 0; e < count; ++e) {
        float acc = part[a + e];
        for (int64_t sp = 1; sp < p->splits; ++sp) acc += part[sp * welems + a + e];
        dst[e] = from_f32<T>(acc);
      }
    });
  });
  return job;
}

void update(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
            void* dw, DType dw_dt, float* db, const Blocking* force) {
  run(ex, update_job(ex.num_threads, dp, s, x, dz, dw, dw_dt, db, force));
}

}  // namespace jb::conv
