// The fully-connected layer's forward and backward by data (and act_grad between them): a
// work item re-blocks one weight panel (a K-block of w, or a C-block of w^T) into L2 and
// computes the output blocks of its group of N-blocks with it, one BRGEMM call each,
// batch-reducing over the blocks of the reduced dimension, epilogue (bias, activation) fused
// (panel.h). Each pass is built as a Job (parallel/job.h): the plan and a leased scratch
// buffer, then phases that only loop and call kernels.
#include <algorithm>

#include "layers/common/eltwise.h"
#include "layers/common/plan_cache.h"
#include "layers/fc/panel.h"

namespace jb::fc {

namespace {

// Forward (N x K output, reducing C) and backward (N x C output, reducing K) block alike.
// The rules' thresholds were experimentally selected on an Intel Xeon (docs/fc.md).
Blocking activation_blocking(const Shape& s, int64_t out_cols, int64_t reduced, int64_t threads,
                             const Dispatch& dp) {
  const DType mul_dt = multiply_dtype(operand_dtype(s), dp);
  // a panel column's bytes: every part of it when emulated
  const int64_t col_bytes = reduced * int64_t(dtype_size(mul_dt)) * emulation::terms(s.products).parts[1];
  Blocking b;
  // AMX tiles: panels of two macro tiles' columns, whose B rows (two 64-byte tile rows each)
  // stream with half the stride (bf16 N = 2048, C = K = 4096 on a model-167 Xeon: forward
  // and step ~1.1x, five alternating pairs).
  b.cols = std::min(out_cols, mul_dt == DType::bf16 && dp.isa == Isa::amx ? kCols / 2 : kCols);
  // Too few rows to split: narrower panels, so that every thread still gets several items.
  if (s.n <= kRowQuantum && ceil_div(out_cols, b.cols) < kItemsPerThread * threads)
    b.cols = std::min(out_cols, kCols / 2);
  // Every N-block of an item streams the item's whole panel (reduced x cols), so a long
  // reduction takes narrower panels, at most kPanelBytes.
  while (b.cols > 32 && b.cols * col_bytes > kPanelBytes) b.cols /= 2;
  b.rows = split_rows(s.n, ceil_div(out_cols, b.cols), threads);
  b.red = reduction_block(reduced, mul_dt == DType::bf16);
  // An item per panel streams all of the activations from memory, once per panel. When they
  // are large and there are many panels, the N-blocks take turns instead (see
  // Blocking::weights_first), against panels of at most kPanelBytes / 4, so that a panel
  // and an N-block's rows of x share L2. Not with few panels or few N-blocks per thread (the
  // last round leaves a thread idle), nor with AMX bf16 multiplies, where it did not pay.
  int64_t wf_cols = b.cols;
  while (wf_cols > 32 && wf_cols * col_bytes > kPanelBytes / 4) wf_cols /= 2;
  b.weights_first = mul_dt == DType::f32 && ceil_div(out_cols, wf_cols) >= 16 &&
                    ceil_div(s.n, b.rows) >= 2 * kItemsPerThread * threads &&
                    s.n * reduced * int64_t(dtype_size(mul_dt)) > kLargeBytes;
  if (b.weights_first) b.cols = wf_cols;
  return b;
}

PlanCache<15, PanelPlan> forward_plans, backward_plans;

}  // namespace

Saved saved_for(Activation act) {
  switch (act) {
    case Activation::none: return Saved::none;
    case Activation::gelu: return Saved::preactivation;
    default: return Saved::output;
  }
}

Blocking forward_blocking(const Shape& s, int64_t threads, const Dispatch& dp) {
  return activation_blocking(s, s.k, s.c, threads, dp);
}

Blocking backward_blocking(const Shape& s, int64_t threads, const Dispatch& dp) {
  return activation_blocking(s, s.c, s.k, threads, dp);
}

// ---------------------------------------------------------------------------------------
// Forward: y[n, k] = act(sum_c x[n, c] w[c, k] + b[k]).
// Work items: a K-block of the weights (the paper's [Kb][Cb][bc][bk] panel, VNNI pairs for
// bf16, cast on the way) re-blocked into L2 by the item itself, then every (N-block,
// K-block) output tile of its group of N-blocks: one BRGEMM over the C-blocks each, bias and
// activation in the epilogue. x is the A operand. Re-blocking inside the item keeps the
// panel in cache for its reuse across the N-blocks instead of a separate pass through
// memory.

Job forward_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* w, DType w_dt,
                const float* bias, void* y, void* z, const Blocking* force) {
  Job job;
  job.name = "fc_fwd";
  if (s.n <= 0 || s.k <= 0) return job;
  const bool gelu = s.act == Activation::gelu;
  const auto plan = forward_plans.get(key_of(s, bias != nullptr, threads, dp, force), [&] {
    return PanelPlan(dp, s, force ? *force : forward_blocking(s, threads, dp), s.k, s.c, s.c, bias != nullptr,
                     gelu ? Activation::none : s.act, threads, s.dt);
  });
  const PanelPlan* p = plan.get();
  job.keep.push_back(plan);
  job.flops = 2.0 * double(s.n) * double(s.c) * double(s.k);
  const size_t es = dtype_size(s.dt);
  char* out = static_cast<char*>(gelu ? z : y);
  p->add(
      job, x,
      [p, w, w_dt, s](int64_t k0, int64_t cols, int64_t cb, char* dst, float* tmp) {
        emulation::pack(p->terms, 1, at(w, w_dt, cb * p->b.red * s.k + k0), w_dt, s.k, false, p->b.red, cols,
                        p->b.red, p->b.cols, p->mul_dt, p->vnni, dst, p->part_step, p->isa, tmp);
      },
      [p, s, es, out, bias, gelu, y, z](int64_t n0, int64_t rows, int64_t k0, int64_t cols, auto&& multiply) {
        multiply(out + (n0 * s.k + k0) * es, bias ? bias + k0 : nullptr);
        if (gelu)  // the tile is still in L1: y = gelu(z) costs no memory traffic
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t off = (n0 + r) * s.k + k0;
            eltwise::activate(Activation::gelu, s.dt, at(z, s.dt, off), static_cast<char*>(y) + off * es, cols,
                              p->isa);
          }
      });
  return job;
}

void forward(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* w,
             DType w_dt, const float* bias, void* y, void* z, const Blocking* force) {
  run(ex, forward_job(ex.num_threads, dp, s, x, w, w_dt, bias, y, z, force));
}

// ---------------------------------------------------------------------------------------
// dz = dy * act'(saved): element-wise, in chunks.

Job act_grad_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* dy, const void* saved,
                 void* dz) {
  Job job;
  job.name = "fc_act_grad";
  const int64_t total = s.n * s.k;
  if (total <= 0) return job;
  const int64_t chunk = std::max<int64_t>(4096, ceil_div(total, 8 * threads));
  const int64_t es = int64_t(dtype_size(s.dt));
  job.flops = double(3 * total * es);  // bytes moved: it is memory-bound
  const Isa isa = dp.isa;
  job.add(ceil_div(total, chunk), [=](int64_t i) {
    const int64_t a = i * chunk, count = std::min(chunk, total - a);
    eltwise::act_grad(s.act, s.dt, at(dy, s.dt, a), saved ? at(saved, s.dt, a) : nullptr,
                      static_cast<char*>(dz) + a * es, count, isa);
  });
  return job;
}

void act_grad(const Executor& ex, const Dispatch& dp, const Shape& s, const void* dy,
              const void* saved, void* dz) {
  run(ex, act_grad_job(ex.num_threads, dp, s, dy, saved, dz));
}

// ---------------------------------------------------------------------------------------
// Backward by data: dx[n, c] = sum_k dz[n, k] w[c, k].
// The forward's skeleton with the roles of C and K swapped: an item re-blocks a C-block of
// w transposed ([Cb][Kb][bk][bc], VNNI pairs of k) and computes the (N-block, C-block) tiles
// of dx of its group, batch-reducing over the K-blocks. dz is the A operand.

Job backward_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* dz, const void* w, DType w_dt,
                 void* dx, const Blocking* force) {
  Job job;
  job.name = "fc_bwd";
  if (s.n <= 0 || s.c <= 0) return job;
  const auto plan = backward_plans.get(key_of(s, 0, threads, dp, force), [&] {
    return PanelPlan(dp, s, force ? *force : backward_blocking(s, threads, dp), s.c, s.k, s.ldz ? s.ldz : s.k,
                     false, Activation::none, threads, s.dt);
  });
  const PanelPlan* p = plan.get();
  job.keep.push_back(plan);
  job.flops = 2.0 * double(s.n) * double(s.c) * double(s.k);
  const size_t es = dtype_size(s.dt);
  p->add(
      job, dz,
      [p, w, w_dt, s](int64_t c0, int64_t cols, int64_t kb, char* dst, float* tmp) {
        emulation::pack(p->terms, 1, at(w, w_dt, c0 * s.k + kb * p->b.red), w_dt, s.k, true, p->b.red, cols,
                        p->b.red, p->b.cols, p->mul_dt, p->vnni, dst, p->part_step, p->isa, tmp);
      },
      [s, es, dx](int64_t n0, int64_t, int64_t c0, int64_t, auto&& multiply) {
        multiply(static_cast<char*>(dx) + (n0 * s.c + c0) * es, nullptr);
      });
  return job;
}

void backward(const Executor& ex, const Dispatch& dp, const Shape& s, const void* dz, const void* w,
              DType w_dt, void* dx, const Blocking* force) {
  run(ex, backward_job(ex.num_threads, dp, s, dz, w, w_dt, dx, force));
}

}  // namespace jb::fc
