// Element-wise work of the layers outside the kernel's epilogue: an activation applied to
// a saved pre-activation, and activation derivatives for the backward passes. Vectorized
// for the ISA passed in (AVX-512 when the kernels use it, the baseline otherwise); the math is
// activation.h's, so it matches the kernel epilogues to fp32 rounding.
#pragma once

#include <cstdint>

#include "brgemm/brgemm.h"

namespace jb::eltwise {

// y[i] = act(z[i]); z and y in dtype dt (fp32 or bf16), computed in fp32.
void activate(Activation act, DType dt, const void* z, void* y, int64_t n, Isa isa);

// dz[i] = dy[i] * act'(.) from what the forward saved: the output y for relu, sigmoid and
// tanh, the pre-activation z for gelu. relu's derivative is a select (0 where y is not
// > 0, NaN included), like jax.nn.relu's. All in dtype dt, computed in fp32.
void act_grad(Activation act, DType dt, const void* dy, const void* saved, void* dz, int64_t n,
              Isa isa);

// One SGD-with-momentum step over n elements (fc::Sgd's rule, in fp32): g the gradient of
// w, m its momentum; w and m are updated in place. decay: add weight_decay * w to g first.
void sgd(const float* g, float* w, float* m, int64_t n, float lr, float momentum,
         float weight_decay, bool nesterov, Isa isa);

}  // namespace jb::eltwise
