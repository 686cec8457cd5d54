// The forward pass: per work item, the panel's K^T and V re-blocked once, then per query
// block (of every head in the kv head's group) the flash loop over key chunks.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "layers/attention/attention.h"
#include "layers/attention/plan.h"
#include "layers/attention/rows.h"
#include "layers/common/operand.h"
#include "layers/common/reblock.h"
#include "layers/common/scratch.h"

namespace jb::attention {

namespace {

template <class T>
void write_output(const float* acc, const float* l, int64_t rows, int64_t h, int64_t ld, T* o) {
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.0f / l[r];
    for (int64_t j = 0; j < h; ++j) o[r * ld + j] = from_f32<T>(acc[r * h + j] * inv);
  }
}

}  // namespace

void forward(const Executor& ex, const Dispatch& dp, const Shape& s, const Inputs& in, void* o,
             float* stats, const Blocks* force) {
  check_shape(s);
  if (s.items == 0 || s.t == 0 || s.heads == 0) return;
  const auto plan = plan_for(dp, s, in.bias.data, in.mask.data, ex.num_threads, force, false);
  const Plan& p = *plan;
  const int64_t es = int64_t(dtype_size(s.dt)), ks = int64_t(p.ks);
  const int64_t q_ld = s.heads * s.h, kv_ld = s.kv_heads * s.h;
  const int64_t b_cols = p.vnni ? 2 : 1;  // elements per column of a VNNI-packed row
  const auto* qb_ = static_cast<const char*>(in.q);
  const auto* kb_ = static_cast<const char*>(in.k);
  const auto* vb_ = static_cast<const char*>(in.v);
  char* buf = Scratch::get<1>({p.lease.total * size_t(p.groups.concurrency())})[0];
  PanelPool leases(buf, p.lease.total, p.groups.concurrency());

  parallel_for(ex, p.groups.items(), [&](int64_t it) {
    const int64_t panel = p.groups.panel(it);
    const int64_t item = panel / s.kv_heads, kvh = panel % s.kv_heads;
    const PanelPool::Lease lease(leases);
    char* w = lease.data;
    char *kt = w + p.kt, *vv = w + p.vv, *qt = w + p.qt;
    auto* st = reinterpret_cast<float*>(w + p.st);
    void* pt = p.kd == DType::f32 ? static_cast<void*>(st) : w + p.pt;
    auto* acc = reinterpret_cast<float*>(w + p.acc);
    auto* m = reinterpret_cast<float*>(w + p.m);
    auto* l = reinterpret_cast<float*>(w + p.l);
    auto* alpha = reinterpret_cast<float*>(w + p.alpha);
    reblock::pack(kb_ + (in.k_offs[item] + kvh * s.h) * es, s.dt, kv_ld, true, s.h, s.s, p.hp, p.sp, p.kd,
                  p.vnni, kt, p.isa);
    const char* v_in = vb_ + (in.v_offs[item] + kvh * s.h) * es;
    reblock::pack(v_in, s.dt, kv_ld, false, s.s, s.h, p.sp, s.h, p.kd, p.vnni, vv, p.isa);

    for (int64_t blk = p.groups.first(it); blk < p.groups.last(it); ++blk) {
      const int64_t n = kvh * p.group + blk / p.nqb, qb = blk % p.nqb;
      const int64_t i0 = qb * p.bm, rows = p.rows_of(qb);
      const bool last = rows != p.bm;
      const char* q_in = qb_ + (in.q_offs[item] + i0 * q_ld + n * s.h) * es;
      const char* qa = p.q_in_place ? q_in : qt;
      if (!p.q_in_place) reblock::pack(q_in, s.dt, q_ld, false, rows, s.h, rows, p.hp, p.kd, false, qt, p.isa);
      if (blk + 1 < p.groups.last(it)) {  // the next block's rows of q
        const int64_t nq = (blk + 1) % p.nqb, nn = kvh * p.group + (blk + 1) / p.nqb;
        prefetch_rows(qb_ + (in.q_offs[item] + nq * p.bm * q_ld + nn * s.h) * es, p.rows_of(nq), s.h * es, q_ld * es);
      } else if (it + 1 < p.groups.items()) {  // the next item's k and v
        const int64_t np = p.groups.panel(it + 1), ni = np / s.kv_heads, nk = np % s.kv_heads;
        prefetch_rows(kb_ + (in.k_offs[ni] + nk * s.h) * es, s.s, s.h * es, kv_ld * es);
        prefetch_rows(vb_ + (in.v_offs[ni] + nk * s.h) * es, s.s, s.h * es, kv_ld * es);
      }
      const int64_t o_off = (item * s.t + i0) * q_ld + n * s.h;
      prefetch_rows_for_write(static_cast<char*>(o) + o_off * es, rows, s.h * es, q_ld * es);
      std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
      std::fill(l, l + rows, 0.0f);
      std::fill(acc, acc + rows * s.h, 0.0f);
      const int64_t end = p.keys_end(qb);
      for (int64_t c0 = 0; c0 < end; c0 += p.bn) {
        const int64_t width = std::min(p.bn, end - c0);
        const int64_t cols = std::min(width, s.s - c0);
        p.qk(last, width).strided(qa, 0, kt + c0 * b_cols * ks, 0, 1, st);
        ScoreTile tile;
        tile.s = st, tile.ld = p.bn, tile.rows = rows, tile.cols = cols, tile.width = width;
        tile.scale = s.scale, tile.causal = s.causal, tile.limit0 = i0 - c0 + 1;
        if (in.bias.data) {
          const Broadcast& b = in.bias;
          tile.bias = static_cast<const float*>(b.data) + b.offs[item] + n * b.sn + i0 * b.st + c0 * b.ss;
          tile.bias_rs = b.st, tile.bias_cs = b.ss;
        }
        if (in.mask.data) {
          const Broadcast& b = in.mask;
          tile.mask = static_cast<const uint8_t*>(b.data) + b.offs[item] + n * b.sn + i0 * b.st + c0 * b.ss;
          tile.mask_rs = b.st, tile.mask_cs = b.ss;
        }
        softmax_forward(tile, m, l, alpha, pt, p.bn, p.kd, p.isa);
        if (c0 > 0)  // rows whose max grew: their earlier sum is rescaled
          for (int64_t r = 0; r < rows; ++r)
            if (alpha[r] != 1.0f)
              for (int64_t j = 0; j < s.h; ++j) acc[r * s.h + j] *= alpha[r];
        p.pv(last, width).strided(pt, 0, vv + c0 * s.h * ks, 0, 1, acc);
      }
      with_type(s.dt, [&](auto zero) {
        using T = decltype(zero);
        write_output(acc, l, rows, s.h, q_ld, static_cast<T*>(o) + o_off);
      });
      float* st_out = stats + ((item * s.heads + n) * s.t + i0) * 2;
      for (int64_t r = 0; r < rows; ++r) st_out[2 * r] = m[r], st_out[2 * r + 1] = l[r];
    }
  });
}

}  // namespace jb::attention
