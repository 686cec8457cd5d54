// FFI handler of the peak probe: out.size() work items of `iters` iterations each, spread
// over XLA's pool exactly as the kernels are, so the probe sees the same threads.
#include "brgemm/peak.h"
#include "ffi/ffi_common.h"

namespace jb {
namespace {

namespace ffi = xla::ffi;

ffi::Error peak_impl(ffi::ThreadPool pool, int64_t iters, bool bf16,
                     ffi::Result<ffi::Buffer<ffi::F32>> out) {
#if defined(JB_X86)
  if (best_isa() != Isa::avx512) return ffi_util::invalid("peak probe: needs AVX-512 with BF16");
  float* sink = out->typed_data();
  parallel_for(ffi_util::executor(pool), int64_t(out->element_count()), [&](int64_t i) {
    sink[i] = peak_loop_avx512(bf16 ? DType::bf16 : DType::f32, iters);
  });
  return ffi::Error::Success();
#else
  return ffi_util::invalid("peak probe: x86-64 only");
#endif
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_peak_probe, peak_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<int64_t>("iters")
                                  .Attr<bool>("bf16")
                                  .Ret<ffi::Buffer<ffi::F32>>());

}  // namespace jb
