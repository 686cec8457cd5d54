// Element-wise activations for the fused epilogues, written branch-free so the compiler
// vectorizes them for whichever ISA unit includes this header (internal linkage, see
// tile.h). They match jax.nn's definitions to fp32 rounding; NaN propagates.
#pragma once

#include <cstdint>
#include <cstring>

#include "brgemm/brgemm.h"

namespace jb {
namespace {

// exp(x) by range reduction x = n ln2 + r and a degree-6 polynomial for e^r
// (relative error ~1 ulp). 2^n is built with integer arithmetic on the bit pattern of a
// float, so NaN and out-of-range inputs involve no undefined float->int conversion.
inline float exp_approx(float x) {
  x = x < -87.3f ? -87.3f : x;  // NaN compares false on both and passes through
  x = x > 88.7f ? 88.7f : x;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = x * 1.44269504088896341f + shifter;
  const float n = t - shifter;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  uint32_t bits;
  std::memcpy(&bits, &t, 4);
  // The integer n sits in t's low mantissa bits; shift it into the exponent field. Split
  // in two factors so 2^n stays a normal float over the whole clamped range.
  // Unsigned arithmetic: a NaN's bit pattern must not overflow a signed shift.
  const int32_t n_int = int32_t(bits - 0x4B400000u);  // n in [-126, 128]
  const uint32_t e1 = (uint32_t(n_int >> 1) + 127u) << 23;
  const uint32_t e2 = (uint32_t(n_int - (n_int >> 1)) + 127u) << 23;
  float s1, s2;
  std::memcpy(&s1, &e1, 4);
  std::memcpy(&s2, &e2, 4);
  return p * s1 * s2;
}

inline float sigmoid_f(float x) { return 1.0f / (1.0f + exp_approx(-x)); }

// tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|): no cancellation for large |x|;
// for tiny |x| the odd polynomial keeps full relative accuracy.
inline float tanh_f(float x) {
  const float ax = x < 0 ? -x : x;
  const float e = exp_approx(-2.0f * ax);
  float big = (1.0f - e) / (1.0f + e);
  big = x < 0 ? -big : big;
  const float x2 = x * x;
  const float small = x * (1.0f + x2 * (-0.333333333f + x2 * (0.133333333f - x2 * 0.053968254f)));
  return ax < 0.0625f ? small : big;
}

// flax.linen.gelu / jax.nn.gelu default: the tanh approximation.
inline float gelu_f(float x) {
  const float k = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * x * (1.0f + tanh_f(k * (x + 0.044715f * x * x * x)));
}

inline float relu_f(float x) { return x < 0.0f ? 0.0f : x; }  // keeps NaN, like max(x, 0)

inline void apply_activation(Activation act, float* x, int64_t n) {
  switch (act) {
    case Activation::none: break;
    case Activation::relu: for (int64_t i = 0; i < n; ++i) x[i] = relu_f(x[i]); break;
    case Activation::gelu: for (int64_t i = 0; i < n; ++i) x[i] = gelu_f(x[i]); break;
    case Activation::sigmoid: for (int64_t i = 0; i < n; ++i) x[i] = sigmoid_f(x[i]); break;
    case Activation::tanh: for (int64_t i = 0; i < n; ++i) x[i] = tanh_f(x[i]); break;
  }
}

}  // namespace
}  // namespace jb
