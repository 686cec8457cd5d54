// Blocking arithmetic and heuristics shared by the layers: how an output is cut into the
// blocks that are the work items, and how a reduced dimension is cut into batch elements.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "brgemm/brgemm.h"

namespace jb {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// The dtype the kernels multiply in for operands stored in dt (accumulation is fp32).
inline DType multiply_dtype(DType dt, const Dispatch& dp) {
  return dt == DType::f32 ? DType::f32 : dp.bf16_multiply;
}

// How a pass multiplies operands stored in dt: the kernel ISA, the multiply dtype, whether B
// is VNNI-packed (bf16 multiplies) and the bytes of one multiplied element. Every plan is one.
struct MultiplyPath {
  MultiplyPath(DType dt, const Dispatch& dp)
      : isa(dp.isa), mul_dt(multiply_dtype(dt, dp)), vnni(mul_dt == DType::bf16), mul_bytes(dtype_size(mul_dt)) {}
  // A kernel for A (rows lda apart) times B blocks re-blocked `cols` wide (VNNI pairs for
  // bf16), `depth` deep per batch element, into C (rows ldc apart, dtype c_dt).
  BrgemmDesc desc(int64_t depth, int64_t lda, int64_t cols, int64_t ldc, DType c_dt = DType::f32) const {
    BrgemmDesc d;
    d.k = depth;
    d.lda = lda;
    d.ldb = vnni ? 2 * cols : cols;
    d.ldc = ldc;
    d.ab = mul_dt;
    d.c = c_dt;
    return d;
  }
  const Isa isa;
  const DType mul_dt;
  const bool vnni;
  const size_t mul_bytes;
};

// Block sizes of one pass: rows and columns of an output block, and the block of the
// reduced dimension (one BRGEMM batch element).
struct Blocking {
  int64_t rows = 0, cols = 0, red = 0;
  // Forward and backward: re-block the whole weight first, then let each N-block run past
  // every panel (its rows of the activations stay in L2), instead of each panel's item
  // running past every N-block.
  bool weights_first = false;
};

// The largest weight panel an item re-reads for each of its output blocks: all of a 1 MiB L2
// (AMD Zen 4), half of a 2 MiB one (Intel Xeon); experimentally selected on both.
constexpr int64_t kPanelBytes = int64_t(1) << 20;

// Weight panels wider than one register tile are stored as sub-panels of this many columns
// (one AVX-512 tile, two AVX2 ones), each contiguous across its reduction blocks, and
// multiplied by one BRGEMM call each: a register tile then streams its B rows contiguously,
// with its B prefetch running on from one block into the next, instead of picking one tile's
// columns out of every wider row. A panel width that is no multiple of it is one sub-panel.
// AMX tiles load B 16 rows at a time at any stride, and a call configures and releases the
// tiles: bf16 on AMX keeps whole panels (sub-panels lost at C = K = 256 and 512 on an Intel
// Xeon; docs/fc.md).
constexpr int64_t kSubCols = 32;
inline int64_t sub_cols(int64_t cols, Isa isa, DType multiply) {
  return (isa == Isa::amx && multiply == DType::bf16) || cols % kSubCols ? cols : kSubCols;
}

// This core's L2 in bytes (the C library's report; kPanelBytes where it has none).
int64_t l2_bytes();

// A multiple of every ISA's register-tile height.
constexpr int64_t kRowQuantum = 12;
// Work items per thread a pass aims for, so a late or slow thread still finds work.
constexpr int64_t kItemsPerThread = 8;

// Rows per output block for m rows against `col_blocks` column blocks: whole register
// tiles, at most 96 rows, and fine enough that every thread gets several items when
// the other dimension has few blocks (kItemsPerThread).
int64_t split_rows(int64_t m, int64_t col_blocks, int64_t threads);

// A block of a reduced dimension that divides it (the kernel's batch elements must all be
// full), at most 256; even sizes first when `even` (bf16 VNNI pairs never straddle
// blocks). Falls back to the whole dimension (one batch element) when nothing in range
// divides it.
int64_t reduction_block(int64_t size, bool even);

// The block of a reduced dimension of `total` that we zero-pad to whole blocks ourselves (the
// operand is re-blocked or laid out by us): a multiple of `quantum` up to `max` that
// minimises the padded work, with a penalty for short blocks (the kernel's overhead per
// batch element).
int64_t padded_block(int64_t total, int64_t quantum, int64_t max);

// A leading dimension of at least `cols` elements of es bytes for rows of which a register
// tile reads every `stride`-th: padded by cache lines while those rows would be a multiple of
// 4 KiB apart (they would all fall in one L1 set and evict each other).
inline int64_t padded_ld(int64_t cols, size_t es, int64_t stride = 1) {
  for (int64_t ld = cols; ld < cols + 4096; ld += int64_t(64 / es))
    if ((stride * ld * int64_t(es)) % 4096) return ld;
  return cols + 1;  // stride a multiple of 64 rows: an odd pad breaks the 4 KiB period
}

// b clamped to an output of rows x cols (at least one row and column).
inline Blocking clamped(Blocking b, int64_t rows, int64_t cols) {
  b.rows = std::max<int64_t>(1, std::min(b.rows, rows));
  b.cols = std::max<int64_t>(1, std::min(b.cols, cols));
  return b;
}

}  // namespace jb
