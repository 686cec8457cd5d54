// The AMX variant of the bf16 BRGEMM, written against a tile unit T: the hardware's
// (kernel_amx.cc, compiled with -mamx-tile -mamx-bf16) or the software model the C++ tests
// run on every host (cpp/tests/amx_model.h), so that the blocking, tile shapes and edges
// below are checked whatever CPU runs the tests.
//
// 32 x 32 macro tiles of C are held in four tile registers (2 x 2 tiles of 16 x 16 fp32)
// across the whole batch and K loop, fed by two A tiles (16 rows x 32 k) and two B tiles
// (16 VNNI pair rows x 16 columns) per 32-wide k step. B's VNNI-2 layout is exactly the
// AMX B-tile layout, so B is read in place.
//
// Each macro tile accumulates into C itself (fp32, no epilogue) or into a 32 x 32 fp32 tile
// on the stack; a k remainder (K % 32) is finished by T::rest(), the vector kernel,
// accumulating onto that, and only then do bias, activation and the conversion to C's
// dtype run, once. Nothing is allocated.
//
// T provides: configure(const TileConfig&), release(), rest() (the BrgemmFn for k
// remainders), and per tile register R (compile-time, as the instructions encode it):
// zero<R>(), load<R>(ptr, stride bytes), store<R>(ptr, stride bytes), dot<C, A, B>().
#pragma once

#include <algorithm>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "brgemm/activation.h"
#include "brgemm/brgemm.h"

namespace jb {
namespace {

// LDTILECFG's 64-byte operand (palette 1: 8 tiles of at most 16 rows x 64 bytes).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile registers: C00 C01 C10 C11 = 0..3, A0 A1 = 4, 5, B0 B1 = 6, 7.
inline TileConfig config_for(int rows0, int rows1, int cols0, int cols1) {
  TileConfig cfg;
  const int rows[2] = {rows0, rows1}, cols[2] = {cols0, cols1};
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j)
      if (rows[i] && cols[j]) cfg.rows[2 * i + j] = uint8_t(rows[i]), cfg.colsb[2 * i + j] = uint16_t(4 * cols[j]);
  for (int i = 0; i < 2; ++i)
    if (rows[i]) cfg.rows[4 + i] = uint8_t(rows[i]), cfg.colsb[4 + i] = 64;
  for (int j = 0; j < 2; ++j)
    if (cols[j]) cfg.rows[6 + j] = 16, cfg.colsb[6 + j] = uint16_t(4 * cols[j]);
  return cfg;
}

// The tiles restart from zero every kChainK products of a reduction and their sums join s in
// fp32: a tile accumulates a long chain of products less accurately than FMAs do (a 65,536-long
// bf16 reduction: 5.6x the error of vdpbf16ps's on a model-167 Xeon, docs/fc.md). Reductions of
// up to kChainK products, most layers', never leave the tiles.
constexpr int64_t kChainK = 4096;

// s[rows x cols] (row stride lds) += part (row stride 32), or = part when !add.
inline void add_part(float* s, int64_t lds, const float* part, int rows, int cols, bool add) {
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) s[i * lds + j] = add ? s[i * lds + j] + part[i * 32 + j] : part[i * 32 + j];
}

// One macro tile: s (fp32, row stride lds) = (ACC ? s : 0) + sum_i A_i[rows] @ B_i[cols]
// over k32 k's. Edge tiles are configured with fewer rows / columns, so their loads and
// stores touch only the valid part of s (rows x cols).
template <class T, bool TWO_ROWS, bool TWO_COLS>
void macro_tile(const BatchWalk& a, const BatchWalk& b, int64_t batch, int64_t k32, int64_t lda, int64_t ldb,
                int64_t i0, int64_t j0, float* s, int64_t lds, bool acc, int rows, int cols) {
  const int64_t sb = lds * 4;
  auto store_to = [](float* d, int64_t db) {
    T::template store<0>(d, db);
    if (TWO_COLS) T::template store<1>(d + 16, db);
    if (TWO_ROWS) T::template store<2>(d + 16 * (db / 4), db);
    if (TWO_ROWS && TWO_COLS) T::template store<3>(d + 16 * (db / 4) + 16, db);
  };
  if (acc) {
    T::template load<0>(s, sb);
    if (TWO_COLS) T::template load<1>(s + 16, sb);
    if (TWO_ROWS) T::template load<2>(s + 16 * lds, sb);
    if (TWO_ROWS && TWO_COLS) T::template load<3>(s + 16 * lds + 16, sb);
  }
  // s_holds: s holds a partial sum that the tiles do not (after a restart)
  bool s_holds = false, zeroed = acc;
  int64_t chain = 0;  // products in the tiles since they last started from zero
  alignas(64) float part[32 * 32];
  for (int64_t bi = 0; bi < batch; ++bi) {
    const uint16_t* ai = reinterpret_cast<const uint16_t*>(a.at(bi)) + i0 * lda;
    const uint16_t* bp = reinterpret_cast<const uint16_t*>(b.at(bi)) + 2 * j0;
    for (int64_t k = 0; k < k32; k += 32) {
      if (!zeroed || chain == kChainK) {
        if (zeroed) {  // a full chain: into s, in fp32
          store_to(part, 32 * 4);
          add_part(s, lds, part, rows, cols, s_holds);
          s_holds = true;
        }
        T::template zero<0>();
        if (TWO_COLS) T::template zero<1>();
        if (TWO_ROWS) T::template zero<2>();
        if (TWO_ROWS && TWO_COLS) T::template zero<3>();
        zeroed = true, chain = 0;
      }
      T::template load<4>(ai + k, lda * 2);
      if (TWO_ROWS) T::template load<5>(ai + 16 * lda + k, lda * 2);
      T::template load<6>(bp + (k / 2) * ldb, ldb * 2);
      if (TWO_COLS) T::template load<7>(bp + (k / 2) * ldb + 32, ldb * 2);
      T::template dot<0, 4, 6>();
      if (TWO_COLS) T::template dot<1, 4, 7>();
      if (TWO_ROWS) T::template dot<2, 5, 6>();
      if (TWO_ROWS && TWO_COLS) T::template dot<3, 5, 7>();
      chain += 32;
    }
  }
  if (!zeroed) {  // no k at all: s = 0
    T::template zero<0>();
    if (TWO_COLS) T::template zero<1>();
    if (TWO_ROWS) T::template zero<2>();
    if (TWO_ROWS && TWO_COLS) T::template zero<3>();
  }
  if (!s_holds) return store_to(s, sb);
  store_to(part, 32 * 4);
  add_part(s, lds, part, rows, cols, true);
}

// f32_to_bf16's bits without its branch, so that the epilogue's loop vectorizes (as a scalar
// loop it was 12 % of a bf16 layer step's samples).
inline uint16_t bf16_bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t nearest = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? quiet : nearest);
}

// A row of fp32 values as bf16_bits_of's bits, 16 lanes at a time where the unit is compiled
// for AVX-512 (the hardware tiles' unit; GCC left the scalar loop scalar: 28 % of a bf16
// forward's samples at a 768-long reduction on a model-167 Xeon).
inline void row_to_bf16(const float* src, uint16_t* dst, int cols) {
  int j = 0;
#if defined(__AVX512F__)
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
  const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i quiet = _mm512_set1_epi32(0x40);
  for (; j + 16 <= cols; j += 16) {
    const __m512i u = _mm512_loadu_si512(src + j), hi = _mm512_srli_epi32(u, 16);
    const __m512i nearest = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, half), _mm512_and_si512(hi, one)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs), inf);
    const __m512i bits = _mm512_mask_blend_epi32(nan, nearest, _mm512_or_si512(hi, quiet));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), _mm512_cvtepi32_epi16(bits));
  }
#endif
  for (; j < cols; ++j) dst[j] = bf16_bits_of(src[j]);
}

// Bias, activation and the conversion to C's dtype of a finished fp32 tile s.
inline void finish_amx_tile(const BrgemmDesc& d, float* s, int64_t lds, int rows, int cols,
                            const float* bias, char* c) {
  for (int i = 0; i < rows; ++i) {
    float* row = s + i * lds;
    if (bias)
      for (int j = 0; j < cols; ++j) row[j] += bias[j];
    apply_activation(d.act, row, cols);
    if (d.c == DType::f32) {
      std::memcpy(reinterpret_cast<float*>(c) + i * d.ldc, row, size_t(cols) * sizeof(float));
    } else {
      row_to_bf16(row, reinterpret_cast<uint16_t*>(c) + i * d.ldc, cols);
    }
  }
}

template <class T>
void run_amx_bf16(const BrgemmDesc& d, const BatchWalk& a, const BatchWalk& b, int64_t batch,
                  void* c, const float* bias) {
  const int64_t k32 = d.k / 32 * 32;
  // fp32 C without an epilogue or remainder is accumulated in place; everything else goes
  // through a stack tile, so that rounding and the epilogue happen once, after the whole
  // reduction.
  const bool direct = d.c == DType::f32 && k32 == d.k && !bias && d.act == Activation::none && k32 > 0;
  using MacroFn = decltype(&macro_tile<T, true, true>);
  static constexpr MacroFn kMacro[2][2] = {{macro_tile<T, false, false>, macro_tile<T, false, true>},
                                           {macro_tile<T, true, false>, macro_tile<T, true, true>}};
  alignas(64) float tile[32 * 32];
  int last[4] = {-1, -1, -1, -1};
  for (int64_t j0 = 0; j0 < d.n; j0 += 32) {
    const int cols = int(std::min<int64_t>(32, d.n - j0));
    const int cols0 = std::min(cols, 16), cols1 = cols - cols0;
    for (int64_t i0 = 0; i0 < d.m; i0 += 32) {
      const int rows = int(std::min<int64_t>(32, d.m - i0));
      const int rows0 = std::min(rows, 16), rows1 = rows - rows0;
      char* cij = static_cast<char*>(c) + (i0 * d.ldc + j0) * int64_t(dtype_size(d.c));
      float* s = direct ? reinterpret_cast<float*>(cij) : tile;
      const int64_t lds = direct ? d.ldc : 32;
      bool acc = d.accumulate;  // whether s holds a partial sum
      if (acc && !direct)
        for (int i = 0; i < rows; ++i)
          for (int j = 0; j < cols; ++j)
            s[i * lds + j] = d.c == DType::f32 ? reinterpret_cast<const float*>(cij)[i * d.ldc + j]
                                               : bf16_to_f32(reinterpret_cast<const uint16_t*>(cij)[i * d.ldc + j]);
      if (k32 > 0) {
        const int shape[4] = {rows0, rows1, cols0, cols1};
        if (!std::equal(shape, shape + 4, last)) {  // edges need their own tile shapes
          T::configure(config_for(rows0, rows1, cols0, cols1));
          std::copy(shape, shape + 4, last);
        }
        kMacro[rows1 > 0][cols1 > 0](a, b, batch, k32, d.lda, d.ldb, i0, j0, s, lds, acc, rows, cols);
        acc = true;
      }
      if (direct) continue;
      // The k remainder, bias, activation and the store to C, by the vector kernel on this
      // tile's rows and columns (k = 0 with no remainder: bias and activation only).
      BrgemmDesc rest = d;
      rest.m = rows;
      rest.n = cols;
      rest.k = d.k - k32;
      BatchWalk ra = a, rb = b;
      ra.shift += (i0 * d.lda + k32) * 2;
      rb.shift += ((k32 / 2) * d.ldb + 2 * j0) * 2;
      if (acc) {  // continue from the fp32 tile
        rest.lda = d.lda;
        rest.ldc = lds;
        rest.c = DType::f32;
        rest.accumulate = true;
        rest.bias = false;
        rest.act = Activation::none;
        if (rest.k > 0) T::rest()(rest, ra, rb, batch, s, nullptr);
        finish_amx_tile(d, s, lds, rows, cols, bias ? bias + j0 : nullptr, cij);
      } else {  // nothing accumulated yet (k < 32): the vector kernel does the whole block
        T::rest()(rest, ra, rb, batch, cij, bias ? bias + j0 : nullptr);
      }
    }
  }
  if (k32 > 0) T::release();
}

}  // namespace
}  // namespace jb
