// Peak-throughput probe (see peak_avx512.cc). flops per iteration: 12 chains x 16 lanes x
// 2 (fp32 FMA) or x 4 (bf16 pair dot product).
#pragma once

#include <cstdint>

#include "brgemm/brgemm.h"

namespace jb {

inline int64_t peak_flops_per_iter(DType dtype) { return 12 * 16 * (dtype == DType::f32 ? 2 : 4); }

// Returns a value that depends on every chain, so no work is optimized away.
float peak_loop_avx512(DType dtype, int64_t iters);

}  // namespace jb
