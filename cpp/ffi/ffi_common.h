// Helpers shared by the thin FFI handlers: the pool adapter, dtype mapping and shape checks.
#pragma once

#include <cstdint>
#include <string>

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

}  // namespace jb::ffi_util
