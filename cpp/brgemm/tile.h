// Shared by the ISA translation units: the register-tile driver and the fp32 tile epilogue.
// Everything here has internal linkage (unnamed namespace): each ISA unit compiles its own
// copy with its own target flags, so no AVX-512 code can leak into the generic path
// through the linker picking one instance of an inline function.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "brgemm/activation.h"
#include "brgemm/brgemm.h"

namespace jb {
namespace {

// One register tile of C: rows [i0, i0 + MR), columns [j0, j0 + NV * VL) of the C block.
struct TileArgs {
  BatchWalk a, b;
  int64_t batch, k, lda, ldb;
  int64_t a_off, b_off;  // element offsets of the tile inside every A_i / B_i
  void* c;               // tile origin in C
  int64_t ldc;
  const float* bias;  // bias of the tile's first column, or null
  int tail;           // valid lanes in the tile's last vector (1..VL)
  bool accumulate;
  DType cdt;
  Activation act;
};

using TileFn = void (*)(const TileArgs&);

// Bias is already added; applies the activation to an fp32 tile (row stride ld) and writes
// it to C in C's dtype. The tile is in L1, so this costs no memory traffic.
inline void finish_tile(float* tile, int rows, int cols, int ld, const TileArgs& t) {
  for (int i = 0; i < rows; ++i) apply_activation(t.act, tile + i * ld, cols);
  if (t.cdt == DType::f32) {
    for (int i = 0; i < rows; ++i)
      std::memcpy(static_cast<float*>(t.c) + i * t.ldc, tile + i * ld, cols * sizeof(float));
  } else {
    for (int i = 0; i < rows; ++i) {
      uint16_t* dst = static_cast<uint16_t*>(t.c) + i * t.ldc;
      const float* src = tile + i * ld;
      for (int j = 0; j < cols; ++j) dst[j] = f32_to_bf16(src[j]);
    }
  }
}

// Rows of tile functions, one row per vector count NV, one entry per row count 1..mr(NV).
// MASKED: the tile's last vector is partial. Kernels whose masked loads cost more than
// plain ones (K::kMasksTail: vmaskmovps on Zen 3, an FMA-port uop for AVX-512's on Intel)
// get tiles that mask nothing for blocks whose last vector is whole.
template <class K, int NV, bool MASKED, int... R>
constexpr auto tile_row(bool bf16, std::integer_sequence<int, R...>) {
  return bf16 ? std::array<TileFn, sizeof...(R)>{&K::template tile_bf16<R + 1, NV, MASKED>...}
              : std::array<TileFn, sizeof...(R)>{&K::template tile_f32<R + 1, NV, MASKED>...};
}

template <class K, int NV>
const TileFn* tiles(bool bf16, bool masked) {
  using F32 = std::make_integer_sequence<int, K::mr(NV, false)>;
  using B16 = std::make_integer_sequence<int, K::mr(NV, true)>;
  static const auto f32 = tile_row<K, NV, false>(false, F32());
  static const auto b16 = tile_row<K, NV, false>(true, B16());
  if constexpr (K::kMasksTail) {
    static const auto f32m = tile_row<K, NV, true>(false, F32());
    static const auto b16m = tile_row<K, NV, true>(true, B16());
    if (masked) return bf16 ? b16m.data() : f32m.data();
  }
  return bf16 ? b16.data() : f32.data();
}

template <class K, int... NV>
const TileFn* tiles_for(int nv, bool bf16, bool masked, std::integer_sequence<int, NV...>) {
  const TileFn* row = nullptr;
  ((nv == NV + 1 ? (row = tiles<K, NV + 1>(bf16, masked), 0) : 0), ...);
  return row;
}

// Covers the C block with register tiles: up to NV_MAX vectors wide, mr(NV, bf16) rows high;
// edge tiles use fewer rows and a masked last vector, never padding copies.
template <class K>
void run_tiles(const BrgemmDesc& d, const BatchWalk& a, const BatchWalk& b, int64_t batch,
               void* c, const float* bias) {
  constexpr int vl = K::VL;
  const bool bf16 = d.ab == DType::bf16;
  const size_t csize = dtype_size(d.c);
  for (int64_t j0 = 0; j0 < d.n; j0 += int64_t(K::NV_MAX) * vl) {
    const int64_t cols = std::min<int64_t>(int64_t(K::NV_MAX) * vl, d.n - j0);
    const int nv = int((cols + vl - 1) / vl);
    const int mr = K::mr(nv, bf16);
    const int tail = int(cols - int64_t(nv - 1) * vl);
    const TileFn* row = tiles_for<K>(nv, bf16, tail != vl, std::make_integer_sequence<int, K::NV_MAX>());
    TileArgs t{a, b, batch, d.k, d.lda, d.ldb, 0, bf16 ? 2 * j0 : j0, nullptr, d.ldc,
               bias ? bias + j0 : nullptr, tail, d.accumulate, d.c, d.act};
    for (int64_t i0 = 0; i0 < d.m; i0 += mr) {
      const int rows = int(std::min<int64_t>(mr, d.m - i0));
      t.a_off = i0 * d.lda;
      t.c = static_cast<char*>(c) + (i0 * d.ldc + j0) * csize;
      row[rows - 1](t);
    }
  }
}

}  // namespace
}  // namespace jb
