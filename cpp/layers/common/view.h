// Typed views of dense multi-dimensional arrays (row-major), like LIBXSMM's VLA views, so
// that a blocked loop nest reads as loops: v(i, j, k, l) is an element, v.at(i, j) the
// address of the sub-array that a prefix of the indices selects (e.g. one block of a
// [Kb][Cb][bc][bk] weight tensor). View<char, N> with a last dim of a block's bytes views
// blocks of a dtype chosen at run time; AnyView is a whole operand of such a dtype.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "brgemm/brgemm.h"

namespace jb {

template <class T, size_t N>
class View {
 public:
  View(T* data, const std::array<int64_t, N>& dims) : data_(data), dims_(dims) {
    int64_t s = 1;
    for (size_t d = N; d-- > 0;) {
      strides_[d] = s;
      s *= dims_[d];
    }
  }
  template <class... I>
  T* at(I... idx) const {
    static_assert(sizeof...(I) <= N, "too many indices");
    const int64_t i[] = {int64_t(idx)..., 0};
    int64_t off = 0;
    for (size_t d = 0; d < sizeof...(I); ++d) off += i[d] * strides_[d];
    return data_ + off;
  }
  template <class... I>
  T& operator()(I... idx) const {
    static_assert(sizeof...(I) == N, "an element needs every index");
    return *at(idx...);
  }
  int64_t dim(size_t d) const { return dims_[d]; }
  int64_t stride(size_t d) const { return strides_[d]; }  // in elements of T
  int64_t size() const { return dims_[0] * strides_[0]; }

 private:
  T* data_;
  std::array<int64_t, N> dims_;
  std::array<int64_t, N> strides_;
};

// A dense operand whose dtype (fp32 or bf16) is chosen at run time: its base address and
// dtype. V is void for an output, const void for an input; a null view is an absent operand.
template <class V>
struct AnyView {
  using Byte = std::conditional_t<std::is_const_v<V>, const char, char>;
  V* data = nullptr;
  DType dt = DType::f32;
  Byte* at(int64_t elem) const { return static_cast<Byte*>(data) + elem * int64_t(dtype_size(dt)); }
  explicit operator bool() const { return data != nullptr; }
  // An output read as an input.
  template <class W = V, class = std::enable_if_t<!std::is_const_v<W>>>
  operator AnyView<const void>() const {
    return {data, dt};
  }
};
using InView = AnyView<const void>;
using OutView = AnyView<void>;

}  // namespace jb
