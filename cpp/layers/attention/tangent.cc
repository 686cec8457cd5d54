// The forward-mode tangent: per work item, the panel's K^T, V, tK^T and tV re-blocked once;
// per query block the saved row statistics, then over key chunks S, tQ K^T and Q tK^T, the
// tangent's element-wise work (rows.h's softmax_tangent), and Z tV + (Z tS) V accumulated;
// finally to = acc - c * O.
#include <algorithm>
#include <memory>
#include <stdexcept>

#include "layers/attention/attention.h"
#include "layers/attention/plan.h"
#include "layers/attention/rows.h"
#include "layers/common/emulation.h"
#include "layers/common/scratch.h"
#include "layers/common/work.h"
#include "parallel/job.h"

namespace jb::attention {

Job tangent_job(int64_t threads, const Dispatch& dp, const Shape& s, const Inputs& in, const Saved& saved,
                const Tangents& tin, void* to, const Blocks* force) {
  check_shape(s);
  if (s.products) throw std::invalid_argument("attention: the tangent pass computes exact products only");
  Job job;
  job.name = "attention_tangent";
  if (s.items == 0 || s.t == 0 || s.heads == 0) return job;
  const auto plan = plan_for(dp, s, in.bias.data, in.mask.data, threads, force, Pass::tangent);
  job.keep.push_back(plan);
  job.flops = 10.0 * double(s.items) * double(s.heads) * double(s.t) * double(s.s) * double(s.h);
  const Plan* pp = plan.get();
  const Plan& p = *pp;
  const int64_t es = int64_t(dtype_size(s.dt)), ks = int64_t(p.ks);
  const int64_t q_ld = s.heads * s.h, kv_ld = s.kv_heads * s.h;
  const int64_t b_cols = p.vnni ? 2 : 1;
  const auto at = [es](const void* base, int64_t elems) { return static_cast<const char*>(base) + elems * es; };
  char* buf = job_scratch<1>(job, {p.lease.total * size_t(p.groups.concurrency())})[0];
  auto pool = std::make_shared<PanelPool>(buf, p.lease.total, p.groups.concurrency());
  PanelPool* leases = pool.get();
  job.keep.push_back(std::move(pool));

  job.add(p.groups.items(), [=](int64_t it) {
    const Plan& p = *pp;
    const emulation::Terms& tm = p.terms;
    const Block first = p.block(it, p.groups.first(it), s.kv_heads);
    const PanelPool::Lease lease(*leases);
    char* w = lease.data;
    char *kt = w + p.kt, *vv = w + p.vv, *tkt = w + p.tkt, *tvv = w + p.tvv;
    auto* st = reinterpret_cast<float*>(w + p.st);
    auto* tsa = reinterpret_cast<float*>(w + p.tsa);
    auto* tsb = reinterpret_cast<float*>(w + p.tsb);
    void* zt = p.kd == DType::f32 ? static_cast<void*>(st) : w + p.pt;  // Z over the scores when fp32
    auto* acc = reinterpret_cast<float*>(w + p.acc);
    auto* m = reinterpret_cast<float*>(w + p.m);
    auto* inv_l = reinterpret_cast<float*>(w + p.l);
    auto* c = reinterpret_cast<float*>(w + p.c);
    auto* tmp = reinterpret_cast<float*>(w + p.tmp);
    const int64_t kv_at = first.kvh * s.h;
    emulation::pack(tm, 1, at(in.k, in.k_offs[first.item] + kv_at), s.dt, kv_ld, true, s.h, s.s, p.hp, p.sp, p.kd,
                    p.vnni, kt, p.kt_step, p.isa, tmp);
    emulation::pack(tm, 1, at(in.v, in.v_offs[first.item] + kv_at), s.dt, kv_ld, false, s.s, s.h, p.sp, s.h, p.kd,
                    p.vnni, vv, p.kv_step, p.isa, tmp);
    emulation::pack(tm, 1, at(tin.k, tin.k_offs[first.item] + kv_at), s.dt, kv_ld, true, s.h, s.s, p.hp, p.sp,
                    p.kd, p.vnni, tkt, p.kt_step, p.isa, tmp);
    emulation::pack(tm, 1, at(tin.v, tin.v_offs[first.item] + kv_at), s.dt, kv_ld, false, s.s, s.h, p.sp, s.h,
                    p.kd, p.vnni, tvv, p.kv_step, p.isa, tmp);

    for (int64_t blk = p.groups.first(it); blk < p.groups.last(it); ++blk) {
      const Block b = p.block(it, blk, s.kv_heads);
      const int64_t row0 = b.i0 * q_ld + b.n * s.h;
      const char* qa = at(in.q, in.q_offs[b.item] + row0);
      const char* tqa = at(tin.q, tin.q_offs[b.item] + row0);
      if (!p.q_in_place) {
        emulation::pack(tm, 0, qa, s.dt, q_ld, false, b.rows, s.h, b.rows, p.hp, p.kd, false, w + p.qt, p.q_step,
                        p.isa, tmp);
        emulation::pack(tm, 0, tqa, s.dt, q_ld, false, b.rows, s.h, b.rows, p.hp, p.kd, false, w + p.tqt, p.q_step,
                        p.isa, tmp);
        qa = w + p.qt, tqa = w + p.tqt;
      }
      const float* stat = saved.stats + saved.stats_offs[b.item] + (b.n * s.t + b.i0) * 2;
      for (int64_t r = 0; r < b.rows; ++r) m[r] = stat[2 * r], inv_l[r] = 1.0f / stat[2 * r + 1], c[r] = 0.0f;
      std::fill(acc, acc + b.rows * s.h, 0.0f);
      const int64_t end = p.keys_end(b.qb);
      for (int64_t c0 = 0; c0 < end; c0 += p.bn) {
        const int64_t width = std::min(p.bn, end - c0);
        const Brgemm& qk = p.qk(b.last, width);
        emulation::multiply(qk, tm, qa, p.q_step, kt + c0 * b_cols * ks, p.kt_step, st);
        emulation::multiply(qk, tm, tqa, p.q_step, kt + c0 * b_cols * ks, p.kt_step, tsa);
        emulation::multiply(qk, tm, qa, p.q_step, tkt + c0 * b_cols * ks, p.kt_step, tsb);
        const ScoreTile tile = score_tile(s, in, p, b, st, c0, width);
        const float* tbias = nullptr;
        if (tin.bias.data) {  // at (item, n, i0, c0), with the bias's strides
          const Broadcast& t = tin.bias;
          tbias = static_cast<const float*>(t.data) + t.offs[b.item] + b.n * t.sn + b.i0 * t.st + c0 * t.ss;
        }
        softmax_tangent(tile, tsa, tsb, p.bn, tbias, m, inv_l, c, zt, w + p.wt, p.bn, p.kd, p.isa);
        const Brgemm& pv = p.pv(b.last, width);
        emulation::multiply(pv, tm, zt, p.pa_step, tvv + c0 * s.h * ks, p.kv_step, acc);
        emulation::multiply(pv, tm, w + p.wt, p.pa_step, vv + c0 * s.h * ks, p.kv_step, acc);
      }
      // to = acc - c * O, O's rows read in dt
      const char* o_in = at(saved.o, saved.o_offs[b.item] + row0);
      for (int64_t r = 0; r < b.rows; ++r)
        for (int64_t j = 0; j < s.h; ++j) {
          const char* e = o_in + (r * q_ld + j) * es;
          const float o = s.dt == DType::f32 ? *reinterpret_cast<const float*>(e)
                                             : bf16_to_f32(*reinterpret_cast<const uint16_t*>(e));
          acc[r * s.h + j] -= c[r] * o;
        }
      store_rows(acc, s.h, nullptr, b.rows, s.h, static_cast<char*>(to) + (b.item * s.t * q_ld + row0) * es, q_ld,
                 s.dt, p.isa);
    }
  });
  return job;
}

void tangent(const Executor& ex, const Dispatch& dp, const Shape& s, const Inputs& in, const Saved& saved,
             const Tangents& tin, void* to, const Blocks* force) {
  run(ex, tangent_job(ex.num_threads, dp, s, in, saved, tin, to, force));
}

}  // namespace jb::attention
