// AVX2 register tiles: fp32 with FMA; bf16 widened to fp32 in registers (a VNNI-2 pair
// of B splits into its even and odd rows with one shift and one mask).
// Compiled with -mavx2 -mfma; only called when CPUID reports both.
#include <immintrin.h>

#include "brgemm/tile.h"

namespace jb {
namespace {

struct Avx2 {
  static constexpr int VL = 8, NV_MAX = 2;
  // 16 ymm registers: 6 x 2 (or 12 x 1) accumulators, the B vectors, one A broadcast and
  // the tail mask; 12 independent chains hide the FMA latency (4 cycles x 2 pipes). The bf16
  // tile needs two B vectors per NV (even and odd rows), so it stays at 4 x 2.
  static constexpr int mr(int nv, bool bf16) { return nv == 2 ? (bf16 ? 4 : 6) : (bf16 ? 8 : 12); }

  // A masked load (vmaskmovps) is slow next to a plain one (measured on an AMD Zen 3), so
  // tiles whose last vector is whole never mask (tile.h's MASKED).
  static constexpr bool kMasksTail = true;

  template <int MR, int NV, bool MASKED>
  static void tile_f32(const TileArgs& t) {
    static_assert(MR <= 12, "the row addressing covers 12 rows");
    const int64_t lda = t.lda * int64_t(sizeof(float));
    __m256 acc[MR][NV];
    const __m256i last = tail_mask(t.tail);
    init<MR, NV>(acc);
    for (int64_t bi = 0; bi < t.batch; ++bi) {
      const float* b = reinterpret_cast<const float*>(t.b.at(bi)) + t.b_off;
      // Row i of A at row[i / 3] + (i % 3) * lda: x86 addresses base + lda * {0, 1, 2}, so
      // the k loop steps four pointers rather than computing an address per row.
      const char* row[4] = {};
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q)
        if (3 * q < MR) row[q] = t.a.at(bi) + (t.a_off + 3 * q * t.lda) * int64_t(sizeof(float));
#pragma GCC unroll 2
      for (int64_t k = 0; k < t.k; ++k, b += t.ldb) {
        // B rows well ahead; near the end of B_i this fetches B_{i+1}, which usually follows.
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) _mm_prefetch(reinterpret_cast<const char*>(b + 24 * t.ldb + 8 * j), _MM_HINT_T0);
        __m256 bv[NV];
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j)
          bv[j] = MASKED && j == NV - 1 ? _mm256_maskload_ps(b + 8 * j, last) : _mm256_loadu_ps(b + 8 * j);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
          const __m256 av = _mm256_broadcast_ss(reinterpret_cast<const float*>(row[i / 3] + (i % 3) * lda));
#pragma GCC unroll 16
          for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_fmadd_ps(av, bv[j], acc[i][j]);
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
    __m256 acc[MR][NV];
    const __m256i last = tail_mask(t.tail);
    const __m256i hi = _mm256_set1_epi32(int(0xffff0000u));
    init<MR, NV>(acc);
    for (int64_t bi = 0; bi < t.batch; ++bi) {
      const uint16_t* a = reinterpret_cast<const uint16_t*>(t.a.at(bi)) + t.a_off;
      const uint16_t* b = reinterpret_cast<const uint16_t*>(t.b.at(bi)) + t.b_off;
      for (int64_t k = 0; k < t.k; k += 2, b += t.ldb) {
        const bool pair = k + 1 < t.k;  // odd k: the last row has no partner
        __m256 even[NV], odd[NV];
        #pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) {
          const int* src = reinterpret_cast<const int*>(b + 16 * j);
          const __m256i v = MASKED && j == NV - 1 ? _mm256_maskload_epi32(src, last)
                                                  : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
          even[j] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
          odd[j] = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
        }
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
          const uint16_t* ai = a + i * t.lda + k;
          const __m256 a0 = _mm256_set1_ps(bf16_to_f32(ai[0]));
          #pragma GCC unroll 16
          for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_fmadd_ps(a0, even[j], acc[i][j]);
          if (pair) {
            const __m256 a1 = _mm256_set1_ps(bf16_to_f32(ai[1]));
            #pragma GCC unroll 16
            for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_fmadd_ps(a1, odd[j], acc[i][j]);
          }
        }
      }
    }
    store<MR, NV>(acc, last, t);
  }

  static __m256i tail_mask(int tail) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(tail), lanes);
  }

  template <int MR, int NV>
  static void init(__m256 (&acc)[MR][NV]) {
    #pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
      #pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_setzero_ps();
  }

  // acc += C (accumulate), the partial sums and the bias; then the activation and the store.
  template <int MR, int NV>
  static void store(__m256 (&acc)[MR][NV], __m256i last, const TileArgs& t) {
    if (t.accumulate) {  // C through a stack tile: no masked loads, any dtype
      alignas(32) float tile[MR][NV * 8] = {};
      const int cols = (NV - 1) * 8 + t.tail;
      #pragma GCC unroll 16
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < cols; ++j)
          tile[i][j] = t.cdt == DType::f32 ? static_cast<const float*>(t.c)[i * t.ldc + j]
                                           : bf16_to_f32(static_cast<const uint16_t*>(t.c)[i * t.ldc + j]);
      #pragma GCC unroll 16
      for (int i = 0; i < MR; ++i)
        #pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_add_ps(acc[i][j], _mm256_load_ps(&tile[i][8 * j]));
    }
    if (t.partial)
      #pragma GCC unroll 16
      for (int i = 0; i < MR; ++i)
        #pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_add_ps(acc[i][j], _mm256_load_ps(t.partial + (i * NV + j) * 8));
    if (t.bias)
      #pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) {
        const __m256 bj = j < NV - 1 ? _mm256_loadu_ps(t.bias + 8 * j) : _mm256_maskload_ps(t.bias + 8 * j, last);
        #pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_add_ps(acc[i][j], bj);
      }
    if (t.act == Activation::none && t.cdt == DType::f32) {
      #pragma GCC unroll 16
      for (int i = 0; i < MR; ++i)
        #pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) {
          float* dst = static_cast<float*>(t.c) + i * t.ldc + 8 * j;
          if (j < NV - 1) _mm256_storeu_ps(dst, acc[i][j]);
          else _mm256_maskstore_ps(dst, last, acc[i][j]);
        }
      return;
    }
    alignas(32) float tile[MR][NV * 8];
    #pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
      #pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) _mm256_store_ps(&tile[i][8 * j], acc[i][j]);
    finish_tile(&tile[0][0], MR, (NV - 1) * 8 + t.tail, NV * 8, t);
  }
};

}  // namespace

BrgemmFn detail::brgemm_avx2() { return &run_tiles<Avx2>; }

}  // namespace jb
