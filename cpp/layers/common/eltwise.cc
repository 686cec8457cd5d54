// One templated loop per operation, instantiated twice: for the baseline ISA and, through a
// function-level target attribute, for AVX-512 (taken when the kernels use avx512 or amx).
// The loops are branch-free so the compiler vectorizes them for either target.
#include "layers/common/eltwise.h"

#include <type_traits>

#include "brgemm/activation.h"

namespace jb::eltwise {

namespace {

// d/dz of the tanh-approximated gelu.
inline float gelu_grad(float z) {
  const float c = 0.7978845608028654f, a = 0.044715f;
  const float t = tanh_f(c * (z + a * z * z * z));
  return 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * c * (1.0f + 3.0f * a * z * z);
}

#define JB_INLINE __attribute__((always_inline)) inline

template <class T>
JB_INLINE void activate_loop(Activation act, const T* z, T* y, int64_t n) {
  switch (act) {
    case Activation::none:
      for (int64_t i = 0; i < n; ++i) y[i] = z[i];
      break;
    case Activation::relu:
      for (int64_t i = 0; i < n; ++i) y[i] = from_f32<T>(relu_f(to_f32(z[i])));
      break;
    case Activation::gelu:
      for (int64_t i = 0; i < n; ++i) y[i] = from_f32<T>(gelu_f(to_f32(z[i])));
      break;
    case Activation::sigmoid:
      for (int64_t i = 0; i < n; ++i) y[i] = from_f32<T>(sigmoid_f(to_f32(z[i])));
      break;
    case Activation::tanh:
      for (int64_t i = 0; i < n; ++i) y[i] = from_f32<T>(tanh_f(to_f32(z[i])));
      break;
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

template <class T>
void activate_base(Activation act, const void* z, void* y, int64_t n) {
  activate_loop(act, static_cast<const T*>(z), static_cast<T*>(y), n);
}
template <class T>
void grad_base(Activation act, const void* dy, const void* s, void* dz, int64_t n) {
  grad_loop(act, static_cast<const T*>(dy), static_cast<const T*>(s), static_cast<T*>(dz), n);
}

#if defined(JB_X86)
#define JB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
template <class T>
JB_AVX512 void activate_avx512(Activation act, const void* z, void* y, int64_t n) {
  activate_loop(act, static_cast<const T*>(z), static_cast<T*>(y), n);
}
template <class T>
JB_AVX512 void grad_avx512(Activation act, const void* dy, const void* s, void* dz, int64_t n) {
  grad_loop(act, static_cast<const T*>(dy), static_cast<const T*>(s), static_cast<T*>(dz), n);
}
#endif


}  // namespace

void activate(Activation act, DType dt, const void* z, void* y, int64_t n, Isa isa) {
#if defined(JB_X86)
  if (isa >= Isa::avx512) {
    dt == DType::f32 ? activate_avx512<float>(act, z, y, n) : activate_avx512<uint16_t>(act, z, y, n);
    return;
  }
#endif
  dt == DType::f32 ? activate_base<float>(act, z, y, n) : activate_base<uint16_t>(act, z, y, n);
}

void act_grad(Activation act, DType dt, const void* dy, const void* saved, void* dz, int64_t n,
              Isa isa) {
#if defined(JB_X86)
  if (isa >= Isa::avx512) {
    dt == DType::f32 ? grad_avx512<float>(act, dy, saved, dz, n)
                     : grad_avx512<uint16_t>(act, dy, saved, dz, n);
    return;
  }
#endif
  dt == DType::f32 ? grad_base<float>(act, dy, saved, dz, n)
                   : grad_base<uint16_t>(act, dy, saved, dz, n);
}

}  // namespace jb::eltwise
