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
// A tile sums its products from zero, then adds C (accumulate), the fp32 partial sums of
// earlier chunks of the reduction (partial, row stride NV * VL) and the bias, so that every
// chunk's rounding error scales with the chunk's own sum (run_tiles).
struct TileArgs {
  BatchWalk a, b;
  int64_t batch, k, lda, ldb;
  int64_t a_off, b_off;  // element offsets of the tile inside every A_i / B_i
  void* c;               // tile origin in C
  int64_t ldc;
  const float* bias;     // bias of the tile's first column, or null
  const float* partial;  // partial sums of the tile, or null
  int tail;              // valid lanes in the tile's last vector (1..VL)
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

// The longest reduction (products per output element) a tile sums in registers before its
// sums join the partial sums: a reduction of n products in chunks of L has rounding error
// ~(L + n / L) eps rather than ~n eps. Costs one tile store and reload per L products.
constexpr int64_t kChunkProducts = 1024;

// The largest tile, in floats: the partial sums' stack tile.
template <class K>
constexpr int kPartialFloats() {
  int most = 0;
  for (int nv = 1; nv <= K::NV_MAX; ++nv) most = std::max({most, K::mr(nv, false) * nv, K::mr(nv, true) * nv});
  return most * K::VL;
}

// Covers the C block with register tiles: up to NV_MAX vectors wide, mr(NV, bf16) rows high;
// edge tiles use fewer rows and a masked last vector, never padding copies. A reduction
// longer than kChunkProducts runs in chunks (whole batch items, or k ranges of even length
// for VNNI pairs) whose sums go through an fp32 stack tile; the last chunk adds them and
// runs the epilogue.
template <class K>
void run_tiles(const BrgemmDesc& d, const BatchWalk& a, const BatchWalk& b, int64_t batch,
               void* c, const float* bias) {
  constexpr int vl = K::VL;
  const bool bf16 = d.ab == DType::bf16;
  const size_t csize = dtype_size(d.c);
  const bool chunked = batch * d.k > kChunkProducts;
  // Batch items per chunk, and k per chunk (the whole k unless one item is too long).
  const int64_t k_parts = d.k > kChunkProducts ? (d.k + kChunkProducts - 1) / kChunkProducts : 1;
  const int64_t kc = k_parts > 1 ? ((d.k + k_parts - 1) / k_parts + 1) / 2 * 2 : d.k;
  const int64_t items = chunked ? std::max<int64_t>(1, kChunkProducts / std::max<int64_t>(kc, 1)) : batch;
  alignas(64) float partial[kPartialFloats<K>()];
  if (chunked) std::fill(std::begin(partial), std::end(partial), 0.0f);  // lanes past a tail too
  for (int64_t j0 = 0; j0 < d.n; j0 += int64_t(K::NV_MAX) * vl) {
    const int64_t cols = std::min<int64_t>(int64_t(K::NV_MAX) * vl, d.n - j0);
    const int nv = int((cols + vl - 1) / vl);
    const int mr = K::mr(nv, bf16);
    const int tail = int(cols - int64_t(nv - 1) * vl);
    const TileFn* row = tiles_for<K>(nv, bf16, tail != vl, std::make_integer_sequence<int, K::NV_MAX>());
    TileArgs t{a, b, batch, d.k, d.lda, d.ldb, 0, bf16 ? 2 * j0 : j0, nullptr, d.ldc,
               bias ? bias + j0 : nullptr, nullptr, tail, d.accumulate, d.c, d.act};
    for (int64_t i0 = 0; i0 < d.m; i0 += mr) {
      const int rows = int(std::min<int64_t>(mr, d.m - i0));
      t.a_off = i0 * d.lda;
      t.c = static_cast<char*>(c) + (i0 * d.ldc + j0) * csize;
      if (!chunked) {
        row[rows - 1](t);
        continue;
      }
      TileArgs part = t;  // every chunk but the last: sums into the stack tile
      part.c = partial;
      part.ldc = int64_t(nv) * vl;
      part.cdt = DType::f32;
      part.bias = nullptr;
      part.act = Activation::none;
      part.accumulate = false;
      for (int64_t i = 0; i < batch; i += items) {
        for (int64_t k0 = 0; k0 < d.k; k0 += kc) {
          TileArgs& u = i + items >= batch && k0 + kc >= d.k ? t : part;
          u.a = a.from(i);
          u.b = b.from(i);
          u.batch = std::min(items, batch - i);
          u.k = std::min(kc, d.k - k0);
          u.a_off = i0 * d.lda + k0;
          u.b_off = (bf16 ? 2 * j0 + k0 / 2 * d.ldb : j0 + k0 * d.ldb);
          if (&u == &t) u.partial = partial;
          row[rows - 1](u);
          part.accumulate = true;
        }
      }
      t.partial = nullptr;
    }
  }
}

}  // namespace
}  // namespace jb
