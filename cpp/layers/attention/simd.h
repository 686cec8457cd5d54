// Vector traits for the attention's row loops: an fp32 vector, a lane mask and the few
// operations the loops need. The compiler does not vectorize the loops' max and sum
// reductions on its own (that would reassociate fp32 math), so they are written with these.
// exp and the bf16 rounding take the steps of activation.h's exp_approx and brgemm.h's
// f32_to_bf16, lane by lane. Included only by the translation unit of its ISA
// (rows_avx512.cc, rows_avx2.cc), compiled with that ISA's flags; internal linkage.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace jb::attention::simd {
namespace {

#define JB_V512 __attribute__((always_inline)) static inline
#define JB_V256 __attribute__((always_inline)) static inline

// The constants of exp_approx.
struct ExpConst {
  static constexpr float lo = -87.3f, hi = 88.7f, shifter = 12582912.0f, log2e = 1.44269504088896341f;
  static constexpr float ln2_hi = 0.693359375f, ln2_lo = 2.12194440e-4f;
  static constexpr float c[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
};

#if defined(__AVX512F__)
struct Avx512 {
  using V = __m512;
  using M = __mmask16;
  static constexpr int L = 16;
  JB_V512 V load(const float* p) { return _mm512_loadu_ps(p); }
  JB_V512 void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  JB_V512 V set1(float x) { return _mm512_set1_ps(x); }
  JB_V512 V zero() { return _mm512_setzero_ps(); }
  JB_V512 V add(V a, V b) { return _mm512_add_ps(a, b); }
  JB_V512 V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  JB_V512 V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  JB_V512 V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  JB_V512 V max(V x, V m) { return _mm512_max_ps(x, m); }  // x > m ? x : m (NaN x: m)
  JB_V512 M first(int n) { return n <= 0 ? M(0) : n >= L ? M(0xffff) : M((1u << n) - 1u); }
  JB_V512 M nonzero(const uint8_t* p) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_test_epi32_mask(v, v);
  }
  // Lanes j .. j + 15 of a row of bits (j a multiple of 8).
  JB_V512 M bits(const uint8_t* row, int j) {
    uint16_t w;
    __builtin_memcpy(&w, row + (j >> 3), sizeof(w));
    return M(w);
  }
  JB_V512 M both(M a, M b) { return M(a & b); }
  JB_V512 M less(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  JB_V512 V select(M k, V a, V b) { return _mm512_mask_blend_ps(k, b, a); }
  JB_V512 float hmax(V v) { return _mm512_reduce_max_ps(v); }
  JB_V512 float hsum(V v) { return _mm512_reduce_add_ps(v); }
  JB_V512 V exp(V x) {
    using C = ExpConst;
    const V below = set1(C::lo);
    const M flush = less(x, below);
    x = _mm512_min_ps(set1(C::hi), _mm512_max_ps(below, x));  // NaN passes both
    const V t = fma(x, set1(C::log2e), set1(C::shifter));
    const V n = sub(t, set1(C::shifter));
    const V r = fma(n, set1(C::ln2_lo), _mm512_fnmadd_ps(n, set1(C::ln2_hi), x));
    V p = set1(C::c[0]);
    for (int i = 1; i < 6; ++i) p = fma(p, r, set1(C::c[i]));
    p = add(fma(mul(p, r), r, r), set1(1.0f));
    const __m512i ni = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(0x4B400000));
    const __m512i half = _mm512_srai_epi32(ni, 1), bias = _mm512_set1_epi32(127);
    const V s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(half, bias), 23));
    const V s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(ni, half), bias), 23));
    return _mm512_maskz_mov_ps(M(~flush), mul(mul(p, s1), s2));
  }
  JB_V512 V load_bf16(const uint16_t* p) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
  }
  JB_V512 void store_bf16(uint16_t* p, V v) {
    const __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
    const __m512i odd = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i bits = _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
  }
};

#endif

#if defined(__AVX2__)
struct Avx2 {
  using V = __m256;
  using M = __m256;  // all ones in the lanes that are set
  static constexpr int L = 8;
  JB_V256 V load(const float* p) { return _mm256_loadu_ps(p); }
  JB_V256 void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  JB_V256 V set1(float x) { return _mm256_set1_ps(x); }
  JB_V256 V zero() { return _mm256_setzero_ps(); }
  JB_V256 V add(V a, V b) { return _mm256_add_ps(a, b); }
  JB_V256 V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  JB_V256 V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  JB_V256 V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  JB_V256 V max(V x, V m) { return _mm256_max_ps(x, m); }
  JB_V256 M first(int n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
  }
  JB_V256 M nonzero(const uint8_t* p) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i zero = _mm256_cmpeq_epi32(v, _mm256_setzero_si256());
    return _mm256_castsi256_ps(_mm256_xor_si256(zero, _mm256_set1_epi32(-1)));
  }
  JB_V256 M bits(const uint8_t* row, int j) {  // lanes j .. j + 7 (j a multiple of 8)
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i b = _mm256_and_si256(_mm256_set1_epi32(row[j >> 3]), lane);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, lane));
  }
  JB_V256 M both(M a, M b) { return _mm256_and_ps(a, b); }
  JB_V256 M less(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  JB_V256 V select(M k, V a, V b) { return _mm256_blendv_ps(b, a, k); }
  JB_V256 float hmax(V v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  JB_V256 float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  JB_V256 V exp(V x) {
    using C = ExpConst;
    const V below = set1(C::lo);
    const M flush = less(x, below);
    x = _mm256_min_ps(set1(C::hi), _mm256_max_ps(below, x));
    const V t = fma(x, set1(C::log2e), set1(C::shifter));
    const V n = sub(t, set1(C::shifter));
    const V r = fma(n, set1(C::ln2_lo), _mm256_fnmadd_ps(n, set1(C::ln2_hi), x));
    V p = set1(C::c[0]);
    for (int i = 1; i < 6; ++i) p = fma(p, r, set1(C::c[i]));
    p = add(fma(mul(p, r), r, r), set1(1.0f));
    const __m256i ni = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(0x4B400000));
    const __m256i half = _mm256_srai_epi32(ni, 1), bias = _mm256_set1_epi32(127);
    const V s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const V s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
    return _mm256_andnot_ps(flush, mul(mul(p, s1), s2));
  }
  JB_V256 V load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  }
  JB_V256 void store_bf16(uint16_t* p, V v) {
    const __m256i u = _mm256_castps_si256(v), hi = _mm256_srli_epi32(u, 16);
    const __m256i odd = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i bits = _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
};

#endif

#undef JB_V512
#undef JB_V256

}  // namespace
}  // namespace jb::attention::simd
