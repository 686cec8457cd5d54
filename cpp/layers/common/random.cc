#include "layers/common/random.h"

#include <cmath>
#include <cstring>

#include "layers/common/target.h"

namespace jb::random {

namespace {

JB_INLINE uint32_t rotl(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

// threefry2x32 (20 rounds) of the counter (hi, lo) under the key (k0, k1), into x0, x1.
JB_INLINE void threefry(uint32_t k0, uint32_t k1, uint32_t hi, uint32_t lo, uint32_t& x0, uint32_t& x1) {
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
  static constexpr int kRot[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  x0 = hi + ks[0], x1 = lo + ks[1];
#pragma GCC unroll 5
  for (int g = 0; g < 5; ++g) {
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      x0 += x1;
      x1 = rotl(x1, kRot[g % 2][r]) ^ x0;
    }
    x0 += ks[(g + 1) % 3];
    x1 += ks[(g + 2) % 3] + uint32_t(g + 1);
  }
}

// JAX's 32 random bits of a counter: the two words xor'ed.
JB_INLINE uint32_t threefry_bits(uint32_t k0, uint32_t k1, uint32_t hi, uint32_t lo) {
  uint32_t x0, x1;
  threefry(k0, k1, hi, lo, x0, x1);
  return x0 ^ x1;
}

// keep[i] for the n elements from i0 (each element's counter is its own index).
struct Bytes {
  static JB_INLINE void run(uint32_t k0, uint32_t k1, uint32_t threshold, int64_t i0, int64_t n, uint8_t* keep) {
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t c = uint64_t(i0 + i);
      keep[i] = uint8_t((threefry_bits(k0, k1, uint32_t(c >> 32), uint32_t(c)) >> 9) < threshold);
    }
  }
};

// Rows of bits, 64 keys at a time (whole vectors; lanes past the row are dropped).
struct Bits {
  static JB_INLINE void run(uint32_t k0, uint32_t k1, uint32_t threshold, int64_t cols, int64_t r0, int64_t rows,
                            uint8_t* bits) {
    const int64_t row_bytes = (cols + 7) / 8;
    uint8_t keep[64];
    for (int64_t r = 0; r < rows; ++r) {
      uint8_t* out = bits + r * row_bytes;
      std::memset(out, 0, size_t(row_bytes));
      for (int64_t j0 = 0; j0 < cols; j0 += 64) {
        const int64_t n = cols - j0 < 64 ? cols - j0 : 64;
        const uint64_t base = uint64_t(r0 + r) * uint64_t(cols) + uint64_t(j0);
        for (int64_t j = 0; j < 64; ++j) {
          const uint64_t c = base + uint64_t(j);
          keep[j] = uint8_t((threefry_bits(k0, k1, uint32_t(c >> 32), uint32_t(c)) >> 9) < threshold);
        }
        for (int64_t j = 0; j < n; ++j) out[(j0 + j) >> 3] |= uint8_t(keep[j] << ((j0 + j) & 7));
      }
    }
  }
};

}  // namespace

void threefry2x32(uint32_t k0, uint32_t k1, uint32_t hi, uint32_t lo, uint32_t out[2]) {
  threefry(k0, k1, hi, lo, out[0], out[1]);
}

uint32_t threshold_of(float p) {
  // the uniform m * 2^-23 (m < 2^23) is below p when m < p * 2^23, exact in double
  const double t = std::ceil(double(p) * 8388608.0);
  return t <= 0 ? 0u : t >= 8388608.0 ? 8388608u : uint32_t(t);
}

void bernoulli_bytes(uint32_t k0, uint32_t k1, uint32_t threshold, int64_t i0, int64_t n, uint8_t* keep, Isa isa) {
  target::variant<Bytes>(isa)(k0, k1, threshold, i0, n, keep);
}

void bernoulli_bits(uint32_t k0, uint32_t k1, uint32_t threshold, int64_t cols, int64_t r0, int64_t rows,
                    uint8_t* bits, Isa isa) {
  target::variant<Bits>(isa)(k0, k1, threshold, cols, r0, rows, bits);
}

}  // namespace jb::random
