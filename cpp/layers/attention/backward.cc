// The backward pass: per work item, the panel's K^T, V^T and K re-blocked once; per query
// block, P and dP recomputed chunk by chunk and dS formed from them; dQ of the block is
// complete after its chunks, dK^T and dV^T accumulate over every block of the panel (in the
// item's scratch, or in per-item parts summed afterwards when panels are split).
#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>

#include "layers/attention/attention.h"
#include "layers/attention/plan.h"
#include "layers/attention/rows.h"
#include "layers/common/emulation.h"
#include "layers/common/reblock.h"
#include "layers/common/scratch.h"
#include "layers/common/work.h"
#include "parallel/job.h"

namespace jb::attention {

namespace {

// out (S x H, rows ld apart, dtype dt) = the transpose of the H x sp fp32 matrix at parts,
// after adding the `count - 1` parts that follow it `part_stride` floats apart (in place);
// transposed into tmp, then copied row by row.
void write_transposed(float* parts, int64_t count, int64_t part_stride, int64_t h, int64_t s, int64_t sp,
                      DType dt, Isa isa, char* tmp, int64_t ld, char* out) {
  for (int64_t i = 1; i < count; ++i)
    for (int64_t e = 0; e < h * sp; ++e) parts[e] += parts[i * part_stride + e];
  reblock::pack(parts, DType::f32, sp, true, s, h, s, h, dt, false, tmp, isa);
  const size_t row = size_t(h) * dtype_size(dt);
  for (int64_t j = 0; j < s; ++j) std::memcpy(out + j * ld * int64_t(dtype_size(dt)), tmp + j * int64_t(row), row);
}

}  // namespace

Job backward_job(int64_t threads, const Dispatch& dp, const Shape& s, const Inputs& in, const Saved& saved,
                 void* dq, void* dk, void* dv, float* dbias, const Blocks* force) {
  check_shape(s);
  Job job;
  job.name = "attention_bwd";
  if (s.items == 0) return job;
  const int64_t es = int64_t(dtype_size(s.dt));
  const int64_t q_ld = s.heads * s.h, kv_ld = s.kv_heads * s.h;
  if (s.t == 0 || s.heads == 0) {  // no queries: the keys and values get no gradient
    job.add(1, [=](int64_t) {
      std::memset(dk, 0, size_t(s.items * s.s * kv_ld * es));
      std::memset(dv, 0, size_t(s.items * s.s * kv_ld * es));
    });
    return job;
  }
  const auto plan = plan_for(dp, s, in.bias.data, in.mask.data, threads, force, Pass::backward);
  job.keep.push_back(plan);
  job.flops = 8.0 * double(s.items) * double(s.heads) * double(s.t) * double(s.s) * double(s.h);
  const Plan* pp = plan.get();
  const Plan& p = *pp;
  const int64_t ks = int64_t(p.ks);
  const int64_t b_cols = p.vnni ? 2 : 1;
  const int64_t panels = s.items * s.kv_heads, per_panel = p.groups.items() / panels;
  const auto bytes = [](const void* base, int64_t elems, int64_t size) {
    return static_cast<const char*>(base) + elems * size;
  };
  const auto buf = job_scratch<2>(job, {p.lease.total * size_t(p.groups.concurrency()),
                                        p.split ? p.part_bytes * size_t(p.groups.items()) : 0});
  auto pool = std::make_shared<PanelPool>(buf[0], p.lease.total, p.groups.concurrency());
  PanelPool* leases = pool.get();
  job.keep.push_back(std::move(pool));
  const size_t half = p.part_bytes / 2;

  // dK^T and dV^T of item `it`: its parts, or its lease's.
  auto accumulators = [pp, buf, half](int64_t it, char* w) {
    const Plan& p = *pp;
    char* base = p.split ? buf[1] + size_t(it) * p.part_bytes : nullptr;
    return std::make_pair(reinterpret_cast<float*>(base ? base : w + p.dkt),
                          reinterpret_cast<float*>(base ? base + half : w + p.dvt));
  };
  auto write_kv = [pp, s, kv_ld, es, dk, dv](int64_t panel, float* dkt, float* dvt, int64_t count, char* tmp) {
    const Plan& p = *pp;
    const int64_t item = panel / s.kv_heads, kvh = panel % s.kv_heads;
    const int64_t off = (item * s.s * kv_ld + kvh * s.h) * es, stride = int64_t(p.part_bytes / sizeof(float));
    write_transposed(dkt, count, stride, s.h, s.s, p.sp, s.dt, p.isa, tmp, kv_ld, static_cast<char*>(dk) + off);
    write_transposed(dvt, count, stride, s.h, s.s, p.sp, s.dt, p.isa, tmp, kv_ld, static_cast<char*>(dv) + off);
  };

  job.add(p.groups.items(), [=](int64_t it) {
    const Plan& p = *pp;
    const Block first = p.block(it, p.groups.first(it), s.kv_heads);
    const PanelPool::Lease lease(*leases);
    char* w = lease.data;
    char *kt = w + p.kt, *vt = w + p.vv, *kb = w + p.kb;
    char *qt = w + p.qt, *dot = w + p.dot, *q_t = w + p.q_t, *do_t = w + p.do_t;
    auto* st = reinterpret_cast<float*>(w + p.st);
    auto* dpt = reinterpret_cast<float*>(w + p.dpt);
    auto* acc = reinterpret_cast<float*>(w + p.acc);
    auto* m = reinterpret_cast<float*>(w + p.m);
    auto* inv_l = reinterpret_cast<float*>(w + p.l);
    auto* d = reinterpret_cast<float*>(w + p.d);
    auto* tmp = reinterpret_cast<float*>(w + p.tmp);
    const auto [dkt, dvt] = accumulators(it, w);
    std::fill(dkt, dkt + s.h * p.sp, 0.0f);
    std::fill(dvt, dvt + s.h * p.sp, 0.0f);
    const char* kp = bytes(in.k, in.k_offs[first.item] + first.kvh * s.h, es);
    const char* vp = bytes(in.v, in.v_offs[first.item] + first.kvh * s.h, es);
    const emulation::Terms& tm = p.terms;
    emulation::pack(tm, 1, kp, s.dt, kv_ld, true, s.h, s.s, p.hp, p.sp, p.kd, p.vnni, kt, p.kt_step, p.isa, tmp);
    emulation::pack(tm, 1, vp, s.dt, kv_ld, true, s.h, s.s, p.hp, p.sp, p.kd, p.vnni, vt, p.kt_step, p.isa, tmp);
    emulation::pack(tm, 1, kp, s.dt, kv_ld, false, s.s, s.h, p.sp, s.h, p.kd, p.vnni, kb, p.kv_step, p.isa, tmp);
    if (!p.split) {  // dK and dV's rows, written at the end of the item
      const int64_t off = (first.item * s.s * kv_ld + first.kvh * s.h) * es;
      prefetch_rows_for_write(static_cast<char*>(dk) + off, s.s, s.h * es, kv_ld * es);
      prefetch_rows_for_write(static_cast<char*>(dv) + off, s.s, s.h * es, kv_ld * es);
    }

    for (int64_t blk = p.groups.first(it); blk < p.groups.last(it); ++blk) {
      const Block b = p.block(it, blk, s.kv_heads);
      const int64_t rp = b.last ? p.last_rp : p.bmp;
      const int64_t at = b.i0 * q_ld + b.n * s.h;  // the block's first element in (T, N, H)
      const char* qp = bytes(in.q, in.q_offs[b.item] + at, es);
      const char* op = bytes(saved.o, saved.o_offs[b.item] + at, es);
      const char* gp = bytes(saved.dout, saved.dout_offs[b.item] + at, es);
      const char *qa = qp, *ga = gp;
      if (!p.q_in_place) {
        emulation::pack(tm, 0, qp, s.dt, q_ld, false, b.rows, s.h, b.rows, p.hp, p.kd, false, qt, p.q_step, p.isa,
                        tmp);
        emulation::pack(tm, 0, gp, s.dt, q_ld, false, b.rows, s.h, b.rows, p.hp, p.kd, false, dot, p.q_step, p.isa,
                        tmp);
        qa = qt, ga = dot;
      }
      emulation::pack(tm, 0, qp, s.dt, q_ld, true, s.h, b.rows, s.h, p.bmp, p.kd, false, q_t, p.qt_step, p.isa, tmp);
      emulation::pack(tm, 0, gp, s.dt, q_ld, true, s.h, b.rows, s.h, p.bmp, p.kd, false, do_t, p.qt_step, p.isa,
                      tmp);
      if (blk + 1 < p.groups.last(it)) {  // the next block's rows of q, dO and O
        const Block nb = p.block(it, blk + 1, s.kv_heads);
        const int64_t nat = nb.i0 * q_ld + nb.n * s.h;
        const std::pair<const void*, const int64_t*> next[] = {
            {in.q, in.q_offs}, {saved.dout, saved.dout_offs}, {saved.o, saved.o_offs}};
        for (const auto& [base, offs] : next)
          prefetch_rows(bytes(base, offs[nb.item] + nat, es), nb.rows, s.h * es, q_ld * es);
      } else if (it + 1 < p.groups.items()) {  // the next item's k and v
        const Block nb = p.block(it + 1, p.groups.first(it + 1), s.kv_heads);
        prefetch_rows(bytes(in.k, in.k_offs[nb.item] + nb.kvh * s.h, es), s.s, s.h * es, kv_ld * es);
        prefetch_rows(bytes(in.v, in.v_offs[nb.item] + nb.kvh * s.h, es), s.s, s.h * es, kv_ld * es);
      }
      char* dq_out = static_cast<char*>(dq) + (b.item * s.t * q_ld + at) * es;
      prefetch_rows_for_write(dq_out, b.rows, s.h * es, q_ld * es);
      const float* stat = saved.stats + saved.stats_offs[b.item] + (b.n * s.t + b.i0) * 2;
      for (int64_t r = 0; r < b.rows; ++r) m[r] = stat[2 * r], inv_l[r] = 1.0f / stat[2 * r + 1];
      row_dots(gp, op, q_ld, b.rows, s.h, s.dt, d, p.isa);
      std::fill(acc, acc + b.rows * s.h, 0.0f);

      const int64_t end = p.keys_end(b.qb);
      for (int64_t c0 = 0; c0 < end; c0 += p.bn) {
        const int64_t width = std::min(p.bn, end - c0);
        const Brgemm& qk = p.qk(b.last, width);
        emulation::multiply(qk, tm, qa, p.q_step, kt + c0 * b_cols * ks, p.kt_step, st);
        emulation::multiply(qk, tm, ga, p.q_step, vt + c0 * b_cols * ks, p.kt_step, dpt);
        float* db = dbias ? dbias + ((b.item * s.heads + b.n) * s.t + b.i0) * s.s + c0 : nullptr;
        softmax_backward(score_tile(s, in, p, b, st, c0, width), dpt, p.bn, m, inv_l, d, db, s.s, p.isa);
        // dQ += dS K, dK^T += Q^T dS, dV^T += dO^T P: fp32 tiles are the operands as they
        // are; bf16 ones are rounded (or split), and packed in VNNI pairs of rows where they
        // are B.
        const void *ds_a = dpt, *ds_b = dpt, *p_b = st;
        if (tm.split) {
          const int64_t bcols = p.vnni ? width : p.bn;  // the B tiles' row length
          emulation::pack(tm, 0, dpt, DType::f32, p.bn, false, b.rows, width, b.rows, p.bn, p.kd, false, w + p.dsa,
                          p.pa_step, p.isa, tmp);
          emulation::pack(tm, 1, dpt, DType::f32, p.bn, false, b.rows, width, rp, bcols, p.kd, p.vnni, w + p.dsv,
                          p.pb_step, p.isa, tmp);
          emulation::pack(tm, 1, st, DType::f32, p.bn, false, b.rows, width, rp, bcols, p.kd, p.vnni, w + p.pvn,
                          p.pb_step, p.isa, tmp);
          ds_a = w + p.dsa, ds_b = w + p.dsv, p_b = w + p.pvn;
        } else if (p.vnni) {
          auto* dsa = reinterpret_cast<uint16_t*>(w + p.dsa);
          store_rows(dpt, p.bn, nullptr, b.rows, width, dsa, p.bn, DType::bf16, p.isa);
          reblock::pack(dpt, DType::f32, p.bn, false, b.rows, width, rp, width, DType::bf16, true, w + p.dsv, p.isa);
          reblock::pack(st, DType::f32, p.bn, false, b.rows, width, rp, width, DType::bf16, true, w + p.pvn, p.isa);
          ds_a = dsa, ds_b = w + p.dsv, p_b = w + p.pvn;
        }
        emulation::multiply(p.pv(b.last, width), tm, ds_a, p.pa_step, kb + c0 * s.h * ks, p.kv_step, acc);
        const Brgemm& kv = p.kv(b.last, width);
        emulation::multiply(kv, tm, q_t, p.qt_step, ds_b, p.pb_step, dkt + c0);
        emulation::multiply(kv, tm, do_t, p.qt_step, p_b, p.pb_step, dvt + c0);
      }
      store_rows(acc, s.h, nullptr, b.rows, s.h, dq_out, q_ld, s.dt, p.isa);
    }
    if (!p.split) write_kv(p.groups.panel(it), dkt, dvt, 1, w + p.kv_out);
  });

  if (p.split)  // each panel's parts, summed in item order
    job.add(panels, [=](int64_t panel) {
      const PanelPool::Lease lease(*leases);
      auto* part = reinterpret_cast<float*>(buf[1] + size_t(panel * per_panel) * p.part_bytes);
      write_kv(panel, part, part + half / sizeof(float), per_panel, lease.data + pp->kv_out);
    });
  return job;
}

void backward(const Executor& ex, const Dispatch& dp, const Shape& s, const Inputs& in,
              const Saved& saved, void* dq, void* dk, void* dv, float* dbias, const Blocks* force) {
  run(ex, backward_job(ex.num_threads, dp, s, in, saved, dq, dk, dv, dbias, force));
}

}  // namespace jb::attention
