// The convolution's forward and backward by data: the direct skeleton (direct.h) with bias
// and activation in the forward's epilogue, and the dual convolution for dx.
#include <string>

#include "layers/common/eltwise.h"
#include "layers/common/plan_cache.h"
#include "layers/conv/depthwise.h"
#include "layers/conv/direct.h"
#include "layers/conv/narrow.h"

namespace jb::conv {

namespace {

Dims forward_dims(const Shape& s, bool bias, Activation act) {
  Dims d;
  const bool pw = pointwise(s);
  d.n = pw ? 1 : s.n;
  d.ci = s.cg();
  d.co = s.kg();
  d.groups = s.groups;
  d.h = Axis{pw ? 1 : s.h, pw ? 1 : s.p(), s.r, s.sh, s.pt, false, 0, pw ? 1 : s.h};
  d.w = Axis{pw ? s.n * s.h * s.w : s.w, pw ? s.n * s.h * s.w : s.q(), s.s, s.sw, s.pl, false, 0, 0};
  d.h.dil = s.dil_h, d.w.dil = s.dil_w;
  d.dt = s.dt;
  d.out_dt = s.dt;
  d.bias = bias;
  d.act = act;
  d.products = s.products;
  return d;
}

Dims backward_dims(const Shape& s) {
  Dims d;
  const bool pw = pointwise(s);
  d.n = pw ? 1 : s.n;
  d.ci = s.kg();
  d.co = s.cg();
  d.groups = s.groups;
  d.h = Axis{pw ? 1 : s.p(), pw ? 1 : s.h, s.r, s.sh, s.pt, true, 0, pw ? 1 : s.p()};
  d.w = Axis{pw ? s.n * s.h * s.w : s.q(), pw ? s.n * s.h * s.w : s.w, s.s, s.sw, s.pl, true, 0, 0};
  d.h.dil = s.dil_h, d.w.dil = s.dil_w;
  d.dt = s.dt;
  d.out_dt = s.dt;
  d.bias = false;
  d.act = Activation::none;
  d.products = s.products;
  return d;
}

PlanCache<26, DirectPlan> forward_plans, backward_plans;

}  // namespace

void validate(const Shape& s) {
  auto bad = [](const std::string& what) { throw std::invalid_argument("conv: " + what); };
  if (s.n < 0) bad("negative batch size");
  if (s.h < 1 || s.w < 1 || s.c < 1 || s.k < 1 || s.r < 1 || s.s < 1)
    bad("sizes must be >= 1 (H, W, C, K, R, S)");
  if (s.sh < 1 || s.sw < 1) bad("strides must be >= 1");
  if (s.dil_h < 1 || s.dil_w < 1) bad("kernel dilations must be >= 1");
  if (s.groups < 1 || s.c % s.groups || s.k % s.groups)
    bad("feature groups must be >= 1 and divide the input and output channels");
  if (s.pt < 0 || s.pb < 0 || s.pl < 0 || s.pr < 0) bad("paddings must be >= 0");
  if (s.products && s.dt != DType::f32) bad("emulated products take float32 operands");
  emulation::terms(s.products);  // throws for a count other than 0, 1, 3 or 6
  if (s.h + s.pt + s.pb < s.er() || s.w + s.pl + s.pr < s.es())
    bad("the (dilated) filter is larger than the padded input");
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

double flops(const Shape& s) {
  return 2.0 * double(s.n) * double(s.p()) * double(s.q()) * double(s.k) * double(s.r * s.s) * double(s.cg());
}

Job forward_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* w, DType w_dt,
                const float* bias, void* y, void* z, const Blocking* force) {
  validate(s);
  Job job;
  job.name = "conv_fwd";
  if (s.products && w_dt != DType::f32) throw std::invalid_argument("conv: emulated products take float32 weights");
  if (s.n == 0) return job;
  job.flops = flops(s);
  // emulated products take the direct skeleton only
  if (depthwise(s) && !s.products) {
    depthwise_forward(job, threads, dp, s, x, w, w_dt, bias, y, z);
    return job;
  }
  if (!force && !s.products && narrow_forward_fits(s, dp)) {
    narrow_forward(job, threads, dp, s, x, w, w_dt, bias, y, z);
    return job;
  }
  const bool gelu = s.act == Activation::gelu;
  const auto plan = forward_plans.get(key_of(s, bias != nullptr, threads, dp, force), [&] {
    return DirectPlan(forward_dims(s, bias != nullptr, gelu ? Activation::none : s.act), dp, force, threads);
  });
  const DirectPlan* p = plan.get();
  job.keep.push_back(plan);
  const size_t es = dtype_size(s.dt);
  char* out = static_cast<char*>(gelu ? z : y);
  p->add(
      job, x, s.dt,
      [p, s, w, w_dt](int64_t g, int64_t k0, int64_t cols, int64_t cb, int64_t r, int64_t t, char* dst, float* tmp) {
        p->pack_block(at(w, w_dt, (r * s.s + t) * s.cg() * s.k + g * s.kg() + k0), w_dt, s.k, false, cb, cols, dst, tmp);
      },
      [p, s, es, out, bias, gelu, y, z](int64_t off, int64_t pixels, int64_t cols, auto&& multiply) {
        multiply(out + off * es, bias ? bias + off % s.k : nullptr);
        if (gelu)  // the tile is still in L1: y = gelu(z) costs no memory traffic
          for (int64_t i = 0; i < pixels; ++i)
            eltwise::activate(Activation::gelu, s.dt, at(z, s.dt, off + i * s.k),
                              static_cast<char*>(y) + (off + i * s.k) * es, cols, p->isa);
      });
  return job;
}

void forward(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* w,
             DType w_dt, const float* bias, void* y, void* z, const Blocking* force) {
  run(ex, forward_job(ex.num_threads, dp, s, x, w, w_dt, bias, y, z, force));
}

// ---------------------------------------------------------------------------------------
// Backward by data: the dual convolution. dz is the A operand (consecutive dz pixels of
// one stride phase: lda = K), the transposed weight block ([Cb][Kb][R][S][bk][bc], VNNI
// pairs of k) the B operand, and the dx pixels of the phase (ldc = stride_w * C) the
// accumulator. Output pixels that no tap reaches (strides larger than the filter) get a
// batch of zero elements: zeros.

Job backward_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* dz, const void* w, DType w_dt,
                 void* dx, const Blocking* force) {
  validate(s);
  Job job;
  job.name = "conv_bwd";
  if (s.products && w_dt != DType::f32) throw std::invalid_argument("conv: emulated products take float32 weights");
  if (s.n == 0) return job;
  job.flops = flops(s);
  if (depthwise(s) && !s.products) {
    depthwise_backward(job, threads, dp, s, dz, w, w_dt, dx);
    return job;
  }
  if (!force && !s.products && narrow_backward_fits(s, dp)) {
    narrow_backward(job, threads, dp, s, dz, w, w_dt, dx);
    return job;
  }
  const auto plan = backward_plans.get(key_of(s, 0, threads, dp, force), [&] {
    return DirectPlan(backward_dims(s), dp, force, threads);
  });
  const DirectPlan* p = plan.get();
  job.keep.push_back(plan);
  const size_t es = dtype_size(s.dt);
  p->add(
      job, dz, s.dt,
      [p, s, w, w_dt](int64_t g, int64_t c0, int64_t cols, int64_t kb, int64_t r, int64_t t, char* dst, float* tmp) {
        p->pack_block(at(w, w_dt, ((r * s.s + t) * s.cg() + c0) * s.k + g * s.kg()), w_dt, s.k, true, kb, cols, dst, tmp);
      },
      [dx, es](int64_t off, int64_t, int64_t, auto&& multiply) {
        multiply(static_cast<char*>(dx) + off * es, nullptr);
      });
  return job;
}

void backward(const Executor& ex, const Dispatch& dp, const Shape& s, const void* dz, const void* w,
              DType w_dt, void* dx, const Blocking* force) {
  run(ex, backward_job(ex.num_threads, dp, s, dz, w, w_dt, dx, force));
}

}  // namespace jb::conv
