// Helpers shared by the thin FFI handlers: the pool adapter, dtype mapping, shape checks,
// numpy-style broadcasting of leading dims, and turning C++ exceptions into ffi::Error.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "brgemm/brgemm.h"
#include "parallel/parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace jb::ffi_util {

namespace ffi = xla::ffi;

// XLA's intra-op pool as an Executor for parallel_for. The pool lives for the whole call.
inline Executor executor(ffi::ThreadPool& pool) {
  Executor ex;
  ex.num_threads = std::max<int64_t>(1, pool.num_threads());
  ex.schedule = [&pool](std::function<void()> task) { pool.Schedule(std::move(task)); };
  return ex;
}

// fp32 or bf16, the two dtypes every kernel supports.
inline bool kernel_dtype(ffi::DataType t, DType* out) {
  if (t == ffi::DataType::F32) return *out = DType::f32, true;
  if (t == ffi::DataType::BF16) return *out = DType::bf16, true;
  return false;
}

inline std::string dims_str(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

inline ffi::Error invalid(const std::string& what) { return ffi::Error::InvalidArgument(what); }

// ---------------------------------------------------------------------------------------
// Leading dims. An op's output is (lead.., inner...): its items are the lead dims (vmap's
// batch dims, jb.brgemm's broadcast dims). Each operand's own leading dims broadcast to
// them numpy-style (right-aligned, size 1 repeats), so unbatched operands are read in place.

// How one operand is laid out over the output's leading dims.
struct Lead {
  std::vector<int64_t> stride;  // elements per step of each leading dim; 0 where broadcast
  bool shared = true;           // broadcast over every leading dim (one matrix for all items)
  bool dense = true;            // one distinct, contiguous matrix per item
};

struct Items {
  std::vector<int64_t> dims;  // the output's leading dims
  int64_t count = 1;

  // Element offset of item `item` (row-major over dims) in an operand laid out as l.
  int64_t offset(const Lead& l, int64_t item) const {
    int64_t off = 0;
    for (int64_t d = int64_t(dims.size()) - 1; d >= 0; --d) {
      off += item % dims[d] * l.stride[d];
      item /= dims[d];
    }
    return off;
  }
};

// The items of an output whose last `inner` dims are one item's result.
inline Items items_of(ffi::AnyBuffer::Dimensions out, size_t inner) {
  Items it;
  it.dims.assign(out.begin(), out.end() - inner);
  for (int64_t d : it.dims) it.count *= d;
  return it;
}

// Checks that `dims` is (lead.., inner...) with `inner` trailing dims equal to `want` and
// lead broadcasting to the items' dims; returns its layout. `op` and `name` go into the
// error message.
inline ffi::ErrorOr<Lead> operand(const char* op, const char* name, ffi::AnyBuffer::Dimensions dims,
                                  const std::vector<int64_t>& want, const Items& items) {
  const size_t inner = want.size();
  auto shape_error = [&] {
    std::string w = "(..., ";
    for (size_t i = 0; i < inner; ++i) w += (i ? ", " : "") + std::to_string(want[i]);
    return ffi::Unexpected(invalid(std::string(op) + ": " + name + " has shape " + dims_str(dims) +
                                   ", expected " + w + ")"));
  };
  if (dims.size() < inner || dims.size() - inner > items.dims.size()) return shape_error();
  for (size_t i = 0; i < inner; ++i)
    if (dims[dims.size() - inner + i] != want[i]) return shape_error();
  int64_t matrix = 1;
  for (int64_t w : want) matrix *= w;
  const size_t rank = dims.size() - inner;
  Lead l;
  l.stride.assign(items.dims.size(), 0);
  int64_t stride = matrix;
  for (size_t d = 0; d < items.dims.size(); ++d) {
    const size_t od = items.dims.size() - 1 - d;
    const int64_t size = d < rank ? dims[rank - 1 - d] : 1;
    if (size != items.dims[od] && size != 1)
      return ffi::Unexpected(invalid(std::string(op) + ": the leading dims of " + name + " " +
                                     dims_str(dims) + " do not broadcast to the output's"));
    if (size == 1 && items.dims[od] != 1) l.dense = false;
    if (size != 1) l.shared = false;
    l.stride[od] = size == 1 ? 0 : stride;
    stride *= size;
  }
  return l;
}

// The activation an `act` attribute names, or an error naming the op.
inline ffi::ErrorOr<Activation> activation(const char* op, int32_t code) {
  if (code < 0 || code > int32_t(Activation::tanh))
    return ffi::Unexpected(invalid(std::string(op) + ": unknown activation code " + std::to_string(code)));
  return Activation(code);
}

// ---------------------------------------------------------------------------------------

// Runs a layer call, turning exceptions (bad sizes, out of memory) into an ffi::Error
// instead of letting them cross the C boundary.
template <class F>
ffi::Error guarded(const char* op, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(op) + ": " + e.what());
  }
  return ffi::Error::Success();
}

// Address of element `elems` of a buffer.
inline const char* ptr(const ffi::AnyBuffer& b, int64_t elems) {
  return static_cast<const char*>(b.untyped_data()) + elems * int64_t(ffi::ByteWidth(b.element_type()));
}
inline char* ptr(ffi::Result<ffi::AnyBuffer>& b, int64_t elems) {
  return static_cast<char*>(b->untyped_data()) + elems * int64_t(ffi::ByteWidth(b->element_type()));
}

// `var` = the value of an ffi::ErrorOr expression, or return its error.
#define JB_TRY(var, expr)                              \
  auto var##_or = (expr);                              \
  if (!var##_or.has_value()) return var##_or.error(); \
  const auto& var = var##_or.value()

}  // namespace jb::ffi_util
