// W fp32 lanes in a register as GCC vector types: loops written once over Lanes<W> compile
// to the vector width of the target attribute of the function they are inlined into (16
// under AVX-512, 8 under AVX2, 4 on the SSE2 baseline). bf16 loads and stores are shifts of
// the bits (stores round to nearest even, NaN quiet, as f32_to_bf16).
#pragma once

#include <cstdint>
#include <cstring>

namespace jb {

template <int W>
struct Lanes {
  typedef float f __attribute__((vector_size(4 * W)));
  typedef uint32_t u __attribute__((vector_size(4 * W)));
  typedef uint16_t h __attribute__((vector_size(2 * W)));
};

template <int W, class T>
[[gnu::always_inline]] inline typename Lanes<W>::f load(const T* p) {
  using L = Lanes<W>;
  if constexpr (sizeof(T) == 4) {
    typename L::f v;
    std::memcpy(&v, p, sizeof v);
    return v;
  } else {
    typename L::h b;
    std::memcpy(&b, p, sizeof b);
    typename L::u u;  // element by element: GCC makes one widening load of it
#pragma GCC unroll 16
    for (int i = 0; i < W; ++i) u[i] = uint32_t(b[i]) << 16;
    return (typename L::f)u;
  }
}

template <int W, class T>
[[gnu::always_inline]] inline void store(T* p, typename Lanes<W>::f v) {
  using L = Lanes<W>;
  if constexpr (sizeof(T) == 4) {
    std::memcpy(p, &v, sizeof v);
  } else {  // f32_to_bf16's bits: round to nearest even, NaN quiet
    const typename L::u u = (typename L::u)v;
    typename L::u b = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
    b = (u & 0x7fffffff) > 0x7f800000 ? (u >> 16) | 0x40 : b;
    const typename L::h out = __builtin_convertvector(b, typename L::h);
    std::memcpy(p, &out, sizeof out);
  }
}

// n floats, 8 at a time: a group's channels (a memcpy call for each would cost more).
[[gnu::always_inline]] inline void copy_floats(const float* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store<8>(dst + i, load<8>(src + i));
  for (; i < n; ++i) dst[i] = src[i];
}

}  // namespace jb
