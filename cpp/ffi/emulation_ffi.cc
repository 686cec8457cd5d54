// XLA FFI handler of ops/emulation.py's exact_on_infinity: whether any value of the float32
// operands is beyond the bf16 split's reach (layers/common/emulation.h), read by both cores
// at memory speed, where XLA's reduction of the same test ran at ~4 GB/s on one (3.5 of a
// bf16_3x MLP step's 22 ms on a model-167 Xeon).
#include <algorithm>

#include "ffi/ffi_common.h"
#include "layers/common/blocking.h"
#include "layers/common/emulation.h"

namespace jb {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_util;

constexpr int64_t kChunk = int64_t(1) << 16;  // values per work item

ffi::Error beyond_impl(Launch& launch, ffi::RemainingArgs arrays, ffi::Result<ffi::Buffer<ffi::PRED>> out) {
  Job job;
  job.name = "beyond_bf16";
  bool* flag = out->typed_data();
  *flag = false;
  const Isa isa = dispatch().isa;
  for (size_t i = 0; i < arrays.size(); ++i) {
    auto a = arrays.get<ffi::AnyBuffer>(i);
    if (!a.has_value() || a->element_type() != ffi::F32)
      return invalid("beyond_bf16: operand " + std::to_string(i) + " must be a float32 array");
    const float* x = static_cast<const float*>(a->untyped_data());
    const int64_t n = int64_t(a->element_count());
    job.flops += double(4 * n);  // bytes read: it is memory-bound
    job.add(ceil_div(n, kChunk), [x, n, flag, isa](int64_t c) {
      const int64_t i0 = c * kChunk;
      if (emulation::beyond_bf16(x + i0, std::min(kChunk, n - i0), isa)) __atomic_store_n(flag, true, __ATOMIC_RELAXED);
    });
  }
  return guarded("beyond_bf16", [&] { launch(std::move(job)); });
}

ffi::Future beyond_async(ffi::ThreadPool pool, ffi::RemainingArgs arrays, ffi::Result<ffi::Buffer<ffi::PRED>> out) {
  Launch launch(pool);
  return launch.finish(beyond_impl(launch, arrays, out));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_beyond_bf16, beyond_async,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().RemainingArgs().Ret<ffi::Buffer<ffi::PRED>>());

}  // namespace jb
