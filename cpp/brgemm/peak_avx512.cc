// The machine's arithmetic ceiling: independent FMA / vdpbf16ps chains, no memory traffic.
// bench/ reports every kernel as a fraction of what this measures.
#include <immintrin.h>

#include "brgemm/peak.h"

namespace jb {

namespace {

template <bool BF16>
float chains(int64_t iters) {
  constexpr int kChains = 12;  // > latency x throughput: the pipes never wait
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(float(i) * 1e-3f);
  const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-4f);
  const __m512bh xb = _mm512_cvtne2ps_pbh(x, x), yb = _mm512_cvtne2ps_pbh(y, y);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) {
      if constexpr (BF16) acc[i] = _mm512_dpbf16_ps(acc[i], xb, yb);
      else acc[i] = _mm512_fmadd_ps(acc[i], x, y);
    }
  }
  __m512 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

}  // namespace

float peak_loop_avx512(DType dtype, int64_t iters) {
  return dtype == DType::bf16 ? chains<true>(iters) : chains<false>(iters);
}

}  // namespace jb
