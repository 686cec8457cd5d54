// The AMX bf16 BRGEMM (amx_driver.h) on the hardware's tile unit.
// Compiled with -mamx-tile -mamx-bf16 (+ AVX-512); only called when CPUID and the OS
// (arch_prctl XTILEDATA permission) allow AMX.
#include <immintrin.h>

#include "brgemm/amx_driver.h"

namespace jb {
namespace {

// GCC's tile intrinsics paste their register number into the assembly text, so they
// take literals only; these pass it as an immediate (%c: printed bare) from a template.
struct AmxTiles {
  static void configure(const TileConfig& cfg) { _tile_loadconfig(&cfg); }
  static void release() { _tile_release(); }
  static BrgemmFn rest() { return detail::brgemm_avx512(); }
  template <int R>
  static void zero() { asm volatile("tilezero %%tmm%c0" ::"i"(R)); }
  template <int R>
  static void load(const void* p, int64_t stride) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(R) : "memory");
  }
  template <int R>
  static void store(void* p, int64_t stride) {
    asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(R) : "memory");
  }
  template <int C, int A, int B>
  static void dot() { asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B)); }
};

}  // namespace

BrgemmFn detail::brgemm_amx_bf16() { return &run_amx_bf16<AmxTiles>; }

}  // namespace jb
