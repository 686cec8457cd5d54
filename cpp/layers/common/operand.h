// Element access for fp32 or bf16 storage, and the A operand of a pass: an activation
// matrix read in place when the kernel can, or copied once into scratch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "brgemm/brgemm.h"
#include "layers/common/blocking.h"
#include "layers/common/emulation.h"

namespace jb {

// Calls f with a value of the storage type of `t` (float or uint16_t), to instantiate
// templated loops for both dtypes.
template <class F>
void with_type(DType t, F&& f) {
  if (t == DType::f32) f(float{});
  else f(uint16_t{});
}

// Address of element i of an array of dtype t.
inline const void* at(const void* p, DType t, int64_t i) {
  return static_cast<const char*>(p) + i * int64_t(dtype_size(t));
}

// acc[j] += the sum over rows of src[r * ld + j] (a bias gradient from a piece of dz),
// summed pairwise over blocks of rows: the rounding error grows with log(rows), not rows.
inline void add_column_sums(const void* src, DType dt, int64_t ld, int64_t rows, int64_t cols, float* acc) {
  constexpr int64_t kRows = 64, kCols = 64;
  with_type(dt, [&](auto ts) {
    using T = decltype(ts);
    const T* t = static_cast<const T*>(src);
    for (int64_t j0 = 0; j0 < cols; j0 += kCols) {
      const int64_t w = std::min(kCols, cols - j0);
      // sum(r0, n, out): out[j] = the sum of n rows from r0, halves summed apart.
      auto sum = [&](auto&& self, int64_t r0, int64_t n, float* out) -> void {
        if (n <= kRows) {
          std::fill(out, out + w, 0.0f);
          for (int64_t r = r0; r < r0 + n; ++r)
            for (int64_t j = 0; j < w; ++j) out[j] += to_f32(t[r * ld + j0 + j]);
          return;
        }
        float half[kCols];
        const int64_t h = (n / 2 + kRows - 1) / kRows * kRows;
        self(self, r0, h, out);
        self(self, r0 + h, n - h, half);
        for (int64_t j = 0; j < w; ++j) out[j] += half[j];
      };
      float total[kCols];
      sum(sum, 0, rows, total);
      for (int64_t j = 0; j < w; ++j) acc[j0 + j] += total[j];
    }
  });
}

// An activation matrix (rows x cols, row-major, rows `ld` apart) as the A operand of a
// BRGEMM: read in place when the kernel can, else copied once (in row chunks, the work
// items of a parallel loop): widened from bf16 for fp32 multiplies, and packed with rows
// padded by a cache line when their stride is a multiple of 4 KiB (the rows of a register
// tile would all fall in one L1 set and evict each other). With terms.split, the copy holds
// the bf16 parts of the fp32 source that `side` multiplies, part p at p * step() elements.
class ActivationOperand {
 public:
  ActivationOperand(DType from, DType to, int64_t rows, int64_t cols, int64_t ld = 0,
                    const emulation::Terms& terms = {}, int side = 0)
      : from_(from), to_(to), rows_(rows), cols_(cols), src_ld_(ld ? ld : cols), terms_(terms), side_(side) {
    const int64_t es = int64_t(dtype_size(to));
    copy_ = terms.split || from != to || padded_ld(src_ld_, size_t(es)) != src_ld_;
    ld_ = copy_ ? padded_ld(cols, size_t(es)) : src_ld_;
    chunk_ = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, cols));
  }
  bool copied() const { return copy_; }
  int64_t ld() const { return ld_; }
  int64_t step() const { return rows_ * ld_; }  // elements from one part to the next
  size_t bytes() const {
    return copy_ ? size_t(rows_ * ld_ * (terms_.split ? terms_.parts[side_] : 1)) * dtype_size(to_) : 0;
  }
  int64_t items() const { return copy_ ? ceil_div(rows_, chunk_) : 0; }
  // Copies row chunk i of src into dst (bytes() long).
  void copy(int64_t i, const void* src, char* dst) const {
    const int64_t r0 = i * chunk_, r1 = std::min(rows_, (i + 1) * chunk_);
    const int64_t fs = int64_t(dtype_size(from_)), ts = int64_t(dtype_size(to_));
    if (terms_.split) {
      emulation::split_rows(terms_, side_, static_cast<const float*>(src) + r0 * src_ld_, src_ld_, dst + r0 * ld_ * ts,
                            to_, ld_, step(), r1 - r0, cols_, cols_);
      return;
    }
    for (int64_t r = r0; r < r1; ++r) {
      const char* s = static_cast<const char*>(src) + r * src_ld_ * fs;
      char* d = dst + r * ld_ * ts;
      if (from_ == to_) {
        std::memcpy(d, s, size_t(cols_) * dtype_size(to_));
      } else {  // bf16 -> fp32
        const uint16_t* sh = reinterpret_cast<const uint16_t*>(s);
        float* df = reinterpret_cast<float*>(d);
        for (int64_t j = 0; j < cols_; ++j) df[j] = bf16_to_f32(sh[j]);
      }
    }
  }

 private:
  DType from_, to_;
  int64_t rows_, cols_, src_ld_, ld_, chunk_;
  emulation::Terms terms_;
  int side_;
  bool copy_;
};

}  // namespace jb
