// The fp32 ceiling of an AVX2 core: independent ymm FMA chains, no memory traffic.
// 12 chains (> latency x throughput on any AVX2 core), two rounds per iteration, so one
// iteration does the same 384 flops as the AVX-512 probe's and peak_flops_per_iter holds.
#include <immintrin.h>

#include "brgemm/peak.h"

namespace jb {

float peak_loop_avx2(int64_t iters) {
  constexpr int kChains = 12;
  __m256 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(float(i) * 1e-3f);
  const __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(1e-4f);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 24
    for (int r = 0; r < 2 * kChains; ++r) acc[r % kChains] = _mm256_fmadd_ps(acc[r % kChains], x, y);
  }
  __m256 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm256_add_ps(s, acc[i]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, s);
  float total = 0;
  for (float v : lanes) total += v;
  return total;
}

}  // namespace jb
