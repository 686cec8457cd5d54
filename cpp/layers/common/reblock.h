// Re-blocking of operands into the layouts the BRGEMM kernel reads: the data movement
// around the kernel calls of every layer (weights into [Kb][Cb][bc][bk] blocks, transposed
// blocks for the dual passes, VNNI-2 pairs for bf16), with dtype conversion on the way.
#pragma once

#include <cstdint>

#include "brgemm/brgemm.h"

namespace jb::reblock {

// Elements of a packed prows x pcols block (VNNI pads the rows to an even count).
inline int64_t block_elems(int64_t prows, int64_t pcols, bool vnni) {
  return (vnni ? (prows + 1) / 2 * 2 : prows) * pcols;
}

// Packs a rows x cols block of a row-major source (leading dimension ld) into dst, a
// prows x pcols block (rows <= prows, cols <= pcols; the rest is zero-filled). Source
// element (r, j) is src[r * ld + j], or src[j * ld + r] when `trans`. dst is plain
// row-major, or with `vnni` (bf16 dst only) VNNI-2 pairs of rows: element (r, j) at
// [(r / 2) * 2 * pcols + 2 * j + r % 2]. fp32 <-> bf16 conversion rounds to nearest even
// (NaN stays NaN), bit-identical on every ISA; `isa` >= avx512 only makes it faster.
void pack(const void* src, DType src_dt, int64_t ld, bool trans, int64_t rows, int64_t cols,
          int64_t prows, int64_t pcols, DType dst_dt, bool vnni, void* dst, Isa isa);

}  // namespace jb::reblock
