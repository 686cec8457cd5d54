// The optimizer rules the fused weight updates apply (fc.h's Sgd and AdamW), one row piece
// at a time, compiled for each ISA's vector width (layers/common/target.h). Built with
// -fno-math-errno (CMakeLists.txt): a sqrt that may set errno keeps the loop scalar.
#include <cmath>

#include "layers/common/eltwise.h"
#include "layers/common/target.h"
#include "layers/fc/fc.h"

namespace jb::fc {

namespace {

// optax's scale_by_adam + add_decayed_weights + scale_by_learning_rate + apply_updates,
// operation by operation (fc.h).
template <bool kDecay>
struct AdamWLoop {
  static JB_INLINE void run(const AdamW* o, const float* __restrict g, float* __restrict w, float* __restrict mu,
                            float* __restrict nu, int64_t n, float weight_decay) {
    const float b1 = o->b1, b2 = o->b2, c1 = o->c1, c2 = o->c2, bc1 = o->bc1, bc2 = o->bc2;
    const float eps = o->eps, eps_root = o->eps_root, step = -o->lr;
    // XLA computes optax's division by the bias corrections (scalars) as a product with their
    // reciprocals: so does this loop (two divisions less per element, and XLA's bits).
    const float r1 = 1.0f / bc1, r2 = 1.0f / bc2;
    for (int64_t i = 0; i < n; ++i) {
      const float gi = g[i];
      const float m = c1 * gi + b1 * mu[i];
      const float v = c2 * (gi * gi) + b2 * nu[i];
      mu[i] = m;
      nu[i] = v;
      float u = (m * r1) / (std::sqrt(v * r2 + eps_root) + eps);
      if (kDecay) u = u + weight_decay * w[i];
      w[i] = w[i] + step * u;
    }
  }
};

}  // namespace

void sgd_step(const Sgd& o, const float* g, float* w, float* m, int64_t n, Isa isa) {
  eltwise::sgd(g, w, m, n, o.lr, o.momentum, o.weight_decay, o.nesterov, isa);
}

void adamw_step(const AdamW& o, const float* g, float* w, float* mu, float* nu, int64_t n, Isa isa) {
  if (o.weight_decay != 0.0f)
    target::variant<AdamWLoop<true>>(isa)(&o, g, w, mu, nu, n, o.weight_decay);
  else
    target::variant<AdamWLoop<false>>(isa)(&o, g, w, mu, nu, n, 0.0f);
}

}  // namespace jb::fc
