// XLA FFI handler of ops/random.py: jax.random.bernoulli's keep-masks (layers/common/random.h)
// on both cores, asynchronous.
//
//   jb_bernoulli  key u32[2] -> keep: pred (...) (cols = 0), or u8 (..., ceil(cols / 8)) bits
//                 packed along rows of `cols` elements
//   attrs threshold (i64: layers/common/random.h), cols (i64)
#include <algorithm>
#include <string>

#include "ffi/ffi_common.h"
#include "layers/common/blocking.h"
#include "layers/common/random.h"

namespace jb {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_util;

constexpr int64_t kChunk = int64_t(1) << 15;  // elements per work item

ffi::Error bernoulli_impl(Launch& launch, ffi::Buffer<ffi::U32> key, ffi::Result<ffi::AnyBuffer> out, int64_t threshold,
                          int64_t cols) {
  const char* op = "jb_bernoulli";
  if (key.element_count() != 2) return invalid(std::string(op) + ": key must be two uint32 words");
  if (threshold < 0 || threshold > (int64_t(1) << 23)) return invalid(std::string(op) + ": threshold out of range");
  const uint32_t k0 = key.typed_data()[0], k1 = key.typed_data()[1], t = uint32_t(threshold);
  auto* data = static_cast<uint8_t*>(out->untyped_data());
  const Isa isa = dispatch().isa;
  Job job;
  job.name = "bernoulli";
  if (cols == 0) {
    if (out->element_type() != ffi::PRED) return invalid(std::string(op) + ": a mask of bytes is bool");
    const int64_t n = int64_t(out->element_count());
    job.flops = double(n) * 100;  // ~100 integer operations per element
    job.add(ceil_div(n, kChunk), [=](int64_t c) {
      const int64_t i0 = c * kChunk;
      random::bernoulli_bytes(k0, k1, t, i0, std::min(kChunk, n - i0), data + i0, isa);
    });
  } else {
    const auto d = out->dimensions();
    if (out->element_type() != ffi::U8 || d.size() == 0 || d[d.size() - 1] != (cols + 7) / 8)
      return invalid(std::string(op) + ": packed bits are uint8 rows of ceil(cols / 8) = " +
                     std::to_string((cols + 7) / 8) + " bytes");
    const int64_t rows = int64_t(out->element_count()) / d[d.size() - 1];
    const int64_t per = std::max<int64_t>(1, kChunk / cols);
    job.flops = double(rows * cols) * 100;
    job.add(ceil_div(rows, per), [=](int64_t c) {
      const int64_t r0 = c * per;
      random::bernoulli_bits(k0, k1, t, cols, r0, std::min(per, rows - r0), data + r0 * ((cols + 7) / 8), isa);
    });
  }
  return guarded(op, [&] { launch(std::move(job)); });
}

ffi::Future bernoulli_async(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> key, ffi::Result<ffi::AnyBuffer> out,
                            int64_t threshold, int64_t cols) {
  Launch launch(pool);
  return launch.finish(bernoulli_impl(launch, key, out, threshold, cols));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_bernoulli, bernoulli_async, ffi_util::bind(bernoulli_async, "threshold", "cols"));

}  // namespace jb
