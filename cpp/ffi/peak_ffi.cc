// FFI handler of the peak probe: out.size() work items of `iters` iterations each, spread
// over XLA's pool exactly as the kernels are, so the probe sees the same threads.
#include <string>
#include <string_view>

#include "brgemm/peak.h"
#include "ffi/ffi_common.h"

namespace jb {
namespace {

namespace ffi = xla::ffi;

// unit: "fma" (fp32 FMA: zmm, or ymm below AVX-512), "vdpbf16ps" (AVX-512 bf16 pairs) or "amx" (bf16 tiles).
ffi::Error peak_impl(ffi::ThreadPool pool, int64_t iters, std::string_view unit,
                     ffi::Result<ffi::Buffer<ffi::F32>> out) {
#if defined(JB_X86)
  const bool amx = unit == "amx", fma = unit == "fma";
  const Isa isa = best_isa();
  if (isa < (amx ? Isa::amx : fma ? Isa::avx2 : Isa::avx512))
    return ffi_util::invalid("peak probe: this CPU (or JAX_BRGEMM_ISA) has no " + std::string(unit));
  if (!amx && unit != "fma" && unit != "vdpbf16ps")
    return ffi_util::invalid("peak probe: unit must be fma, vdpbf16ps or amx");
  float* sink = out->typed_data();
  parallel_for(ffi_util::executor(pool), int64_t(out->element_count()), [&](int64_t i) {
    if (amx) sink[i] = peak_loop_amx(iters);
    else if (fma && isa < Isa::avx512) sink[i] = peak_loop_avx2(iters);
    else sink[i] = peak_loop_avx512(fma ? DType::f32 : DType::bf16, iters);
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
                                  .Attr<std::string_view>("unit")
                                  .Ret<ffi::Buffer<ffi::F32>>());

}  // namespace jb
