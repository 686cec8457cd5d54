// Peak-throughput probe (see peak_avx512.cc). flops per iteration: 12 chains x 16 lanes x
// 2 (fp32 FMA) or x 4 (bf16 pair dot product).
#pragma once

#include <cstdint>

#include "brgemm/brgemm.h"

namespace jb {

inline int64_t peak_flops_per_iter(DType dtype) { return 12 * 16 * (dtype == DType::f32 ? 2 : 4); }

// Returns a value that depends on every chain, so no work is optimized away.
float peak_loop_avx512(DType dtype, int64_t iters);
// fp32 FMA on ymm registers, for CPUs without AVX-512 (same flops per iteration).
float peak_loop_avx2(int64_t iters);

// bf16 on AMX: 4 tile dot products of 16 x 16 x 32 per iteration.
inline int64_t peak_amx_flops_per_iter() { return 4 * 16 * 16 * 32 * 2; }
float peak_loop_amx(int64_t iters);

}  // namespace jb
