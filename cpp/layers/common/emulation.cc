#include "layers/common/emulation.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "layers/common/operand.h"
#include "layers/common/reblock.h"

namespace jb::emulation {

namespace {

// v rounded to bf16 as f32_to_bf16 does, without a branch (so that loops vectorize).
inline float round_bf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint32_t nearest = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u, quiet = (u | 0x00400000u) & 0xffff0000u;
  u = (u & 0x7fffffffu) > 0x7f800000u ? quiet : nearest;
  std::memcpy(&v, &u, 4);
  return v;
}

// Part P of v: what parts 0 .. P - 1 leave, rounded to bf16 (exact in it).
template <int P>
inline float part(float v) {
  for (int q = 0; q < P; ++q) v -= round_bf16(v);
  return round_bf16(v);
}

inline float part(float v, int p) { return p == 0 ? part<0>(v) : p == 1 ? part<1>(v) : part<2>(v); }

template <int P, class T>
void part_runs(const float* src, T* dst, int64_t runs, int64_t run, int64_t dst_run) {
  for (int64_t r = 0; r < runs; ++r)
    for (int64_t c = 0; c < run; ++c) {
      const float x = part<P>(src[r * run + c]);
      if constexpr (sizeof(T) == 2) {  // bf16-exact: its high half
        uint32_t u;
        std::memcpy(&u, &x, 4);
        dst[r * dst_run + c] = uint16_t(u >> 16);
      } else {
        dst[r * dst_run + c] = x;
      }
    }
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
  // The block in fp32 (transposed, padded), then each part: what the earlier parts leave,
  // rounded to bf16 (exact in kd), packed from a plain fp32 copy.
  const int64_t n = prows * pcols;
  float *rest = tmp, *part = tmp + n;
  reblock::pack(src, src_dt, ld, trans, rows, cols, prows, pcols, DType::f32, false, rest, isa);
  char* out = static_cast<char*>(dst);
  for (int p = 0; p < t.parts[side]; ++p) {
    for (int64_t e = 0; e < n; ++e) {
      part[e] = round_bf16(rest[e]);
      rest[e] -= part[e];
    }
    reblock::pack(part, DType::f32, pcols, false, prows, pcols, prows, pcols, kd, vnni,
                  out + p * step * int64_t(dtype_size(kd)), isa);
  }
}

void split_rows(const Terms& t, int side, const float* src, int64_t lds, void* dst, DType kd, int64_t ldd,
                int64_t step, int64_t rows, int64_t cols, int64_t zero_to) {
  const int64_t es = int64_t(dtype_size(kd));
  for (int64_t r = 0; r < rows; ++r)
    for (int p = 0; p < t.parts[side]; ++p) {
      char* d = static_cast<char*>(dst) + (p * step + r * ldd) * es;
      part_of(src + r * lds, p, d, kd, cols);
      if (zero_to > cols) std::memset(d + cols * es, 0, size_t(zero_to - cols) * size_t(es));
    }
}

void part_of(const float* src, int p, void* dst, DType kd, int64_t n, int64_t run, int64_t dst_run) {
  if (run <= 0) run = dst_run = n;
  const int64_t runs = run ? n / run : 0;
  with_type(kd, [&](auto ts) {
    using T = decltype(ts);
    T* d = static_cast<T*>(dst);
    if (p == 0) part_runs<0>(src, d, runs, run, dst_run);
    else if (p == 1) part_runs<1>(src, d, runs, run, dst_run);
    else part_runs<2>(src, d, runs, run, dst_run);
  });
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
