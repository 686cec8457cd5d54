// Depthwise convolutions (feature groups == C == K), the passes that do not batch-reduce:
// channels in the vector lanes, taps accumulated in fp32 (depthwise.cc). forward, backward
// and update (conv.h) use them for such shapes; same arguments, same results.
#pragma once

#include "layers/conv/conv.h"

namespace jb::conv {

bool depthwise(const Shape& s);

// Each adds its pass's phases to `job` (parallel/job.h) for `threads` workers.
void depthwise_forward(Job& job, int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* w,
                       DType w_dt, const float* bias, void* y, void* z);
void depthwise_backward(Job& job, int64_t threads, const Dispatch& dp, const Shape& s, const void* dz, const void* w,
                        DType w_dt, void* dx);
void depthwise_update(Job& job, int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
                      void* dw, DType dw_dt, float* db);

}  // namespace jb::conv
