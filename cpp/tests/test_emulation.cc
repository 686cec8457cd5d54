// The emulation's split (layers/common/emulation.h) against a naive definition, bit for bit,
// on every ISA path (the vcvtne2ps2bf16 path and the scalar one must make the same parts):
// every layout (VNNI pairs, plain bf16, fp32), transposed or not, fp32 or bf16 sources, odd
// sizes and padding, and the values a rounding can get wrong: ties, NaN, infinities, values
// below float32's normal range (read as zero) and near bfloat16's largest.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "check.h"
#include "layers/common/emulation.h"
#include "layers/common/reblock.h"

namespace {

using jb::DType;

// bf16 rounding as the split defines it: below float32's normal range, a zero of its sign.
float naive_round(float v) {
  if (std::fpclassify(v) == FP_SUBNORMAL) v = std::signbit(v) ? -0.0f : 0.0f;
  return jb::bf16_to_f32(jb::f32_to_bf16(v));
}

float naive_part(float v, int p) {
  for (int q = 0; q < p; ++q) v -= naive_round(v);
  return naive_round(v);
}

std::vector<float> values(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng) * std::exp2(float(int(rng() % 40) - 20));
  const float special[] = {NAN, -INFINITY, INFINITY, 1.0f + 1.0f / 256, 1.0f + 3.0f / 256, 1e-39f, -3e-39f,
                           std::numeric_limits<float>::denorm_min(), 1.5e-38f, -0.0f, 0.0f, 3.3e38f,
                           std::numeric_limits<float>::max(), 1.0f + 1.0f / 128 + 1.0f / 65536};
  for (size_t i = 0; i < sizeof(special) / sizeof(float) && 3 * i < n; ++i) v[3 * i] = special[i];
  return v;
}

// Bits of element (r, j) of part p in the layout reblock::pack gives kd.
std::vector<uint8_t> naive_pack(const std::vector<float>& src, int64_t ld, bool trans, int64_t rows, int64_t cols,
                                int64_t prows, int64_t pcols, DType kd, bool vnni, int parts) {
  vnni = vnni && kd == DType::bf16;
  const int64_t n = jb::reblock::block_elems(prows, pcols, vnni), es = int64_t(jb::dtype_size(kd));
  std::vector<uint8_t> out(size_t(n * parts * es), 0);
  for (int p = 0; p < parts; ++p)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < cols; ++j) {
        const float h = naive_part(src[size_t(trans ? j * ld + r : r * ld + j)], p);
        const int64_t at = p * n + (vnni ? (r / 2) * 2 * pcols + 2 * j + (r & 1) : r * pcols + j);
        if (kd == DType::f32) std::memcpy(out.data() + at * 4, &h, 4);
        else {
          const uint16_t b = jb::f32_to_bf16(h);
          std::memcpy(out.data() + at * 2, &b, 2);
        }
      }
  return out;
}

}  // namespace

TEST(emulation_split_matches_naive_on_every_path) {
  std::mt19937 rng(13);
  const int64_t sizes[][4] = {{32, 16, 32, 16}, {33, 17, 34, 32}, {5, 3, 8, 16}, {1, 1, 2, 2}, {31, 47, 32, 48},
                              {64, 100, 64, 128}};
  for (jb::Isa isa : {jb::Isa::amx, jb::Isa::avx512, jb::Isa::avx2, jb::Isa::generic}) {
    if (isa > jb::best_isa()) continue;
    for (const auto& sz : sizes)
      for (bool trans : {false, true}) {
        const int64_t rows = sz[0], cols = sz[1], prows = sz[2], pcols = sz[3], ld = (trans ? rows : cols) + 3;
        const auto src = values(rng, size_t((trans ? cols : rows) * ld));
        for (int64_t products : {1, 3, 6})
          for (DType kd : {DType::f32, DType::bf16})
            for (bool vnni : {false, true}) {
              const jb::emulation::Terms t = jb::emulation::terms(products);
              const int parts = t.parts[1];
              const int64_t n = jb::reblock::block_elems(prows, pcols, vnni && kd == DType::bf16);
              std::vector<uint8_t> got(size_t(n * parts) * jb::dtype_size(kd), 0xAB);  // padding must be written
              std::vector<float> tmp(size_t(2 * (prows + 1) * pcols));
              jb::emulation::pack(t, 1, src.data(), DType::f32, ld, trans, rows, cols, prows, pcols, kd, vnni,
                                  got.data(), n, isa, tmp.data());
              CHECK(got == naive_pack(src, ld, trans, rows, cols, prows, pcols, kd, vnni, parts))
                  << jb::isa_name(isa) << " rows=" << rows << " cols=" << cols << " prows=" << prows
                  << " pcols=" << pcols << " trans=" << trans << " kd=" << int(kd) << " vnni=" << vnni
                  << " products=" << products;
            }
      }
  }
}

TEST(emulation_split_rows_and_part_of_match_naive) {
  std::mt19937 rng(17);
  for (int64_t cols : {1, 15, 16, 17, 31, 32, 33, 100}) {
    const int64_t rows = 5, lds = cols + 2, ldd = cols + 7, zero_to = cols + 3;
    const auto src = values(rng, size_t(rows * lds));
    for (DType kd : {DType::f32, DType::bf16}) {
      const int64_t es = int64_t(jb::dtype_size(kd)), step = rows * ldd;
      const jb::emulation::Terms t = jb::emulation::terms(6);
      std::vector<uint8_t> got(size_t(3 * step * es), 0xAB), want(got);
      jb::emulation::split_rows(t, 0, src.data(), lds, got.data(), kd, ldd, step, rows, cols, zero_to);
      for (int p = 0; p < 3; ++p)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < zero_to; ++j) {
            const float h = j < cols ? naive_part(src[size_t(r * lds + j)], p) : 0.0f;
            const uint16_t b = jb::f32_to_bf16(h);
            std::memcpy(want.data() + (p * step + r * ldd + j) * es, kd == DType::f32 ? (const void*)&h : &b,
                        size_t(es));
          }
      CHECK(got == want) << "split_rows cols=" << cols << " kd=" << int(kd);
      // part_of: part p of runs of `cols` values, ldd apart
      for (int p = 0; p < 3; ++p) {
        std::vector<float> dense(size_t(rows * cols));
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < cols; ++j) dense[size_t(r * cols + j)] = src[size_t(r * lds + j)];
        std::vector<uint8_t> out(size_t(rows * ldd * es), 0xCD), expect(out);
        jb::emulation::part_of(dense.data(), p, out.data(), kd, rows * cols, cols, ldd);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < cols; ++j) {
            const float h = naive_part(dense[size_t(r * cols + j)], p);
            const uint16_t b = jb::f32_to_bf16(h);
            std::memcpy(expect.data() + (r * ldd + j) * es, kd == DType::f32 ? (const void*)&h : &b, size_t(es));
          }
        CHECK(out == expect) << "part_of p=" << p << " cols=" << cols << " kd=" << int(kd);
      }
    }
  }
}

TEST(emulation_beyond_bf16_on_every_path) {
  // bf16's largest finite value is in reach; just above it (rounding to an infinity) is not.
  const float largest = jb::bf16_to_f32(0x7f7f), above = std::nextafter(largest, INFINITY);
  for (jb::Isa isa : {jb::Isa::amx, jb::Isa::avx512, jb::Isa::avx2, jb::Isa::generic}) {
    if (isa > jb::best_isa()) continue;
    for (int64_t n : {1, 15, 16, 17, 100}) {
      std::vector<float> x(size_t(n), 1.0f);
      x[0] = NAN;
      x[size_t(n / 2)] = -largest;
      CHECK(!jb::emulation::beyond_bf16(x.data(), n, isa)) << jb::isa_name(isa) << " n=" << n;
      for (float bad : {INFINITY, -INFINITY, above, -above}) {
        x[size_t(n - 1)] = bad;
        CHECK(jb::emulation::beyond_bf16(x.data(), n, isa)) << jb::isa_name(isa) << " n=" << n << " " << bad;
        x[size_t(n - 1)] = 1.0f;
      }
    }
  }
}
