// One templated loop per operation, instantiated for the baseline ISA, AVX2 and AVX-512
// (layers/common/target.h) and taken by the kernel ISA in use. The loops are branch-free
// so the compiler vectorizes them for every target.
#include "layers/common/eltwise.h"

#include <type_traits>

#include "brgemm/activation.h"
#include "layers/common/target.h"

namespace jb::eltwise {

namespace {

// d/dz of the tanh-approximated gelu. 1 + tanh(u) and 1 - tanh(u)^2 from e = exp(-2|u|), as
// 2 / (1 + e) (or 2e / (1 + e) for u < 0) and 4e / (1 + e)^2: no cancellation where tanh is
// near -1, so the small derivative of a very negative z keeps fp32's relative accuracy.
inline float gelu_grad(float z) {
  const float c = 0.7978845608028654f, a = 0.044715f;
  const float u = c * (z + a * z * z * z);
  const float e = exp_approx(-2.0f * (u < 0 ? -u : u));
  const float inv = 1.0f / (1.0f + e);
  const float one_plus_t = 2.0f * inv * (u < 0 ? e : 1.0f);
  return 0.5f * one_plus_t + 0.5f * z * (4.0f * e * inv * inv) * c * (1.0f + 3.0f * a * z * z);
}

// y[i] = f(z[i]), computed in fp32 and stored as T.
template <class T, class F>
JB_INLINE void map_loop(const T* z, T* y, int64_t n, F f) {
  for (int64_t i = 0; i < n; ++i) y[i] = from_f32<T>(f(to_f32(z[i])));
}

template <class T>
JB_INLINE void activate_loop(Activation act, const T* z, T* y, int64_t n) {
  switch (act) {
    case Activation::none:
      for (int64_t i = 0; i < n; ++i) y[i] = z[i];
      break;
    case Activation::relu: map_loop(z, y, n, relu_f); break;
    case Activation::gelu: map_loop(z, y, n, gelu_f); break;
    case Activation::sigmoid: map_loop(z, y, n, sigmoid_f); break;
    case Activation::tanh: map_loop(z, y, n, tanh_f); break;
  }
}

template <class T>
JB_INLINE void grad_loop(Activation act, const T* dy, const T* s, T* dz, int64_t n) {
  switch (act) {
    case Activation::none:
      for (int64_t i = 0; i < n; ++i) dz[i] = dy[i];
      break;
    case Activation::relu:
      for (int64_t i = 0; i < n; ++i) dz[i] = to_f32(s[i]) > 0.0f ? dy[i] : from_f32<T>(0.0f);
      break;
    case Activation::gelu:
      for (int64_t i = 0; i < n; ++i) dz[i] = from_f32<T>(to_f32(dy[i]) * gelu_grad(to_f32(s[i])));
      break;
    case Activation::sigmoid:
      for (int64_t i = 0; i < n; ++i) {
        const float y = to_f32(s[i]);
        dz[i] = from_f32<T>(to_f32(dy[i]) * (y * (1.0f - y)));
      }
      break;
    case Activation::tanh:
      for (int64_t i = 0; i < n; ++i) {
        const float y = to_f32(s[i]);
        dz[i] = from_f32<T>(to_f32(dy[i]) * ((1.0f + y) * (1.0f - y)));
      }
      break;
  }
}

template <bool kNesterov, bool kDecay>
inline void sgd_loop(const float* __restrict g, float* __restrict w, float* __restrict m, int64_t n,
                     float lr, float momentum, float weight_decay) {
  const float step = -lr;
  for (int64_t i = 0; i < n; ++i) {
    const float gi = kDecay ? g[i] + weight_decay * w[i] : g[i];
    const float mi = gi + momentum * m[i];
    m[i] = mi;
    w[i] = w[i] + step * (kNesterov ? gi + momentum * mi : mi);
  }
}

template <class F>
inline void sgd_variant(bool nesterov, bool decay, F&& f) {
  if (nesterov) decay ? f(std::true_type{}, std::true_type{}) : f(std::true_type{}, std::false_type{});
  else decay ? f(std::false_type{}, std::true_type{}) : f(std::false_type{}, std::false_type{});
}

// The three operations as target::Variants loops (the sgd step's loop inlines as well).
template <class T>
struct Activate {
  static JB_INLINE void run(Activation act, const void* z, void* y, int64_t n) {
    activate_loop(act, static_cast<const T*>(z), static_cast<T*>(y), n);
  }
};
template <class T>
struct Grad {
  static JB_INLINE void run(Activation act, const void* dy, const void* s, void* dz, int64_t n) {
    grad_loop(act, static_cast<const T*>(dy), static_cast<const T*>(s), static_cast<T*>(dz), n);
  }
};
template <bool kNesterov, bool kDecay>
struct SgdStep {
  static JB_INLINE void run(const float* g, float* w, float* m, int64_t n, float lr, float momentum,
                            float weight_decay) {
    sgd_loop<kNesterov, kDecay>(g, w, m, n, lr, momentum, weight_decay);
  }
};

}  // namespace

void sgd(const float* g, float* w, float* m, int64_t n, float lr, float momentum,
         float weight_decay, bool nesterov, Isa isa) {
  sgd_variant(nesterov, weight_decay != 0.0f, [&](auto nest, auto decay) {
    target::variant<SgdStep<nest(), decay()>>(isa)(g, w, m, n, lr, momentum, weight_decay);
  });
}

void activate(Activation act, DType dt, const void* z, void* y, int64_t n, Isa isa) {
  const auto run = dt == DType::f32 ? target::variant<Activate<float>>(isa) : target::variant<Activate<uint16_t>>(isa);
  run(act, z, y, n);
}

void act_grad(Activation act, DType dt, const void* dy, const void* saved, void* dz, int64_t n,
              Isa isa) {
  const auto run = dt == DType::f32 ? target::variant<Grad<float>>(isa) : target::variant<Grad<uint16_t>>(isa);
  run(act, dy, saved, dz, n);
}

}  // namespace jb::eltwise
