// Transposes of 32-bit words for the narrow-group passes (pixels in the vector lanes):
// words(src, ss, rows, cols, dst, ld) writes dst[c * ld + j] = src[j * ss + c] for j < rows,
// c < cols: 8 x 8 at a time where the CPU has AVX2, the rest scalar. A 2-byte source is bf16,
// widened to fp32 on the way (fp32 multiplies of bf16 data); a 4-byte one is copied.
#pragma once

#include <cstdint>

#if JB_X86
#include <immintrin.h>
#endif

#include "layers/common/target.h"

namespace jb::conv {

template <class D, class S>
JB_INLINE D word_of(S v) {
  if constexpr (sizeof(S) == 2) return bf16_to_f32(v);
  else return v;
}

template <class S, class D>
void words_scalar(const S* src, int64_t ss, int64_t j0, int64_t rows, int64_t c0, int64_t cols, D* dst, int64_t ld) {
  for (int64_t c = c0; c < cols; ++c)
    for (int64_t j = j0; j < rows; ++j) dst[c * ld + j] = word_of<D>(src[j * ss + c]);
}

#if JB_X86
JB_TARGET_AVX2 JB_INLINE void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// 8 words of a source row as fp32 lanes (bf16 widened: its bits shifted up).
template <class S>
JB_TARGET_AVX2 JB_INLINE __m256 load8(const S* p) {
  if constexpr (sizeof(S) == 2) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }
}

template <class S, class D>
JB_TARGET_AVX2 void words_avx2(const S* src, int64_t ss, int64_t rows, int64_t cols, D* dst, int64_t ld) {
  static_assert(sizeof(D) == 4, "the destination holds 32-bit words");
  const int64_t r8 = rows / 8 * 8, c8 = cols / 8 * 8;
  for (int64_t j = 0; j < r8; j += 8)
    for (int64_t c = 0; c < c8; c += 8) {
      __m256 v[8];
      for (int i = 0; i < 8; ++i) v[i] = load8(src + (j + i) * ss + c);
      transpose8(v);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(reinterpret_cast<float*>(dst + (c + i) * ld + j), v[i]);
    }
  words_scalar(src, ss, r8, rows, 0, c8, dst, ld);
  words_scalar(src, ss, 0, rows, c8, cols, dst, ld);
}
#endif

// The transpose for `isa` (AVX2 and up: 8 x 8 blocks).
template <class S, class D>
void words(Isa isa, const S* src, int64_t ss, int64_t rows, int64_t cols, D* dst, int64_t ld) {
#if JB_X86
  if (isa >= Isa::avx2) return words_avx2(src, ss, rows, cols, dst, ld);
#endif
  (void)isa;
  words_scalar(src, ss, 0, rows, 0, cols, dst, ld);
}

}  // namespace jb::conv
