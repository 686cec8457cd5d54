// The fully-connected layer (paper, Algorithm 5): all three training passes as loops around
// the batch-reduce GEMM kernel, nothing else.
//
//   forward   y  = act(x @ w + b)              x: N x C, w: C x K, b: K, y: N x K
//   act_grad  dz = dy * act'(saved)            saved: y (relu, sigmoid, tanh) or z (gelu)
//   backward  dx = dz @ w^T                    dx: N x C
//   update    dw = x^T @ dz, db = sum_n dz     dw: C x K, db: K
//
// Everything is row-major in the framework's layout (activations (N, C), Flax kernels
// (C, K)); each pass re-blocks its weight-like operand inside the call into the layout its
// BRGEMM wants (weights [Kb][Cb][bc][bk], VNNI-2 pairs for bf16, casting fp32 weights to
// bf16 on the way), while activations are read in place wherever the kernel can.
//
// Work items are independent output blocks over the Executor; every output element is
// written by exactly one item, so the batch reduction of the weight update needs no
// atomics or partial sums. dtype `dt` is the compute dtype of x, y, z, dy, dz and dx;
// accumulation is always fp32, the bias and db are fp32, w and dw are fp32 or bf16.
// fp32 operands may ask for their products to be emulated from bf16 ones (Shape::products):
// each pass then multiplies the operands' bf16 parts, one batch-reduce over all of them.
#pragma once

#include <cstdint>

#include "brgemm/brgemm.h"
#include "layers/common/blocking.h"
#include "parallel/job.h"
#include "parallel/parallel_for.h"

namespace jb::fc {

struct Shape {
  int64_t n = 0, c = 0, k = 0;  // mini-batch, input features, output features
  DType dt = DType::f32;        // compute dtype
  Activation act = Activation::none;
  int64_t ldx = 0;  // update only: x's leading dimension, >= c (0: c); extra columns are ignored
  int64_t ldz = 0;  // backward and update: dz's leading dimension, >= k (0: k); likewise
  // fp32 only: every product from this many bf16 products of the operands' parts (1, 3 or
  // 6; 0: exact), split as the operands are re-blocked (layers/common/emulation.h).
  int64_t products = 0;
};

// The dtype the passes multiply in before the dispatch's choice: bf16 parts when emulated.
inline DType operand_dtype(const Shape& s) { return s.products ? DType::bf16 : s.dt; }

// What the forward leaves for the backward besides x and w: the output y when the
// derivative is a function of it (relu, sigmoid, tanh), the pre-activation z for gelu,
// nothing without an activation.
enum class Saved : uint8_t { none, output, preactivation };
Saved saved_for(Activation act);

// The heuristic: output blocks of whole register tiles (rows a multiple of 12, 128
// columns), rows split finely enough that every thread gets several items even for small
// N, and a reduction block that divides the reduced size (even for bf16 multiplies).
Blocking forward_blocking(const Shape& s, int64_t threads, const Dispatch& dp);
Blocking backward_blocking(const Shape& s, int64_t threads, const Dispatch& dp);
Blocking update_blocking(const Shape& s, int64_t threads, const Dispatch& dp);
// Whether update() computes a batch this long as the forward's pass over x^T (its operands
// re-blocked in update_blocking's blocks would outgrow the cache); a forced blocking always
// takes those blocks.
bool update_transposes(const Shape& s, int64_t threads, const Dispatch& dp);

// Every pass finds its plan (blocking, kernels, work split, scratch sizes) in a cache keyed
// by the shape, dtypes, thread count and dispatch: built on the first call, reused after.
// `force` overrides the blocking heuristic (tests use it to exercise edge blocks).
// Each pass is also a Job (parallel/job.h) for `threads` workers, which the FFI handlers run
// asynchronously; the function of the pass's name runs that job on the Executor. Same
// blocks, same kernels, same bits either way.

// y (and, for gelu, z) from x, w (w_dt) and an optional bias. z may be null otherwise.
void forward(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* w,
             DType w_dt, const float* bias, void* y, void* z, const Blocking* force = nullptr);

Job forward_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* w, DType w_dt,
                const float* bias, void* y, void* z, const Blocking* force = nullptr);

// dz = dy * act'(saved), element-wise (all in dt). Not needed without an activation.
void act_grad(const Executor& ex, const Dispatch& dp, const Shape& s, const void* dy,
              const void* saved, void* dz);
Job act_grad_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* dy, const void* saved,
                 void* dz);

// The backward passes are linear in dz (s.act is not used) and take it from act_grad's one
// pass: applying act' while they read dz made neither faster (both would recompute it).

// dx = dz @ w^T (dz's rows s.ldz apart when it is set).
void backward(const Executor& ex, const Dispatch& dp, const Shape& s, const void* dz, const void* w,
              DType w_dt, void* dx, const Blocking* force = nullptr);
Job backward_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* dz, const void* w, DType w_dt,
                 void* dx, const Blocking* force = nullptr);

// dw = x^T @ dz (written in dw_dt) and, when db is not null, db = sum over the batch of dz.
// x's rows are s.ldx apart when it is set (the first c columns of a wider matrix), dz's
// s.ldz apart.
void update(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
            void* dw, DType dw_dt, float* db, const Blocking* force = nullptr);
Job update_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* dz, void* dw,
               DType dw_dt, float* db, const Blocking* force = nullptr);

// SGD with momentum (optax's add_decayed_weights + sgd, per element, in fp32):
//   g' = g + weight_decay * w      (bias_weight_decay for the bias)
//   m' = g' + momentum * m
//   w' = w - lr * (nesterov ? g' + momentum * m' : m')
struct Sgd {
  float lr = 0, momentum = 0, weight_decay = 0;
  bool nesterov = false;
  float bias_weight_decay = 0;
};

// AdamW (optax's adamw: scale_by_adam, add_decayed_weights, scale_by_learning_rate), per
// element in fp32, in optax's order of operations; t counts steps from 1:
//   mu' = c1 * g + b1 * mu,  nu' = c2 * (g * g) + b2 * nu      (c1 = 1 - b1, c2 = 1 - b2)
//   u = (mu' * (1 / bc1)) / (sqrt(nu' * (1 / bc2) + eps_root) + eps) + weight_decay * w
//   (optax divides by bc1 and bc2; XLA computes that as a product with the reciprocal)
//   w' = w + (-lr) * u                                         (bc1 = 1 - b1^t, bc2 = 1 - b2^t)
struct AdamW {
  float lr = 0, b1 = 0, b2 = 0, c1 = 0, c2 = 0, eps = 0, eps_root = 0, weight_decay = 0;
  float bc1 = 1, bc2 = 1;
  float bias_weight_decay = 0;
};

// The weight update with the optimizer step fused: dw = x^T @ dz and db = sum of dz are
// computed as update() does, but never stored; each block of dw is applied to w and its
// state (and db to b and its state) while it is in cache. All fp32, updated in place.
// The bias and its state may be null (no bias).
void update_sgd(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
                const Sgd& o, float* w, float* mw, float* b, float* mb);
Job update_sgd_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* dz, const Sgd& o,
                   float* w, float* mw, float* b, float* mb);
void update_adamw(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
                  const AdamW& o, float* w, float* mu, float* nu, float* b, float* bmu, float* bnu);
Job update_adamw_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
                     const AdamW& o, float* w, float* mu, float* nu, float* b, float* bmu, float* bnu);

// One row piece of each rule over n elements (g the gradient of w), vectorized for isa.
void sgd_step(const Sgd& o, const float* g, float* w, float* m, int64_t n, Isa isa);
void adamw_step(const AdamW& o, const float* g, float* w, float* mu, float* nu, int64_t n, Isa isa);

}  // namespace jb::fc
