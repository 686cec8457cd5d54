// The element-wise work of attention between its products, on one tile of scores (a query
// block's rows against one key chunk): logits, masking, the online softmax of the forward,
// and the softmax gradient of the backward. Vectorized for the ISA passed in, like
// layers/common/eltwise; everything is fp32.
#pragma once

#include <cstdint>

#include "brgemm/brgemm.h"

namespace jb::attention {

// A rows x cols tile of raw scores S = Q K^T (row stride ld) in a chunk `width` keys wide
// (cols <= width: the keys past the sequence's end are padding and take no part). The
// logits are x = scale * S + bias, and kMasked where row r masks key j: j >= limit0 + r
// (causal), or mask == 0. bias and mask point at the tile's (0, 0) element; each has a row
// stride and a column stride of 0 (one value per row) or 1. keep (dropout), when not null,
// points at the byte of the tile's first key (a multiple of 8) in row 0, rows keep_rs bytes
// apart: bit j of a row set keeps key j's weight, times keep_scale; clear drops it.
struct ScoreTile {
  float* s = nullptr;
  int64_t ld = 0;
  int64_t rows = 0, cols = 0, width = 0;
  float scale = 1.0f;
  bool causal = false;
  int64_t limit0 = 0;
  const float* bias = nullptr;
  int64_t bias_rs = 0, bias_cs = 0;
  const uint8_t* mask = nullptr;
  int64_t mask_rs = 0, mask_cs = 0;
  const uint8_t* keep = nullptr;
  int64_t keep_rs = 0;
  float keep_scale = 1.0f;
};

// The forward's online softmax over one chunk, row by row: the row max m[r] takes in the
// chunk's logits; alpha[r] = exp(old m - new m) is the factor the row's earlier sums (l[r]
// here, the output accumulator in the caller) are rescaled by; p = exp(x - m) is added to
// l[r] and written to P (rows x width, row stride ldp, fp32 or bf16 as pt, 0 past cols)
// times the dropout's factor (0 or keep_scale) where t.keep is given. m starts at -inf and
// l at 0. t.s is overwritten with the logits.
void softmax_forward(const ScoreTile& t, float* m, float* l, float* alpha, void* p, int64_t ldp,
                     DType pt, Isa isa);

// The backward's softmax gradient on one chunk: P = exp(x - m) / l from the saved
// statistics (inv_l = 1 / l), dS = P * (dP * D - d) with d[r] = rowsum(dO * O), 0 where
// masked (dp comes in as dO V^T; D is the dropout's factor, 1 without t.keep). Afterwards
// t.s holds P * D and dp (row stride lddp) holds scale * dS, both 0 past cols up to width;
// dbias (row stride lddb), when not null, gets dS itself (the bias gradient).
void softmax_backward(const ScoreTile& t, float* dp, int64_t lddp, const float* m,
                      const float* inv_l, const float* d, float* dbias, int64_t lddb, Isa isa);

// The forward-mode tangent's element-wise work on one chunk: P = exp(x - m) * inv_l from the
// saved statistics (0 where masked), the logits' tangent tS = scale * (ts_a + ts_b) + tbias
// (ts_a = tQ K^T and ts_b = Q tK^T, row stride ldts; tbias, when not null, laid out as t.bias
// with its strides), then Z = P * D into z and Z * tS into w (row stride ldz, dtype pt, 0
// past cols up to width), and c[r] += sum_j P tS (the softmax's own term of the tangent).
void softmax_tangent(const ScoreTile& t, const float* ts_a, const float* ts_b, int64_t ldts, const float* tbias,
                     const float* m, const float* inv_l, float* c, void* z, void* w, int64_t ldz, DType pt, Isa isa);

// y = x * scale[r] in row r (scale null: 1), stored in dt (rows x cols, row strides ldx, ldy).
void store_rows(const float* x, int64_t ldx, const float* scale, int64_t rows, int64_t cols, void* y, int64_t ldy,
                DType dt, Isa isa);

// d[r] = sum over j < n of a[r, j] * b[r, j] in fp32 (rows ld apart, dtype dt).
void row_dots(const void* a, const void* b, int64_t ld, int64_t rows, int64_t n, DType dt, float* d, Isa isa);

namespace detail {
// The row loops of one ISA (rows_<isa>.cc, each compiled with its ISA's flags).
struct RowFns {
  void (*forward_f32)(const ScoreTile&, float*, float*, float*, void*, int64_t);
  void (*forward_bf16)(const ScoreTile&, float*, float*, float*, void*, int64_t);
  void (*backward)(const ScoreTile&, float*, int64_t, const float*, const float*, const float*, float*, int64_t);
  void (*tangent_f32)(const ScoreTile&, const float*, const float*, int64_t, const float*, const float*, const float*,
                      float*, void*, void*, int64_t);
  void (*tangent_bf16)(const ScoreTile&, const float*, const float*, int64_t, const float*, const float*, const float*,
                       float*, void*, void*, int64_t);
  void (*store)(const float*, int64_t, const float*, int64_t, int64_t, void*, int64_t, DType);
  void (*dots)(const void*, const void*, int64_t, int64_t, int64_t, DType, float*);
};
RowFns rows_avx2();
RowFns rows_avx512();
}  // namespace detail

}  // namespace jb::attention
