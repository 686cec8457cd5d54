// Function-level ISA targets for the layers' element-wise loops. The layers compile for the
// x86-64 baseline (SSE2, no FMA); a loop written once is instantiated again under each
// target attribute and chosen by the kernel ISA in use, so the cell math and activations run
// on the same vector width as the BRGEMM tiles around them.
#pragma once

#include "brgemm/brgemm.h"

#define JB_INLINE __attribute__((always_inline)) inline

#if defined(JB_X86)
#define JB_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define JB_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#endif

namespace jb::target {

// Loop is a struct with `static void run(Args...)`, always inline (JB_INLINE), so that it is
// compiled into each of these entry points under the entry point's target.
template <class Loop, class Fn = decltype(&Loop::run)>
struct Variants;

template <class Loop, class... Args>
struct Variants<Loop, void (*)(Args...)> {
  using Fn = void (*)(Args...);
  static void baseline(Args... args) { Loop::run(args...); }
#if defined(JB_X86)
  JB_TARGET_AVX2 static void avx2(Args... args) { Loop::run(args...); }
  JB_TARGET_AVX512 static void avx512(Args... args) { Loop::run(args...); }
#endif
  static Fn pick(Isa isa) {
#if defined(JB_X86)
    if (isa >= Isa::avx512) return &avx512;  // AMX hosts run the AVX-512 variant
    if (isa == Isa::avx2) return &avx2;
#endif
    (void)isa;
    return &baseline;
  }
};

// Loop::run compiled for `isa`: picked once by a plan, or per call by a cheap dispatcher.
template <class Loop>
typename Variants<Loop>::Fn variant(Isa isa) {
  return Variants<Loop>::pick(isa);
}

}  // namespace jb::target
