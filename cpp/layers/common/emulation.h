// float32 products from bfloat16 ones inside a layer (jax_brgemm.precision's bf16_*
// accuracies), split where a layer re-blocks or makes its operands: jb.brgemm's, the FC and
// convolution passes', attention's Q, K, V, P and dS, the LSTM's weights, h and gate gradient.
//
// A float32 operand x is split into bfloat16 parts, largest first: hi = bf16(x),
// mid = bf16(x - hi), lo = bf16(x - hi - mid). A product of two parts is exact in float32,
// so A B is approximated by the sum of the large part products, the `terms`: one batch-reduce
// over them accumulates every product of a tile into the same float32 accumulators. The
// parts are made when an operand is re-blocked: each distinct part into its own block of the
// packed operand, `step` elements apart.
#pragma once

#include <cstdint>

#include "brgemm/brgemm.h"

namespace jb::emulation {

struct Terms {
  int count = 1;           // products summed
  int parts[2] = {1, 1};   // distinct parts of A (side 0) and B (side 1)
  int8_t of[2][6] = {};    // term i multiplies part of[0][i] of A by part of[1][i] of B
  bool split = false;      // false: exact, the operands as they are (one product)
};

// The terms of `products` bf16 products: 0 (exact, no split), 1, 3 or 6 (ops/emulation.py's
// TERMS, smallest first). Throws std::invalid_argument for another count.
Terms terms(int64_t products);

// Packs like reblock::pack into `kd` (bf16, or fp32 holding bf16-exact values where the CPU
// multiplies bf16 in fp32); with terms.split, the parts of the fp32 source that `side`
// multiplies, part p at dst + p * step elements. tmp: 2 * prows * pcols floats.
void pack(const Terms& t, int side, const void* src, DType src_dt, int64_t ld, bool trans, int64_t rows,
          int64_t cols, int64_t prows, int64_t pcols, DType kd, bool vnni, void* dst, int64_t step, Isa isa,
          float* tmp);

// The parts of `rows` rows of `cols` fp32 values (lds apart) that `side` multiplies, in kd,
// rows ldd apart, part p at dst + p * step elements; columns [cols, zero_to) of each row 0.
void split_rows(const Terms& t, int side, const float* src, int64_t lds, void* dst, DType kd, int64_t ldd,
                int64_t step, int64_t rows, int64_t cols, int64_t zero_to);

// Part p (0, 1 or 2) of n fp32 values (what parts 0 .. p - 1 leave, rounded to bf16), in kd:
// contiguous, or in runs of `run` values dst_run elements apart in dst.
void part_of(const float* src, int p, void* dst, DType kd, int64_t n, int64_t run = 0, int64_t dst_run = 0);

// Packs like reblock::pack the rows [row0, row0 + rows) of an operand's parts stacked by
// term: row u holds part of[side][u / unit] of source row u % unit (fp32 `src`, rows ld
// apart, or columns with trans). For operands too narrow to fill a batch element per term
// (a convolution group's few channels). tmp: prows * pcols floats.
void pack_stacked(const Terms& t, int side, int64_t unit, const float* src, int64_t ld, bool trans, int64_t row0,
                  int64_t rows, int64_t cols, int64_t prows, int64_t pcols, DType kd, bool vnni, void* dst, Isa isa,
                  float* tmp);

// Whether any of n fp32 values is beyond the split's reach: an infinity, or a finite value
// above bfloat16's largest (whose high part can round to an infinity, the next part to NaN).
// NaN is not: it propagates as float32's does. Vectorized for isa.
bool beyond_bf16(const float* x, int64_t n, Isa isa);

// C (+)= the sum over the terms of (part of A) x (part of B), parts a_step and b_step
// elements apart; without a split, one product of a and b.
inline void multiply(const Brgemm& k, const Terms& t, const void* a, int64_t a_step, const void* b, int64_t b_step,
                     void* c) {
  int64_t oa[6], ob[6];
  for (int i = 0; i < t.count; ++i) oa[i] = t.of[0][i] * a_step, ob[i] = t.of[1][i] * b_step;
  k.offsets(a, oa, b, ob, t.count, c);
}

}  // namespace jb::emulation
