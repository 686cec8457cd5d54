#include "layers/common/emulation.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "layers/common/operand.h"
#include "layers/common/reblock.h"
#include "layers/common/transpose.h"

#if defined(JB_X86)
#include <immintrin.h>
#endif

namespace jb::emulation {

namespace {

// bfloat16's largest finite value, 0x7f7f0000 as fp32.
constexpr float kBf16Largest = 3.3895313892515355e38f;

// The split's rounding: bf16, nearest even, NaN quieted, and values below float32's normal
// range read as zero of their sign, as vcvtneps2bf16 and the bf16 multipliers (vdpbf16ps,
// AMX) read them; so every ISA makes the same parts. Branchless, so that loops vectorize.
inline float round_bf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
  const uint32_t nearest = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u, quiet = (u | 0x00400000u) & 0xffff0000u;
  u = (u & 0x7fffffffu) > 0x7f800000u ? quiet : nearest;
  std::memcpy(&v, &u, 4);
  return v;
}

// Part P of v: what parts 0 .. P - 1 leave, rounded to bf16 (exact in it).
inline float part(float v, int p) {
  for (int q = 0; q < p; ++q) v -= round_bf16(v);
  return round_bf16(v);
}

// Where a split writes: parts [first, last) of a block of prows x pcols values in kd, rows
// (or, with vnni, pairs of rows) ldd elements apart, part p at dst + (p - first) * step.
struct Out {
  void* dst;
  DType kd;
  bool vnni;
  int64_t ldd, step;
  int first, last;
};

// The parts of a rows x cols fp32 block, zero beyond it up to prows x pcols: element (r, j) at
// src[r * lds + j], or src[j * lds + r] when `trans`. One element at a time.
void split_scalar(const float* src, int64_t lds, bool trans, int64_t rows, int64_t cols, int64_t prows,
                  int64_t pcols, const Out& o) {
  with_type(o.kd, [&](auto ts) {
    using T = decltype(ts);
    const int64_t pr = o.vnni ? (prows + 1) / 2 * 2 : prows;
    for (int64_t r = 0; r < pr; ++r)
      for (int64_t j = 0; j < pcols; ++j) {
        float x = r < rows && j < cols ? src[trans ? j * lds + r : r * lds + j] : 0.0f;
        const int64_t at = o.vnni ? (r / 2) * o.ldd + 2 * j + (r & 1) : r * o.ldd + j;
        for (int p = 0; p < o.last; ++p) {
          const float h = round_bf16(x);
          x -= h;
          if (p >= o.first) static_cast<T*>(o.dst)[(p - o.first) * o.step + at] = from_f32<T>(h);
        }
      }
  });
}

#if defined(JB_X86)
// JB_TARGET_AVX512 and bf16: a superset of its features, so that transpose.h inlines here.
#define JB_TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")))

// The first n of 16 lanes.
JB_TARGET_BF16 inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

JB_TARGET_BF16 inline __m512 load(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(lanes(n), p); }

// 16 bf16 values as fp32.
JB_TARGET_BF16 inline __m512 widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Where vcvtne2ps2bf16 and vpermw make and store the parts of 16 columns: element e of the
// block (the first of the 16) and the columns to store (the rest are padding beyond pcols).
// LAST (o.last) is a template constant, so the part loops unroll.
template <int LAST>
struct Split16 {
  explicit Split16(const Out& o) : o(o), es(int64_t(dtype_size(o.kd))) {
    for (int p = 0; p < LAST; ++p) part[p] = static_cast<char*>(o.dst) + (p - o.first) * o.step * es;
  }
  const Out o;  // a copy: stores through part[] cannot alias it, so its fields stay in registers
  const int64_t es;
  char* part[LAST];  // part p's block (p >= o.first)
  // Rows r, r + 1 (x0, x1) as VNNI pairs: word j = (row r, row r + 1) of column j.
  JB_TARGET_BF16 void pairs(__m512 x0, __m512 x1, int64_t e, __mmask16 store) const {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                           22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i high = _mm512_set1_epi32(int(0xffff0000u));
#pragma GCC unroll 3
    for (int p = 0; p < LAST; ++p) {
      const __m512i w = _mm512_permutexvar_epi16(order, __m512i(_mm512_cvtne2ps_pbh(x1, x0)));
      if (p + 1 < LAST) {
        x0 = _mm512_sub_ps(x0, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
        x1 = _mm512_sub_ps(x1, _mm512_castsi512_ps(_mm512_and_si512(w, high)));
      }
      if (p >= o.first) _mm512_mask_storeu_epi32(part[p] + e * es, store, w);
    }
  }
  // One VNNI row of 16 columns given as float pairs, (row r, row r + 1) of columns 0-7 in lo
  // and of 8-15 in hi: vcvtne2ps2bf16 writes them in VNNI order as they stand.
  JB_TARGET_BF16 void pair_row(__m512 lo, __m512 hi, int64_t e, __mmask16 store) const {
#pragma GCC unroll 3
    for (int p = 0; p < LAST; ++p) {
      const __m512i w = __m512i(_mm512_cvtne2ps_pbh(hi, lo));
      if (p + 1 < LAST) {
        lo = _mm512_sub_ps(lo, widen(_mm512_castsi512_si256(w)));
        hi = _mm512_sub_ps(hi, widen(_mm512_extracti64x4_epi64(w, 1)));
      }
      if (p >= o.first) _mm512_mask_storeu_epi32(part[p] + e * es, store, w);
    }
  }
  // One row's 16 values, as bf16 or as fp32 parts.
  JB_TARGET_BF16 void row(__m512 x, int64_t e, __mmask16 store) const {
#pragma GCC unroll 3
    for (int p = 0; p < LAST; ++p) {
      const __m256i h = __m256i(_mm512_cvtneps_pbh(x));
      const __m512 hf = widen(h);
      x = _mm512_sub_ps(x, hf);
      if (p < o.first) continue;
      if (o.kd == DType::bf16) _mm256_mask_storeu_epi16(part[p] + e * es, store, h);
      else _mm512_mask_storeu_ps(part[p] + e * es, store, hf);
    }
  }
};

// split_scalar with vcvtne2ps2bf16 (vcvtneps2bf16 for single rows); a transposed source in
// tiles transposed in registers. Tails and padding by masked loads and stores.
template <int LAST>
JB_TARGET_BF16 void split_simd(const float* src, int64_t lds, bool trans, int64_t rows, int64_t cols,
                               int64_t prows, int64_t pcols, const Out& o) {
  const Split16<LAST> out(o);
  if (trans && o.vnni) {
    // A source row holds a column's rows in order, so each VNNI pair (r, r + 1) is a 64-bit
    // word: 8 x 8 transposes of words make whole VNNI rows, with no 16-bit shuffles. Column
    // strips outermost: 16 source rows read on as streams into a panel-sized block (a 4096 x
    // 4096 weight in 256 x 128 blocks 1.4x faster than row strips outermost).
    __m512i g[2][8];
    for (int64_t j0 = 0; j0 < pcols; j0 += 16)
      for (int64_t r0 = 0; r0 < prows; r0 += 16) {
#pragma GCC unroll 16
        for (int c = 0; c < 16; ++c)  // column j0 + c: pairs of rows r0 .. r0 + 15
          g[c / 8][c % 8] = _mm512_castps_si512(load(src + (j0 + c) * lds + r0, j0 + c < cols ? rows - r0 : 0));
        transpose8x64(g[0]);
        transpose8x64(g[1]);
        for (int i = 0; i < 8 && r0 + 2 * i < prows; ++i)
          out.pair_row(_mm512_castsi512_ps(g[0][i]), _mm512_castsi512_ps(g[1][i]), (r0 / 2 + i) * o.ldd + 2 * j0,
                       lanes(pcols - j0));
      }
    return;
  }
  if (trans) {  // plain rows: 16 x 16 transposes of 32-bit words
    __m512i t[16];
    for (int64_t r0 = 0; r0 < prows; r0 += 16)
      for (int64_t j0 = 0; j0 < pcols; j0 += 16) {
        for (int i = 0; i < 16; ++i)  // source row j0 + i: rows r0 .. r0 + 15 of column j0 + i
          t[i] = j0 + i < cols ? _mm512_castps_si512(load(src + (j0 + i) * lds + r0, rows - r0)) : _mm512_setzero_si512();
        transpose16(t);
        for (int w = 0; w < 16 && r0 + w < prows; ++w)
          out.row(_mm512_castsi512_ps(t[w]), (r0 + w) * o.ldd + j0, lanes(pcols - j0));
      }
    return;
  }
  const int64_t full = std::min(cols, pcols) / 16 * 16;  // columns of whole, unmasked vectors
  for (int64_t r = 0; r < prows; r += o.vnni ? 2 : 1) {
    const float* s0 = src + r * lds;
    const bool in0 = r < rows, in1 = r + 1 < rows;
    if (o.vnni && in1) {  // both rows real: the bulk of every block
      const int64_t e = r / 2 * o.ldd;
      for (int64_t j = 0; j < full; j += 16)
        out.pairs(_mm512_loadu_ps(s0 + j), _mm512_loadu_ps(s0 + lds + j), e + 2 * j, __mmask16(0xffff));
      for (int64_t j = full; j < pcols; j += 16)
        out.pairs(load(s0 + j, cols - j), load(s0 + lds + j, cols - j), e + 2 * j, lanes(pcols - j));
      continue;
    }
    for (int64_t j = 0; j < pcols; j += 16) {
      const __m512 x0 = in0 ? load(s0 + j, cols - j) : _mm512_setzero_ps();
      if (o.vnni) out.pairs(x0, _mm512_setzero_ps(), r / 2 * o.ldd + 2 * j, lanes(pcols - j));
      else out.row(x0, r * o.ldd + j, lanes(pcols - j));
    }
  }
}

// |x| > bf16's largest, NaN excluded (an unordered compare is false).
JB_TARGET_BF16 bool beyond_simd(const float* x, int64_t n) {
  const __m512 largest = _mm512_set1_ps(kBf16Largest);
  __mmask16 seen = 0;
  for (int64_t i = 0; i < n; i += 16)
    seen |= _mm512_cmp_ps_mask(_mm512_abs_ps(load(x + i, n - i)), largest, _CMP_GT_OQ);
  return seen != 0;
}
#endif  // JB_X86

// The parts of a block (split_scalar's arguments): vectorized where the ISA converts to bf16
// itself, the same bits either way.
void split(const float* src, int64_t lds, bool trans, int64_t rows, int64_t cols, int64_t prows, int64_t pcols,
           const Out& o, Isa isa) {
#if defined(JB_X86)
  if (isa >= Isa::avx512) {
    auto run = o.last == 1 ? split_simd<1> : o.last == 2 ? split_simd<2> : split_simd<3>;
    return run(src, lds, trans, rows, cols, prows, pcols, o);
  }
#endif
  (void)isa;
  split_scalar(src, lds, trans, rows, cols, prows, pcols, o);
}

}  // namespace

Terms terms(int64_t products) {
  Terms t;
  if (products == 0) return t;
  // (part of A, part of B), smallest products first: ops/emulation.py's TERMS.
  static const int8_t kOne[][2] = {{0, 0}};
  static const int8_t kThree[][2] = {{0, 1}, {1, 0}, {0, 0}};
  static const int8_t kSix[][2] = {{1, 1}, {0, 2}, {2, 0}, {0, 1}, {1, 0}, {0, 0}};
  const int8_t(*list)[2] = products == 1 ? kOne : products == 3 ? kThree : products == 6 ? kSix : nullptr;
  if (!list) throw std::invalid_argument("emulation: " + std::to_string(products) + " products; 0, 1, 3 or 6");
  t.count = int(products);
  t.split = true;
  t.parts[0] = t.parts[1] = products == 6 ? 3 : products == 3 ? 2 : 1;
  for (int i = 0; i < t.count; ++i) t.of[0][i] = list[i][0], t.of[1][i] = list[i][1];
  return t;
}

void pack(const Terms& t, int side, const void* src, DType src_dt, int64_t ld, bool trans, int64_t rows,
          int64_t cols, int64_t prows, int64_t pcols, DType kd, bool vnni, void* dst, int64_t step, Isa isa,
          float* tmp) {
  if (!t.split) return reblock::pack(src, src_dt, ld, trans, rows, cols, prows, pcols, kd, vnni, dst, isa);
  vnni = vnni && kd == DType::bf16;
  const Out o{dst, kd, vnni, vnni ? 2 * pcols : pcols, step, 0, t.parts[side]};
  // fp32 is split as it is read; a bf16 source (whose parts past the first are zero) is
  // widened by reblock::pack first.
  if (src_dt == DType::f32) return split(static_cast<const float*>(src), ld, trans, rows, cols, prows, pcols, o, isa);
  reblock::pack(src, src_dt, ld, trans, rows, cols, prows, pcols, DType::f32, false, tmp, isa);
  split(tmp, pcols, false, prows, pcols, prows, pcols, o, isa);
}

void split_rows(const Terms& t, int side, const float* src, int64_t lds, void* dst, DType kd, int64_t ldd,
                int64_t step, int64_t rows, int64_t cols, int64_t zero_to) {
  split(src, lds, false, rows, cols, rows, std::max(cols, zero_to), {dst, kd, false, ldd, step, 0, t.parts[side]},
        best_isa());
}

void part_of(const float* src, int p, void* dst, DType kd, int64_t n, int64_t run, int64_t dst_run) {
  if (run <= 0) run = dst_run = n;
  const int64_t runs = run ? n / run : 0;
  split(src, run, false, runs, run, runs, run, {dst, kd, false, dst_run, 0, p, p + 1}, best_isa());
}

bool beyond_bf16(const float* x, int64_t n, Isa isa) {
#if defined(JB_X86)
  if (isa >= Isa::avx512) return beyond_simd(x, n);
#endif
  (void)isa;
  bool seen = false;
  for (int64_t i = 0; i < n; ++i) seen |= std::fabs(x[i]) > kBf16Largest;
  return seen;
}

void pack_stacked(const Terms& t, int side, int64_t unit, const float* src, int64_t ld, bool trans, int64_t row0,
                  int64_t rows, int64_t cols, int64_t prows, int64_t pcols, DType kd, bool vnni, void* dst, Isa isa,
                  float* tmp) {
  std::memset(tmp, 0, size_t(prows * pcols) * sizeof(float));
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t u = row0 + i, q = u % unit, p = t.of[side][u / unit];
    for (int64_t j = 0; j < cols; ++j) tmp[i * pcols + j] = part(src[trans ? j * ld + q : q * ld + j], p);
  }
  reblock::pack(tmp, DType::f32, pcols, false, prows, pcols, prows, pcols, kd, vnni, dst, isa);
}

}  // namespace jb::emulation
