// The forward pass: per work item, the panel's K^T and V re-blocked once, then per query
// block (of every head in the kv head's group) the flash loop over key chunks.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include "layers/attention/attention.h"
#include "layers/attention/plan.h"
#include "layers/attention/rows.h"
#include "layers/common/emulation.h"
#include "layers/common/scratch.h"
#include "layers/common/work.h"
#include "parallel/job.h"

namespace jb::attention {

Job forward_job(int64_t threads, const Dispatch& dp, const Shape& s, const Inputs& in, void* o, float* stats,
                const Blocks* force) {
  check_shape(s);
  Job job;
  job.name = "attention_fwd";
  if (s.items == 0 || s.t == 0 || s.heads == 0) return job;
  const auto plan = plan_for(dp, s, in.bias.data, in.mask.data, threads, force, Pass::forward);
  job.keep.push_back(plan);
  job.flops = 4.0 * double(s.items) * double(s.heads) * double(s.t) * double(s.s) * double(s.h);
  const Plan* pp = plan.get();
  const Plan& p = *pp;
  const int64_t es = int64_t(dtype_size(s.dt)), ks = int64_t(p.ks);
  const int64_t q_ld = s.heads * s.h, kv_ld = s.kv_heads * s.h;
  const int64_t b_cols = p.vnni ? 2 : 1;  // elements per column of a VNNI-packed row
  const auto* qb_ = static_cast<const char*>(in.q);
  const auto* kb_ = static_cast<const char*>(in.k);
  const auto* vb_ = static_cast<const char*>(in.v);
  char* buf = job_scratch<1>(job, {p.lease.total * size_t(p.groups.concurrency())})[0];
  auto pool = std::make_shared<PanelPool>(buf, p.lease.total, p.groups.concurrency());
  PanelPool* leases = pool.get();
  job.keep.push_back(std::move(pool));

  job.add(p.groups.items(), [=](int64_t it) {
    const Plan& p = *pp;
    const Block first = p.block(it, p.groups.first(it), s.kv_heads);
    const PanelPool::Lease lease(*leases);
    char* w = lease.data;
    char *kt = w + p.kt, *vv = w + p.vv, *qt = w + p.qt;
    auto* st = reinterpret_cast<float*>(w + p.st);
    // P in the multiply dtype: the score tile itself (fp32), or rounded or split from it.
    void* pt = p.kd == DType::f32 && !p.terms.split ? static_cast<void*>(st) : w + p.pt;
    auto* tmp = reinterpret_cast<float*>(w + p.tmp);
    auto* acc = reinterpret_cast<float*>(w + p.acc);
    auto* m = reinterpret_cast<float*>(w + p.m);
    auto* l = reinterpret_cast<float*>(w + p.l);
    auto* alpha = reinterpret_cast<float*>(w + p.alpha);
    emulation::pack(p.terms, 1, kb_ + (in.k_offs[first.item] + first.kvh * s.h) * es, s.dt, kv_ld, true, s.h, s.s,
                    p.hp, p.sp, p.kd, p.vnni, kt, p.kt_step, p.isa, tmp);
    emulation::pack(p.terms, 1, vb_ + (in.v_offs[first.item] + first.kvh * s.h) * es, s.dt, kv_ld, false, s.s, s.h,
                    p.sp, s.h, p.kd, p.vnni, vv, p.kv_step, p.isa, tmp);

    for (int64_t blk = p.groups.first(it); blk < p.groups.last(it); ++blk) {
      const Block b = p.block(it, blk, s.kv_heads);
      const char* q_in = qb_ + (in.q_offs[b.item] + b.i0 * q_ld + b.n * s.h) * es;
      const char* qa = p.q_in_place ? q_in : qt;
      if (!p.q_in_place)
        emulation::pack(p.terms, 0, q_in, s.dt, q_ld, false, b.rows, s.h, b.rows, p.hp, p.kd, false, qt, p.q_step,
                        p.isa, tmp);
      // The output's rows, read for ownership while the block computes (the forward does not
      // gain from reading its next inputs ahead).
      const int64_t o_off = (b.item * s.t + b.i0) * q_ld + b.n * s.h;
      prefetch_rows_for_write(static_cast<char*>(o) + o_off * es, b.rows, s.h * es, q_ld * es);
      std::fill(m, m + b.rows, -std::numeric_limits<float>::infinity());
      std::fill(l, l + b.rows, 0.0f);
      std::fill(acc, acc + b.rows * s.h, 0.0f);
      const int64_t end = p.keys_end(b.qb);
      for (int64_t c0 = 0; c0 < end; c0 += p.bn) {
        const int64_t width = std::min(p.bn, end - c0);
        emulation::multiply(p.qk(b.last, width), p.terms, qa, p.q_step, kt + c0 * b_cols * ks, p.kt_step, st);
        const ScoreTile tile = score_tile(s, in, p, b, st, c0, width);
        if (p.terms.split) {  // P in fp32 over the scores, then its parts
          softmax_forward(tile, m, l, alpha, st, p.bn, DType::f32, p.isa);
          emulation::pack(p.terms, 0, st, DType::f32, p.bn, false, b.rows, width, b.rows, p.bn, p.kd, false, pt,
                          p.pa_step, p.isa, tmp);
        } else {
          softmax_forward(tile, m, l, alpha, pt, p.bn, p.kd, p.isa);
        }
        if (c0 > 0)  // rows whose max grew: their earlier sum is rescaled
          for (int64_t r = 0; r < b.rows; ++r)
            if (alpha[r] != 1.0f)
              for (int64_t j = 0; j < s.h; ++j) acc[r * s.h + j] *= alpha[r];
        emulation::multiply(p.pv(b.last, width), p.terms, pt, p.pa_step, vv + c0 * s.h * ks, p.kv_step, acc);
      }
      float* st_out = stats + ((b.item * s.heads + b.n) * s.t + b.i0) * 2;
      for (int64_t r = 0; r < b.rows; ++r) st_out[2 * r] = m[r], st_out[2 * r + 1] = l[r], l[r] = 1.0f / l[r];
      store_rows(acc, s.h, l, b.rows, s.h, static_cast<char*>(o) + o_off * es, q_ld, s.dt, p.isa);
    }
  });
  return job;
}

void forward(const Executor& ex, const Dispatch& dp, const Shape& s, const Inputs& in, void* o,
             float* stats, const Blocks* force) {
  run(ex, forward_job(ex.num_threads, dp, s, in, o, stats, force));
}

}  // namespace jb::attention
