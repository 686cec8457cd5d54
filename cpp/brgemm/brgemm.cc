// Dispatch (decided once per process), kernel selection and validation.
#include "brgemm/brgemm.h"

#include <cstdlib>
#if defined(JB_X86)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <cstring>
#include <stdexcept>
#include <string>

namespace jb {

namespace {

#if defined(JB_X86)
// AMX needs the CPU (CPUID.7.0:EDX AMX-BF16 and AMX-TILE), the OS (XCR0 tile state) and
// the process's permission to use the large tile state (Linux arch_prctl).
bool amx_usable() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!(edx & (1u << 22)) || !(edx & (1u << 24))) return false;
  unsigned xcr0_lo, xcr0_hi;
  __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if ((xcr0_lo & (3u << 17)) != (3u << 17)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}
#endif

Isa detect_isa() {
#if defined(JB_X86)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bf16"))
    return amx_usable() ? Isa::amx : Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
#endif
  return Isa::generic;
}

bool amd_cpu() {
#if defined(JB_X86)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  return std::strcmp(vendor, "AuthenticAMD") == 0;
#else
  return false;
#endif
}

// JAX_BRGEMM_ISA may only lower the ISA: asking for more than the CPU has is ignored.
Isa requested_isa(Isa supported, const char* env) {
  if (!env || !*env) return supported;
  for (Isa isa : {Isa::generic, Isa::avx2, Isa::avx512, Isa::amx})
    if (std::strcmp(env, isa_name(isa)) == 0) return isa < supported ? isa : supported;
  throw std::invalid_argument(std::string("JAX_BRGEMM_ISA=") + env +
                              " is not one of amx, avx512, avx2, generic");
}

Dispatch detect_dispatch() {
  Dispatch d = make_dispatch(requested_isa(detect_isa(), std::getenv("JAX_BRGEMM_ISA")),
                             std::getenv("JAX_BRGEMM_BF16"));
  const char* async = std::getenv("JAX_BRGEMM_ASYNC");
  d.async_calls = !(async && async[0] == '0');
  return d;
}

// AMX tiles multiply bf16 only (and need an even k: a tile row holds whole k pairs);
// everything else runs on the AVX-512 register tiles.
BrgemmFn kernel_for(Isa isa, const BrgemmDesc& d) {
  switch (isa) {
#if defined(JB_X86)
    case Isa::amx:
      return d.ab == DType::bf16 && d.k % 2 == 0 ? detail::brgemm_amx_bf16() : detail::brgemm_avx512();
    case Isa::avx512: return detail::brgemm_avx512();
    case Isa::avx2: return detail::brgemm_avx2();
#endif
    default: return detail::brgemm_generic();
  }
}

void check(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("brgemm: ") + what);
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::amx: return "amx";
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "generic";
  }
}

Dispatch make_dispatch(Isa isa, const char* bf16_override) {
  Dispatch d;
  d.isa = isa;
  const std::string mode = bf16_override ? bf16_override : "";
  if (mode == "dot") d.bf16_multiply = DType::bf16;
  else if (mode == "fp32") d.bf16_multiply = DType::f32;
  else if (mode.empty() || mode == "auto")
    d.bf16_multiply = isa == Isa::amx || (isa == Isa::avx512 && amd_cpu()) ? DType::bf16 : DType::f32;
  else
    throw std::invalid_argument("JAX_BRGEMM_BF16=" + mode + " is not one of auto, dot, fp32");
  return d;
}

const Dispatch& dispatch() {
  // A bad override throws from the initializer, so every call reports it again.
  static const Dispatch d = detect_dispatch();
  return d;
}

Brgemm::Brgemm(const BrgemmDesc& d, Isa isa) : Brgemm(d, isa, kernel_for(isa, d)) {}

Brgemm::Brgemm(const BrgemmDesc& d, Isa isa, BrgemmFn fn) : desc_(d), isa_(isa), fn_(fn) {
  check(d.m >= 0 && d.n >= 0 && d.k >= 0, "negative size");
  check(d.lda >= d.k, "lda < k");
  check(d.ldb >= (d.ab == DType::bf16 ? 2 * d.n : d.n), "ldb too small for n");
  check(d.ldc >= d.n, "ldc < n");
  check(d.static_batch >= 0 && (d.static_batch == 0 || (d.static_offs_a && d.static_offs_b)),
        "static offsets need both tables");
}

void pack_vnni2(const uint16_t* src, int64_t k, int64_t n, int64_t ld, uint16_t* dst, Isa isa) {
#if defined(JB_X86)
  if (isa >= Isa::avx512) return detail::pack_vnni2_avx512(src, k, n, ld, dst);
#endif
  for (int64_t p = 0; p < (k + 1) / 2; ++p) {
    const uint16_t* r0 = src + 2 * p * ld;
    const uint16_t* r1 = 2 * p + 1 < k ? r0 + ld : nullptr;
    uint16_t* out = dst + p * 2 * n;
    for (int64_t j = 0; j < n; ++j) {
      out[2 * j] = r0[j];
      out[2 * j + 1] = r1 ? r1[j] : 0;
    }
  }
}

}  // namespace jb
