// Re-blocking against a naive definition, bit for bit, on every ISA path (the AVX-512 tiles
// and the scalar fallback must agree): every dtype pair, plain / VNNI, transposed or not,
// sizes with and without whole tiles, padding, NaN / Inf / rounding ties.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "layers/common/reblock.h"

namespace {

using jb::DType;

std::vector<uint8_t> naive(const std::vector<float>& srcf, DType sdt, int64_t ld, bool trans,
                           int64_t rows, int64_t cols, int64_t prows, int64_t pcols, DType ddt,
                           bool vnni) {
  vnni = vnni && ddt == DType::bf16;
  const int64_t n = jb::reblock::block_elems(prows, pcols, vnni);
  std::vector<uint8_t> out(size_t(n) * jb::dtype_size(ddt), 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      float v = srcf[size_t(trans ? j * ld + r : r * ld + j)];
      if (sdt == DType::bf16) v = jb::bf16_to_f32(jb::f32_to_bf16(v));
      const int64_t at = vnni ? (r / 2) * 2 * pcols + 2 * j + (r & 1) : r * pcols + j;
      if (ddt == DType::f32) {
        std::memcpy(out.data() + at * 4, &v, 4);
      } else {
        const uint16_t h = jb::f32_to_bf16(v);
        std::memcpy(out.data() + at * 2, &h, 2);
      }
    }
  return out;
}

std::vector<uint8_t> packed(const std::vector<float>& srcf, DType sdt, int64_t ld, bool trans,
                            int64_t rows, int64_t cols, int64_t prows, int64_t pcols, DType ddt,
                            bool vnni, jb::Isa isa) {
  std::vector<uint16_t> src16(srcf.size());
  for (size_t i = 0; i < srcf.size(); ++i) src16[i] = jb::f32_to_bf16(srcf[i]);
  const void* src = sdt == DType::f32 ? static_cast<const void*>(srcf.data()) : src16.data();
  const int64_t n = jb::reblock::block_elems(prows, pcols, vnni && ddt == DType::bf16);
  std::vector<uint8_t> out(size_t(n) * jb::dtype_size(ddt), 0xAB);  // garbage: padding must be written
  jb::reblock::pack(src, sdt, ld, trans, rows, cols, prows, pcols, ddt, vnni, out.data(), isa);
  return out;
}

}  // namespace

TEST(reblock_matches_naive_on_every_path) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-3, 3);
  const int64_t sizes[][4] = {{32, 16, 32, 16}, {64, 48, 64, 64}, {33, 17, 34, 32},
                              {5, 3, 8, 16}, {1, 1, 2, 2}, {96, 64, 96, 64}, {31, 47, 32, 48}};
  for (jb::Isa isa : {jb::Isa::amx, jb::Isa::avx512, jb::Isa::avx2, jb::Isa::generic}) {
    if (isa > jb::best_isa()) continue;
    for (const auto& sz : sizes) {
      const int64_t rows = sz[0], cols = sz[1], prows = sz[2], pcols = sz[3];
      for (bool trans : {false, true}) {
        const int64_t ld = (trans ? rows : cols) + 3;
        std::vector<float> src(size_t((trans ? cols : rows) * ld));
        for (auto& v : src) v = u(rng);
        src[1] = NAN;
        src[2] = -INFINITY;
        src[3] = 1.0f + 1.0f / 256;  // a rounding tie in bf16 (to even: 1.0)
        src[src.size() / 2] = 1.0f + 3.0f / 256;  // a tie rounding up
        for (DType sdt : {DType::f32, DType::bf16})
          for (DType ddt : {DType::f32, DType::bf16})
            for (bool vnni : {false, true}) {
              const auto want = naive(src, sdt, ld, trans, rows, cols, prows, pcols, ddt, vnni);
              const auto got = packed(src, sdt, ld, trans, rows, cols, prows, pcols, ddt, vnni, isa);
              CHECK(got == want) << jb::isa_name(isa) << " rows=" << rows << " cols=" << cols << " prows=" << prows
                                 << " pcols=" << pcols << " trans=" << trans << " src="
                                 << int(sdt) << " dst=" << int(ddt) << " vnni=" << vnni;
            }
      }
    }
  }
}

