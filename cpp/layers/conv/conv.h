// The 2-D convolution layer (paper, Algorithm 4 and its "dual convolutions"): all three
// training passes as loops around the batch-reduce GEMM kernel, nothing else.
//
//   forward   y[n,p,q,k]  = act(sum_{r,s,c} x[n, p*sh + r*dh - pt, q*sw + s*dw - pl, c] w[r,s,c,k] + b[k])
//   (dh, dw: the kernel dilation, 1 unless given; every pass below reads its taps likewise)
//   act_grad  dz = dy * act'(saved), element-wise: fc::act_grad (the FFI's jb_fc_act_grad)
//   backward  dx[n,h,w,c] = sum over (p, q, r, s) with p*sh + r - pt = h, q*sw + s - pl = w
//                           of dz[n,p,q,k] w[r,s,c,k]
//   update    dw[r,s,c,k] = sum_{n,p,q} x[n, p*sh + r - pt, q*sw + s - pl, c] dz[n,p,q,k]
//             db[k]       = sum_{n,p,q} dz[n,p,q,k]
//
// Activations stay in the framework's NHWC layout, weights in Flax's HWIO; each pass
// re-blocks its weight-like operand inside the call ([Kb][Cb][R][S][bc][bk], VNNI-2 pairs
// for bf16, cast to the multiply dtype on the way). Out-of-range taps (padding) are never
// multiplied: the batch of each BRGEMM call holds only the valid (r, s, C-block) triples.
// With feature groups, group g's outputs k in [g * k / groups, (g + 1) * k / groups) reduce over
// its inputs c in [g * c / groups, ...) only, with w[r, s, c mod (c / groups), k].
// dtype `dt` is the compute dtype of x, y, z, dy, dz and dx; accumulation is always fp32,
// the bias and db are fp32, w and dw are fp32 or bf16. With `products`, fp32 operands
// multiply as sums of their bf16 parts' products (the precision emulation, emulation.h): the
// passes split them where they copy or re-block them.
#pragma once

#include <cstdint>

#include "brgemm/brgemm.h"
#include "layers/common/blocking.h"
#include "parallel/job.h"
#include "parallel/parallel_for.h"

namespace jb::conv {

struct Shape {
  int64_t n = 0, h = 0, w = 0, c = 0;  // input: mini-batch, rows, columns, channels
  int64_t k = 0, r = 0, s = 0;         // output channels, filter rows, filter columns
  int64_t sh = 1, sw = 1;              // strides
  int64_t pt = 0, pb = 0, pl = 0, pr = 0;  // zero padding: top, bottom, left, right
  DType dt = DType::f32;               // compute dtype
  Activation act = Activation::none;
  int64_t dil_h = 1, dil_w = 1;        // kernel (rhs) dilation: tap r reads row r * dil_h
  int64_t groups = 1;                  // feature groups: c and k split in as many; w is (r, s, c / groups, k)
  int64_t products = 0;                // fp32 only: each product from 1, 3 or 6 bf16 ones; 0 exact

  int64_t cg() const { return c / groups; }  // input / output channels of one group
  int64_t kg() const { return k / groups; }
  int64_t er() const { return (r - 1) * dil_h + 1; }  // the dilated filter's extent
  int64_t es() const { return (s - 1) * dil_w + 1; }
  int64_t p() const { return (h + pt + pb - er()) / sh + 1; }  // output rows
  int64_t q() const { return (w + pl + pr - es()) / sw + 1; }  // output columns
};

// Throws std::invalid_argument unless the shape makes sense: sizes >= 1 (n >= 0), strides
// and dilations >= 1, paddings >= 0, a (dilated) filter that fits the padded input and
// groups >= 1 dividing c and k.
void validate(const Shape& s);

// What the forward leaves for the backward besides x and w (as fc::Saved).
enum class Saved : uint8_t { none, output, preactivation };
Saved saved_for(Activation act);

// Every pass finds its plan (blocking, tap tables, kernels, work split, scratch sizes) in a
// cache keyed by the shape, dtypes, thread count and dispatch. `force` overrides the
// blocking heuristic (tests use it to exercise edge blocks): forward / backward take
// rows = output pixels per block, cols = output channels per block, red = reduced
// channels per batch element (must divide them); update takes rows = input channels and
// cols = output channels per block of dw.

// Each pass is also a Job (parallel/job.h) for `threads` workers, which the FFI handlers
// run asynchronously: same blocks, same bits. Its operands must outlive the job.
Job forward_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* w, DType w_dt,
                const float* bias, void* y, void* z, const Blocking* force = nullptr);
Job backward_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* dz, const void* w, DType w_dt,
                 void* dx, const Blocking* force = nullptr);
Job update_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* dz, void* dw,
               DType dw_dt, float* db, const Blocking* force = nullptr);

// y (and, for gelu, z) from x, w (w_dt) and an optional bias. z may be null otherwise.
void forward(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* w,
             DType w_dt, const float* bias, void* y, void* z, const Blocking* force = nullptr);

// dx from dz and w: the dual convolution.
void backward(const Executor& ex, const Dispatch& dp, const Shape& s, const void* dz, const void* w,
              DType w_dt, void* dx, const Blocking* force = nullptr);

// dw (written in dw_dt) and, when db is not null, db.
void update(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
            void* dw, DType dw_dt, float* db, const Blocking* force = nullptr);

}  // namespace jb::conv
