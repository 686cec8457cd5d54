// Function-level ISA targets for the layers' element-wise loops. The layers compile for the
// x86-64 baseline (SSE2, no FMA); a loop written once as an always-inline template is
// instantiated again under each attribute and chosen by the kernel ISA in use, so the cell
// math and activations run on the same vector width as the BRGEMM tiles around them.
#pragma once

#if defined(JB_X86)
#define JB_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define JB_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#endif
