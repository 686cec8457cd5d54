// AMX variant of the bf16 BRGEMM: 32 x 32 macro tiles of C held in four tile registers
// (2 x 2 tiles of 16 x 16 fp32) across the whole batch and K loop, fed by two A tiles
// (16 rows x 32 k) and two B tiles (16 VNNI pair rows x 16 columns) per 32-wide k step.
// B's VNNI-2 layout is exactly the AMX B-tile layout, so B is read in place.
//
// Tiles accumulate into C itself (fp32) or an fp32 copy of it (bf16 C); a k remainder
// (K % 32) is finished by the AVX-512 bf16 kernel accumulating onto that, and only then
// do bias, activation and the conversion to C's dtype run, once.
// Compiled with -mamx-tile -mamx-bf16 (+ AVX-512); only called when CPUID and the OS
// (arch_prctl XTILEDATA permission) allow AMX.
#include <immintrin.h>

#include <vector>

#include "brgemm/tile.h"

namespace jb {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile registers: C00 C01 C10 C11 = 0..3, A0 A1 = 4, 5, B0 B1 = 6, 7.
TileConfig config_for(int rows0, int rows1, int cols0, int cols1) {
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

// One macro tile: s (fp32, row stride lds) = (ACC ? s : 0) + sum_i A_i[rows] @ B_i[cols]
// over k32 k's. Edge tiles are configured with fewer rows / columns, so their loads and
// stores touch only the valid part of s.
template <bool TWO_ROWS, bool TWO_COLS>
void macro_tile(const void* const* a, const void* const* b, int64_t batch, int64_t k32,
                int64_t lda, int64_t ldb, int64_t i0, int64_t j0, float* s, int64_t lds, bool acc) {
  const int64_t sb = lds * 4;
  if (acc) {
    _tile_loadd(0, s, sb);
    if (TWO_COLS) _tile_loadd(1, s + 16, sb);
    if (TWO_ROWS) _tile_loadd(2, s + 16 * lds, sb);
    if (TWO_ROWS && TWO_COLS) _tile_loadd(3, s + 16 * lds + 16, sb);
  } else {
    _tile_zero(0);
    if (TWO_COLS) _tile_zero(1);
    if (TWO_ROWS) _tile_zero(2);
    if (TWO_ROWS && TWO_COLS) _tile_zero(3);
  }
  for (int64_t bi = 0; bi < batch; ++bi) {
    const uint16_t* ai = static_cast<const uint16_t*>(a[bi]) + i0 * lda;
    const uint16_t* bp = static_cast<const uint16_t*>(b[bi]) + 2 * j0;
    for (int64_t k = 0; k < k32; k += 32) {
      _tile_loadd(4, ai + k, lda * 2);
      if (TWO_ROWS) _tile_loadd(5, ai + 16 * lda + k, lda * 2);
      _tile_loadd(6, bp + (k / 2) * ldb, ldb * 2);
      if (TWO_COLS) _tile_loadd(7, bp + (k / 2) * ldb + 32, ldb * 2);
      _tile_dpbf16ps(0, 4, 6);
      if (TWO_COLS) _tile_dpbf16ps(1, 4, 7);
      if (TWO_ROWS) _tile_dpbf16ps(2, 5, 6);
      if (TWO_ROWS && TWO_COLS) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, s, sb);
  if (TWO_COLS) _tile_stored(1, s + 16, sb);
  if (TWO_ROWS) _tile_stored(2, s + 16 * lds, sb);
  if (TWO_ROWS && TWO_COLS) _tile_stored(3, s + 16 * lds + 16, sb);
}

using MacroFn = decltype(&macro_tile<true, true>);

void run_amx_bf16(const BrgemmDesc& d, const void* const* a, const void* const* b,
                  int64_t batch, void* c, const float* bias) {
  const int64_t m = d.m, n = d.n, k32 = d.k / 32 * 32;
  // fp32 C is accumulated in place; a bf16 C goes through an fp32 copy, so that rounding
  // happens once, after the whole reduction.
  const bool direct = d.c == DType::f32;
  thread_local std::vector<float> scratch;
  float* s = static_cast<float*>(c);
  int64_t lds = d.ldc;
  if (!direct) {
    scratch.resize(size_t(m * n));
    s = scratch.data();
    lds = n;
    if (d.accumulate)
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) s[i * n + j] = bf16_to_f32(static_cast<const uint16_t*>(c)[i * d.ldc + j]);
  }
  bool acc = d.accumulate;  // whether s already holds a partial sum

  if (k32 > 0) {
    static constexpr MacroFn kMacro[2][2] = {{macro_tile<false, false>, macro_tile<false, true>},
                                             {macro_tile<true, false>, macro_tile<true, true>}};
    int last[4] = {-1, -1, -1, -1};
    for (int64_t j0 = 0; j0 < n; j0 += 32) {
      const int cols = int(std::min<int64_t>(32, n - j0));
      const int cols0 = std::min(cols, 16), cols1 = cols - cols0;
      for (int64_t i0 = 0; i0 < m; i0 += 32) {
        const int rows = int(std::min<int64_t>(32, m - i0));
        const int rows0 = std::min(rows, 16), rows1 = rows - rows0;
        const int shape[4] = {rows0, rows1, cols0, cols1};
        if (!std::equal(shape, shape + 4, last)) {  // edges need their own tile shapes
          const TileConfig cfg = config_for(rows0, rows1, cols0, cols1);
          _tile_loadconfig(&cfg);
          std::copy(shape, shape + 4, last);
        }
        kMacro[rows1 > 0][cols1 > 0](a, b, batch, k32, d.lda, d.ldb, i0, j0, s + i0 * lds + j0, lds, acc);
      }
    }
    _tile_release();
    acc = true;
  }

  BrgemmDesc rest = d;  // the k remainder, bias and activation, on s (fp32)
  rest.k = d.k - k32;
  rest.ldc = lds;
  rest.c = DType::f32;
  rest.accumulate = acc;
  if (!acc && rest.k == 0)  // k == 0: an empty sum
    for (int64_t i = 0; i < m; ++i) std::fill(s + i * lds, s + i * lds + n, 0.f);
  if (rest.k > 0) {
    std::vector<const void*> ra(batch), rb(batch);
    for (int64_t i = 0; i < batch; ++i) {
      ra[i] = static_cast<const uint16_t*>(a[i]) + k32;
      rb[i] = static_cast<const uint16_t*>(b[i]) + (k32 / 2) * d.ldb;
    }
    detail::brgemm_avx512()(rest, ra.data(), rb.data(), batch, s, bias);
  } else if (bias || d.act != Activation::none) {
    for (int64_t i = 0; i < m; ++i) {
      float* row = s + i * lds;
      if (bias)
        for (int64_t j = 0; j < n; ++j) row[j] += bias[j];
      apply_activation(d.act, row, n);
    }
  }
  if (!direct)
    for (int64_t i = 0; i < m; ++i) {
      uint16_t* dst = static_cast<uint16_t*>(c) + i * d.ldc;
      for (int64_t j = 0; j < n; ++j) dst[j] = f32_to_bf16(s[i * n + j]);
    }
}

}  // namespace

BrgemmFn detail::brgemm_amx_bf16() { return &run_amx_bf16; }

}  // namespace jb
