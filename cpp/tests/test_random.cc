// Dropout's keep-masks (layers/common/random.h): threefry2x32 against the Random123
// known-answer vectors, the packed bits against the bytes on every ISA, row edges, and the
// keep fraction for thresholds from none to all.
#include <cstdint>
#include <ios>
#include <vector>

#include "check.h"
#include "layers/common/random.h"

namespace rnd = jb::random;

TEST(threefry2x32_known_answers) {
  struct Kat {
    uint32_t key[2], ctr[2], out[2];
  };
  const Kat kats[] = {{{0, 0}, {0, 0}, {0x6b200159u, 0x99ba4efeu}},
                      {{0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu}, {0x1cb996fcu, 0xbb002be7u}},
                      {{0x13198a2eu, 0x03707344u}, {0x243f6a88u, 0x85a308d3u}, {0xc4923a9cu, 0x483df7a0u}}};
  for (const Kat& k : kats) {
    uint32_t out[2];
    rnd::threefry2x32(k.key[0], k.key[1], k.ctr[0], k.ctr[1], out);
    CHECK(out[0] == k.out[0] && out[1] == k.out[1]) << std::hex << out[0] << " " << out[1];
  }
}

TEST(bernoulli_bits_match_bytes_on_every_isa) {
  for (jb::Isa isa : {jb::Isa::generic, jb::Isa::avx2, jb::Isa::avx512}) {
    if (isa > jb::best_isa()) continue;
    for (int64_t cols : {1, 7, 8, 13, 64, 65, 200}) {
      const int64_t rows = 5, row_bytes = (cols + 7) / 8;
      const uint32_t t = rnd::threshold_of(0.7f);
      std::vector<uint8_t> bytes(size_t(rows * cols)), bits(size_t(rows * row_bytes), 0xff);
      rnd::bernoulli_bytes(3, 1234567, t, 0, rows * cols, bytes.data(), jb::Isa::generic);
      rnd::bernoulli_bits(3, 1234567, t, cols, 0, 2, bits.data(), isa);  // rows in two calls
      rnd::bernoulli_bits(3, 1234567, t, cols, 2, rows - 2, bits.data() + 2 * row_bytes, isa);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < row_bytes * 8; ++j) {
          const int bit = (bits[size_t(r * row_bytes + j / 8)] >> (j % 8)) & 1;
          CHECK(bit == (j < cols ? bytes[size_t(r * cols + j)] : 0)) << "cols " << cols << " row " << r << " key " << j;
        }
      std::vector<uint8_t> again(size_t(rows * cols));
      rnd::bernoulli_bytes(3, 1234567, t, 0, rows * cols, again.data(), isa);
      CHECK(again == bytes) << "isa " << int(isa);
    }
  }
}

TEST(bernoulli_keep_fraction_and_thresholds) {
  const int64_t n = 100000;
  std::vector<uint8_t> keep(n);
  for (float p : {0.0f, 0.1f, 0.5f, 0.9f, 1.0f}) {
    rnd::bernoulli_bytes(7, 9, rnd::threshold_of(p), 1000, n, keep.data(), jb::best_isa());
    int64_t kept = 0;
    for (uint8_t k : keep) kept += k;
    const double frac = double(kept) / double(n);
    CHECK(frac > p - 0.01 && frac < p + 0.01) << "p " << p << " kept " << frac;
  }
  CHECK(rnd::threshold_of(0.5f) == (1u << 22) && rnd::threshold_of(2.0f) == (1u << 23) &&
        rnd::threshold_of(-1.0f) == 0u);
}
