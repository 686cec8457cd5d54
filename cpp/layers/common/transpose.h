// Transposes in AVX-512 registers: 16 x 16 of 32-bit words (re-blocking and the emulation's
// split of transposed operands), 8 x 8 of 64-bit words (the split into VNNI pairs).
#pragma once

#include "layers/common/target.h"

#if defined(JB_X86)
#include <immintrin.h>

namespace jb {

// r[i] word j -> r[j] word i.
JB_TARGET_AVX512 inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16], s[4][4];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // s[g][c], lane L: column 4L + c of rows 4g..4g+3
    s[g][0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    s[g][1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    s[g][2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    s[g][3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // a 4 x 4 transpose of 128-bit lanes
    const __m512i v0 = _mm512_shuffle_i32x4(s[0][c], s[1][c], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(s[0][c], s[1][c], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(s[2][c], s[3][c], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(s[2][c], s[3][c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// r[i] 64-bit word j -> r[j] word i.
JB_TARGET_AVX512 inline void transpose8x64(__m512i (&r)[8]) {
  __m512i t[8];
  for (int i = 0; i < 4; ++i) {  // t[2i + e], 128-bit lane L: words 2L + e of rows 2i, 2i + 1
    t[2 * i] = _mm512_unpacklo_epi64(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi64(r[2 * i], r[2 * i + 1]);
  }
  for (int e = 0; e < 2; ++e) {  // a 4 x 4 transpose of 128-bit lanes
    const __m512i v0 = _mm512_shuffle_i64x2(t[e], t[2 + e], 0x44), v1 = _mm512_shuffle_i64x2(t[e], t[2 + e], 0xEE);
    const __m512i v2 = _mm512_shuffle_i64x2(t[4 + e], t[6 + e], 0x44), v3 = _mm512_shuffle_i64x2(t[4 + e], t[6 + e], 0xEE);
    r[e] = _mm512_shuffle_i64x2(v0, v2, 0x88);
    r[2 + e] = _mm512_shuffle_i64x2(v0, v2, 0xDD);
    r[4 + e] = _mm512_shuffle_i64x2(v1, v3, 0x88);
    r[6 + e] = _mm512_shuffle_i64x2(v1, v3, 0xDD);
  }
}

}  // namespace jb

#endif  // JB_X86
