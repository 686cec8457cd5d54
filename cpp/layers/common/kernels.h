// The kernels of a grid of output blocks: the full block and its edge variants (last row
// block, last column block, the corner), built once by a plan, outside every hot loop.
#pragma once

#include <cstdint>
#include <optional>

#include "brgemm/brgemm.h"

namespace jb {

class KernelSet {
 public:
  // Blocks of bm x bn over an m x n output; d gives everything but the block size.
  // Throws std::invalid_argument where the descriptor makes no sense.
  KernelSet(BrgemmDesc d, int64_t m, int64_t n, int64_t bm, int64_t bn, Isa isa)
      : bm_(bm), bn_(bn) {
    const int64_t em = m % bm, en = n % bn;
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) {
        if ((i && !em) || (j && !en)) continue;
        d.m = i ? em : bm;
        d.n = j ? en : bn;
        k_[i][j].emplace(d, isa);
      }
  }
  // The kernel of a block of rows x cols (each either the full size or the edge).
  const Brgemm& operator()(int64_t rows, int64_t cols) const {
    return *k_[rows != bm_][cols != bn_];
  }

 private:
  int64_t bm_, bn_;
  std::optional<Brgemm> k_[2][2];
};

}  // namespace jb
