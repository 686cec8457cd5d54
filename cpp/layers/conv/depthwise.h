// Depthwise convolutions (feature groups == C == K), the passes that do not batch-reduce:
// channels in the vector lanes, taps accumulated in fp32 (depthwise.cc). forward, backward
// and update (conv.h) call them for such shapes; same arguments, same results.
#pragma once

#include "layers/conv/conv.h"

namespace jb::conv {

bool depthwise(const Shape& s);

void depthwise_forward(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* w,
                       DType w_dt, const float* bias, void* y, void* z);
void depthwise_backward(const Executor& ex, const Dispatch& dp, const Shape& s, const void* dz, const void* w,
                        DType w_dt, void* dx);
void depthwise_update(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
                      void* dw, DType dw_dt, float* db);

}  // namespace jb::conv
