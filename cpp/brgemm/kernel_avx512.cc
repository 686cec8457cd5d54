// AVX-512 register tiles: fp32 with FMA, bf16 with vdpbf16ps on VNNI-2 packed B.
// Compiled with -mavx512{f,bw,vl,dq,bf16}; only called when CPUID reports all of them.
#include <immintrin.h>

#include "brgemm/tile.h"

namespace jb {
namespace {

struct Avx512 {
  static constexpr int VL = 16, NV_MAX = 2;
  // 12 x 2 accumulators (24 of the 32 zmm registers), leaving room for the B vectors and
  // the A broadcast; >= 8 independent chains hide the FMA latency. Tall rather than wide
  // tiles: B streams from L2 across the batch, and each B vector feeds 12 FMAs.
  static constexpr int mr(int, bool) { return 12; }

  // Row i of a tile starts at row[kRowBase[i]] + kRowMul[i] * lda (bytes).
  static constexpr int kRowBase[12] = {0, 0, 0, 1, 0, 1, 2, 1, 0, 3, 2, 1};
  static constexpr int kRowMul[12] = {0, 1, 2, 0, 4, 2, 0, 4, 8, 0, 4, 8};

  // A masked B load costs an extra uop on the FMA ports of Intel cores (measured on an Intel
  // Xeon), so tiles whose last vector is whole never mask (tile.h's MASKED).
  static constexpr bool kMasksTail = true;

  template <int MR, int NV, bool MASKED>
  static void tile_f32(const TileArgs& t) {
    static_assert(MR <= 12, "the row addressing covers 12 rows");
    const int64_t lda = t.lda * int64_t(sizeof(float));
    __m512 acc[MR][NV];
    const __mmask16 last = tail_mask(t.tail);
    init<MR, NV>(acc);
    for (int64_t bi = 0; bi < t.batch; ++bi) {
      const float* b = reinterpret_cast<const float*>(t.b.at(bi)) + t.b_off;
      // A's rows as x86 addresses base + lda * {0, 1, 2, 4, 8}: four row pointers (rows 0,
      // 3, 6, 9) step along k, rather than an address computed per row and k, whose
      // integer work took issue slots and ports from the FMAs.
      const char* row[4] = {};
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q)
        if (3 * q < MR) row[q] = t.a.at(bi) + (t.a_off + 3 * q * t.lda) * int64_t(sizeof(float));
#pragma GCC unroll 2
      for (int64_t k = 0; k < t.k; ++k, b += t.ldb) {
        // Ask for B rows well ahead (~300 cycles: an L3 hit on a busy machine); near the end
        // of B_i this fetches the first rows of B_{i+1}, which usually follows it.
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) _mm_prefetch(reinterpret_cast<const char*>(b + 24 * t.ldb + 16 * j), _MM_HINT_T0);
        __m512 bv[NV];
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j)
          bv[j] = MASKED && j == NV - 1 ? _mm512_maskz_loadu_ps(last, b + 16 * j) : _mm512_loadu_ps(b + 16 * j);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
          const __m512 av = _mm512_set1_ps(*reinterpret_cast<const float*>(row[kRowBase[i]] + kRowMul[i] * lda));
#pragma GCC unroll 16
          for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(av, bv[j], acc[i][j]);
        }
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q)
          if (3 * q < MR) row[q] += sizeof(float);
      }
    }
    store<MR, NV>(acc, last, t);
  }

  template <int MR, int NV, bool MASKED>
  static void tile_bf16(const TileArgs& t) {
    __m512 acc[MR][NV];
    const __mmask16 last = tail_mask(t.tail);
    init<MR, NV>(acc);
    const int64_t pairs = t.k / 2;
    for (int64_t bi = 0; bi < t.batch; ++bi) {
      const uint16_t* a = reinterpret_cast<const uint16_t*>(t.a.at(bi)) + t.a_off;
      const uint16_t* b = reinterpret_cast<const uint16_t*>(t.b.at(bi)) + t.b_off;
      for (int64_t p = 0; p < pairs; ++p, b += t.ldb) {
        __m512i bv[NV];
        load_pair_row<NV, MASKED>(bv, b, last);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
          uint32_t pair;  // A[i][2p], A[i][2p + 1]: one 32-bit broadcast
          std::memcpy(&pair, a + i * t.lda + 2 * p, 4);
          const __m512i av = _mm512_set1_epi32(int(pair));
#pragma GCC unroll 16
          for (int j = 0; j < NV; ++j)
            acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)av, (__m512bh)bv[j]);
        }
      }
      if (t.k % 2) {  // odd k: the last row pairs with the zero pad of packed B
        __m512i bv[NV];
        load_pair_row<NV, MASKED>(bv, b, last);
        #pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
          const __m512i av = _mm512_set1_epi32(int(a[i * t.lda + 2 * pairs]));
          #pragma GCC unroll 16
          for (int j = 0; j < NV; ++j)
            acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)av, (__m512bh)bv[j]);
        }
      }
    }
    store<MR, NV>(acc, last, t);
  }

  // One VNNI-2 row pair of B: NV vectors of 16 bf16 pairs, the last masked when partial.
  template <int NV, bool MASKED>
  __attribute__((always_inline)) static void load_pair_row(__m512i (&bv)[NV], const uint16_t* b, __mmask16 last) {
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j)
      bv[j] = MASKED && j == NV - 1 ? _mm512_maskz_loadu_epi32(last, b + 32 * j) : _mm512_loadu_si512(b + 32 * j);
  }

  static __mmask16 tail_mask(int tail) { return __mmask16((1u << tail) - 1u); }

  template <int MR, int NV>
  static void init(__m512 (&acc)[MR][NV]) {
    #pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
      #pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  }

  // acc += C (accumulate), the partial sums and the bias; then the activation and the store.
  template <int MR, int NV>
  static void store(__m512 (&acc)[MR][NV], __mmask16 last, const TileArgs& t) {
    #pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
      #pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) {
        const __mmask16 m = j < NV - 1 ? __mmask16(0xffff) : last;
        if (t.accumulate) {
          if (t.cdt == DType::f32) {
            acc[i][j] = _mm512_add_ps(acc[i][j], _mm512_maskz_loadu_ps(m, static_cast<const float*>(t.c) + i * t.ldc + 16 * j));
          } else {
            const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(t.c) + i * t.ldc + 16 * j);
            acc[i][j] = _mm512_add_ps(acc[i][j], _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
          }
        }
        if (t.partial) acc[i][j] = _mm512_add_ps(acc[i][j], _mm512_load_ps(t.partial + (i * NV + j) * 16));
      }
    if (t.bias)
      #pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) {
        const __m512 bj = _mm512_maskz_loadu_ps(j < NV - 1 ? __mmask16(0xffff) : last, t.bias + 16 * j);
        #pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_add_ps(acc[i][j], bj);
      }
    if (t.act == Activation::none && t.cdt == DType::f32) {
      #pragma GCC unroll 16
      for (int i = 0; i < MR; ++i)
        #pragma GCC unroll 16
        for (int j = 0; j < NV; ++j)
          _mm512_mask_storeu_ps(static_cast<float*>(t.c) + i * t.ldc + 16 * j,
                                j < NV - 1 ? __mmask16(0xffff) : last, acc[i][j]);
      return;
    }
    alignas(64) float tile[MR][NV * 16];
    #pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
      #pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) _mm512_store_ps(&tile[i][16 * j], acc[i][j]);
    finish_tile(&tile[0][0], MR, (NV - 1) * 16 + t.tail, NV * 16, t);
  }
};

}  // namespace

BrgemmFn detail::brgemm_avx512() { return &run_tiles<Avx512>; }

// Interleaves rows 2p and 2p + 1, 32 columns per step: lanes 2i, 2i + 1 of the output
// take element i of each row (vpermt2w), masked at the row end.
void detail::pack_vnni2_avx512(const uint16_t* src, int64_t k, int64_t n, int64_t ld, uint16_t* dst) {
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t p = 0; p < (k + 1) / 2; ++p) {
    const uint16_t* r0 = src + 2 * p * ld;
    const uint16_t* r1 = r0 + ld;
    const bool pair = 2 * p + 1 < k;
    uint16_t* out = dst + p * 2 * n;
    for (int64_t j = 0; j < n; j += 32) {
      const int64_t cols = std::min<int64_t>(32, n - j);
      const __mmask32 in = cols == 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
      const __m512i x0 = _mm512_maskz_loadu_epi16(in, r0 + j);
      const __m512i x1 = pair ? _mm512_maskz_loadu_epi16(in, r1 + j) : _mm512_setzero_si512();
      const int64_t lo_cols = std::min<int64_t>(cols, 16), hi_cols = cols - lo_cols;
      _mm512_mask_storeu_epi16(out + 2 * j, lo_cols == 16 ? ~__mmask32(0) : (__mmask32(1) << (2 * lo_cols)) - 1,
                               _mm512_permutex2var_epi16(x0, lo, x1));
      if (hi_cols > 0)
        _mm512_mask_storeu_epi16(out + 2 * j + 32, hi_cols == 16 ? ~__mmask32(0) : (__mmask32(1) << (2 * hi_cols)) - 1,
                                 _mm512_permutex2var_epi16(x0, hi, x1));
    }
  }
}

}  // namespace jb
