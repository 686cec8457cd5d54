#include "layers/common/emulation.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "layers/common/reblock.h"

namespace jb::emulation {

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
      part[e] = bf16_to_f32(f32_to_bf16(rest[e]));
      rest[e] -= part[e];
    }
    reblock::pack(part, DType::f32, pcols, false, prows, pcols, prows, pcols, kd, vnni,
                  out + p * step * int64_t(dtype_size(kd)), isa);
  }
}

void split_rows(const Terms& t, int side, const float* src, int64_t lds, void* dst, DType kd, int64_t ldd,
                int64_t step, int64_t rows, int64_t cols, int64_t zero_to) {
  const int64_t es = int64_t(dtype_size(kd));
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = src + r * lds;
    for (int p = 0; p < t.parts[side]; ++p) {
      char* d = static_cast<char*>(dst) + (p * step + r * ldd) * es;
      for (int64_t j = 0; j < cols; ++j) {
        float rest = s[j];  // what parts 0 .. p - 1 leave
        for (int q = 0; q < p; ++q) rest -= bf16_to_f32(f32_to_bf16(rest));
        const uint16_t part = f32_to_bf16(rest);
        if (kd == DType::bf16) reinterpret_cast<uint16_t*>(d)[j] = part;
        else reinterpret_cast<float*>(d)[j] = bf16_to_f32(part);
      }
      if (zero_to > cols) std::memset(d + cols * es, 0, size_t(zero_to - cols) * size_t(es));
    }
  }
}

void part_of(const float* src, int p, uint16_t* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    float rest = src[j];
    for (int q = 0; q < p; ++q) rest -= bf16_to_f32(f32_to_bf16(rest));
    dst[j] = f32_to_bf16(rest);
  }
}

}  // namespace jb::emulation
