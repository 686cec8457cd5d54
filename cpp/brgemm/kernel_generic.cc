// Portable C++ register tiles: the fallback for CPUs without AVX2 and for non-x86 hosts.
// Fixed-size arrays of accumulators that the compiler keeps in vector registers of
// whatever the baseline ISA offers.
#include "brgemm/tile.h"

namespace jb {
namespace {

struct Generic {
  static constexpr int VL = 8, NV_MAX = 2;
  static constexpr int mr(int, bool) { return 4; }
  static constexpr bool kMasksTail = false;  // the tail is a loop bound here, not a mask

  template <int MR, int NV, bool>
  static void tile_f32(const TileArgs& t) { tile<MR, NV, false>(t); }
  template <int MR, int NV, bool>
  static void tile_bf16(const TileArgs& t) { tile<MR, NV, true>(t); }

  template <int MR, int NV, bool BF16>
  static void tile(const TileArgs& t) {
    constexpr int W = NV * VL;
    const int cols = (NV - 1) * VL + t.tail;
    float acc[MR][W] = {};
    for (int64_t bi = 0; bi < t.batch; ++bi) {
      if constexpr (BF16) {
        const uint16_t* a = reinterpret_cast<const uint16_t*>(t.a.at(bi)) + t.a_off;
        const uint16_t* b = reinterpret_cast<const uint16_t*>(t.b.at(bi)) + t.b_off;
        for (int64_t k = 0; k < t.k; ++k) {
          // VNNI-2: row k of B is the (k % 2) half of pair row k / 2.
          const uint16_t* bk = b + (k / 2) * t.ldb + (k % 2);
          float bv[W] = {};
          for (int j = 0; j < cols; ++j) bv[j] = bf16_to_f32(bk[2 * j]);
          for (int i = 0; i < MR; ++i) {
            const float av = bf16_to_f32(a[i * t.lda + k]);
            for (int j = 0; j < W; ++j) acc[i][j] += av * bv[j];
          }
        }
      } else {
        const float* a = reinterpret_cast<const float*>(t.a.at(bi)) + t.a_off;
        const float* b = reinterpret_cast<const float*>(t.b.at(bi)) + t.b_off;
        for (int64_t k = 0; k < t.k; ++k) {
          float bv[W] = {};
          for (int j = 0; j < cols; ++j) bv[j] = b[k * t.ldb + j];
          for (int i = 0; i < MR; ++i) {
            const float av = a[i * t.lda + k];
            for (int j = 0; j < W; ++j) acc[i][j] += av * bv[j];
          }
        }
      }
    }
    // The sums from zero, then C, the partial sums of earlier chunks and the bias.
    if (t.accumulate) add_c<MR, W>(acc, cols, t);
    if (t.partial)
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < cols; ++j) acc[i][j] += t.partial[i * W + j];
    if (t.bias)
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < cols; ++j) acc[i][j] += t.bias[j];
    finish_tile(&acc[0][0], MR, cols, W, t);
  }

  template <int MR, int W>
  static void add_c(float (&acc)[MR][W], int cols, const TileArgs& t) {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < cols; ++j)
        acc[i][j] += t.cdt == DType::f32 ? static_cast<const float*>(t.c)[i * t.ldc + j]
                                        : bf16_to_f32(static_cast<const uint16_t*>(t.c)[i * t.ldc + j]);
  }
};

}  // namespace

BrgemmFn detail::brgemm_generic() { return &run_tiles<Generic>; }

}  // namespace jb
