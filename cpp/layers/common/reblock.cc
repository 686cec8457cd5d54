// Packing into kernel operand blocks: a portable scalar path for everything, and SIMD paths
// (function-level target attributes, taken only when the kernel ISA in use has them) for
// the heavy cases: on AVX-512, VNNI pair interleaving and transposition as 16 x 16
// transposes of 32-bit words; on AVX2 (whose kernels multiply in fp32 only), fp32
// transposition as 8 x 8 transposes. All paths produce the same bits.
#include "layers/common/reblock.h"
#include "layers/common/target.h"
#include "layers/common/transpose.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(JB_X86)
#include <immintrin.h>
#endif

namespace jb::reblock {

namespace {

template <class S, class D>
inline D convert(S v) {
  if constexpr (std::is_same_v<S, D>) return v;
  else return from_f32<D>(to_f32(v));
}

// The scalar path over the region [r0, r1) x [j0, j1) of the block.
template <class S, class D>
void scalar(const S* src, int64_t ld, bool trans, int64_t r0, int64_t r1, int64_t j0,
            int64_t j1, int64_t pcols, bool vnni, D* dst) {
  auto at = [&](int64_t r, int64_t j) {
    return vnni ? (r / 2) * 2 * pcols + 2 * j + (r & 1) : r * pcols + j;
  };
  if (!trans) {
    for (int64_t r = r0; r < r1; ++r) {
      const S* s = src + r * ld;
      if (!vnni && std::is_same_v<S, D>) {
        std::memcpy(dst + r * pcols + j0, s + j0, size_t(j1 - j0) * sizeof(D));
      } else {
        for (int64_t j = j0; j < j1; ++j) dst[at(r, j)] = convert<S, D>(s[j]);
      }
    }
    return;
  }
  // In 16 x 16 tiles, so the lines read and written stay in L1 while a tile is moved.
  constexpr int64_t T = 16;
  for (int64_t ra = r0; ra < r1; ra += T)
    for (int64_t ja = j0; ja < j1; ja += T) {
      const int64_t re = std::min(r1, ra + T), je = std::min(j1, ja + T);
      for (int64_t j = ja; j < je; ++j) {
        const S* s = src + j * ld;
        for (int64_t r = ra; r < re; ++r) dst[at(r, j)] = convert<S, D>(s[r]);
      }
    }
}

#if defined(JB_X86)

// fp32 bit patterns -> bf16 in the low half of each 32-bit lane, exactly f32_to_bf16.
JB_TARGET_AVX512 inline __m512i bf16_bits(__m512i u) {
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                       _mm512_and_si512(hi, _mm512_set1_epi32(1))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
}

// 16 consecutive source values as 32-bit words: fp32 bits (D = float) or bf16 bits in
// the low half (D = uint16_t).
template <class S, class D>
JB_TARGET_AVX512 inline __m512i load16(const S* p) {
  if constexpr (std::is_same_v<S, float>) {
    const __m512i u = _mm512_loadu_si512(p);
    if constexpr (std::is_same_v<D, float>) return u;
    else return bf16_bits(u);
  } else {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    if constexpr (std::is_same_v<D, float>) return _mm512_slli_epi32(h, 16);
    else return h;
  }
}

// Two rows' 16 values as 16 bf16 pairs: (a[i], b[i]) in word i.
template <class S>
JB_TARGET_AVX512 inline __m512i pairs_across(const S* a, const S* b) {
  return _mm512_or_si512(load16<S, uint16_t>(a), _mm512_slli_epi32((load16<S, uint16_t>(b)), 16));
}

// 32 consecutive values of one row as 16 bf16 pairs: (p[2i], p[2i + 1]) in word i.
template <class S>
JB_TARGET_AVX512 inline __m512i pairs_along(const S* p) {
  if constexpr (std::is_same_v<S, uint16_t>) {
    return _mm512_loadu_si512(p);
  } else {
    const __m256i lo = _mm512_cvtepi32_epi16(load16<S, uint16_t>(p));
    const __m256i hi = _mm512_cvtepi32_epi16(load16<S, uint16_t>(p + 16));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
}

// Whole tiles with AVX-512; returns the region it covered, [0, rows_done) x [0, cols_done),
// the caller finishes the rest with the scalar path.
template <class S, class D>
JB_TARGET_AVX512 void simd(const S* src, int64_t ld, bool trans, int64_t rows, int64_t cols,
                    int64_t pcols, bool vnni, D* dst, int64_t* rows_done, int64_t* cols_done) {
  *rows_done = *cols_done = 0;
  if (!trans) {
    if (!vnni) return;  // plain copies: memcpy or rare conversions, scalar is fine
    // VNNI: rows r, r + 1 -> one row of pairs, 16 columns at a time.
    const int64_t r_end = rows / 2 * 2, j_end = cols / 16 * 16;
    uint32_t* d32 = reinterpret_cast<uint32_t*>(dst);
    for (int64_t r = 0; r < r_end; r += 2)
      for (int64_t j = 0; j < j_end; j += 16)
        _mm512_storeu_si512(d32 + (r / 2) * pcols + j,
                            pairs_across(src + r * ld + j, src + (r + 1) * ld + j));
    *rows_done = r_end;
    *cols_done = j_end;
    return;
  }
  // Transposed: 16 x 16 transposes of 32-bit words. A word is one fp32 value (plain fp32
  // dst), a pair of consecutive r (VNNI dst) or a pair of consecutive j (plain bf16 dst).
  constexpr bool f32_dst = std::is_same_v<D, float>;
  const int64_t tr = f32_dst || !vnni ? 16 : 32;  // r per tile
  const int64_t tj = f32_dst || vnni ? 16 : 32;   // j per tile
  const int64_t r_end = rows / tr * tr, j_end = cols / tj * tj;
  uint32_t* d32 = reinterpret_cast<uint32_t*>(dst);
  __m512i v[16];
  for (int64_t r0 = 0; r0 < r_end; r0 += tr)
    for (int64_t j0 = 0; j0 < j_end; j0 += tj) {
      for (int i = 0; i < 16; ++i) {
        if constexpr (f32_dst) {
          v[i] = load16<S, D>(src + (j0 + i) * ld + r0);
        } else {
          v[i] = vnni ? pairs_along(src + (j0 + i) * ld + r0)
                      : pairs_across(src + (j0 + 2 * i) * ld + r0, src + (j0 + 2 * i + 1) * ld + r0);
        }
      }
      transpose16(v);
      // word row w of the tile: element row r0 + w (plain) or pair row r0 / 2 + w (VNNI)
      const int64_t words_per_row = f32_dst ? pcols : vnni ? pcols : pcols / 2;
      const int64_t row0 = vnni && !f32_dst ? r0 / 2 : r0;
      const int64_t col0 = f32_dst || vnni ? j0 : j0 / 2;
      for (int w = 0; w < 16; ++w) _mm512_storeu_si512(d32 + (row0 + w) * words_per_row + col0, v[w]);
    }
  *rows_done = r_end;
  *cols_done = j_end;
}

// AVX2: fp32 destinations (the only kind its kernels read), transposed.
// 8 consecutive source values as fp32 (bf16 widened exactly).
template <class S>
JB_TARGET_AVX2 inline __m256 load8(const S* p) {
  if constexpr (std::is_same_v<S, float>) return _mm256_loadu_ps(p);
  else
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// r[i] lane j -> r[j] lane i.
JB_TARGET_AVX2 inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], q[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 2; ++g) {  // q[4g + c], 128-bit lane L: column 4L + c of rows 4g..4g+3
    q[4 * g + 0] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
    q[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
    q[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
    q[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(q[c], q[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(q[c], q[4 + c], 0x31);
  }
}

// Whole 8 x 8 tiles of a transposed pack into fp32; returns the region it covered, like simd.
template <class S>
JB_TARGET_AVX2 void simd_avx2_t(const S* src, int64_t ld, int64_t rows, int64_t cols, int64_t pcols,
                                float* dst, int64_t* rows_done, int64_t* cols_done) {
  const int64_t r_end = rows / 8 * 8, j_end = cols / 8 * 8;
  __m256 v[8];
  for (int64_t r0 = 0; r0 < r_end; r0 += 8)
    for (int64_t j0 = 0; j0 < j_end; j0 += 8) {
      for (int i = 0; i < 8; ++i) v[i] = load8(src + (j0 + i) * ld + r0);
      transpose8(v);
      for (int w = 0; w < 8; ++w) _mm256_storeu_ps(dst + (r0 + w) * pcols + j0, v[w]);
    }
  *rows_done = r_end;
  *cols_done = j_end;
}

#endif  // JB_X86

template <class S, class D>
void pack_typed(const S* src, int64_t ld, bool trans, int64_t rows, int64_t cols, int64_t prows,
                int64_t pcols, bool vnni, D* dst, Isa isa) {
  const int64_t total = block_elems(prows, pcols, vnni);
  if (rows < (vnni ? (prows + 1) / 2 * 2 : prows) || cols < pcols)
    std::memset(dst, 0, size_t(total) * sizeof(D));
  int64_t rd = 0, cd = 0;
#if defined(JB_X86)
  // The plain bf16 transposed tiles store pairs of columns: pcols must be even for the
  // 32-bit stores to stay aligned to word rows.
  const bool bf16_plain_t = std::is_same_v<D, uint16_t> && trans && !vnni;
  if (isa >= Isa::avx512 && !(bf16_plain_t && pcols % 2))
    simd<S, D>(src, ld, trans, rows, cols, pcols, vnni, dst, &rd, &cd);
  if constexpr (std::is_same_v<D, float>)
    if (isa == Isa::avx2 && trans) simd_avx2_t<S>(src, ld, rows, cols, pcols, dst, &rd, &cd);
#endif
  // The rest: rows [rd, rows) of every column, and columns [cd, cols) of rows [0, rd).
  scalar(src, ld, trans, rd, rows, 0, cols, pcols, vnni, dst);
  scalar(src, ld, trans, 0, rd, cd, cols, pcols, vnni, dst);
}

}  // namespace

void pack(const void* src, DType src_dt, int64_t ld, bool trans, int64_t rows, int64_t cols,
          int64_t prows, int64_t pcols, DType dst_dt, bool vnni, void* dst, Isa isa) {
  vnni = vnni && dst_dt == DType::bf16;
  auto go = [&](auto s, auto d) {
    using S = decltype(s);
    using D = decltype(d);
    pack_typed(static_cast<const S*>(src), ld, trans, rows, cols, prows, pcols, vnni,
               static_cast<D*>(dst), isa);
  };
  if (src_dt == DType::f32) {
    if (dst_dt == DType::f32) go(float{}, float{});
    else go(float{}, uint16_t{});
  } else {
    if (dst_dt == DType::f32) go(uint16_t{}, float{});
    else go(uint16_t{}, uint16_t{});
  }
}

}  // namespace jb::reblock
