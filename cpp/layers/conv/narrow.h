// Grouped convolutions whose groups are too narrow to fill a vector register (ResNeXt's 8
// channels per group): with the channels in the lanes a BRGEMM tile is half empty and every
// FMA waits for a broadcast. Here the pixels of an output row go in the lanes instead: per
// (output row, group) one BRGEMM call with A = the group's weights (output channels x input
// channels, broadcast), B = the input rows transposed to channels x pixels (VNNI pairs of
// channels for bf16), batch = the taps; its fp32 tile (channels x pixels) is transposed back
// into the NHWC row with bias and activation (narrow.cc). The weight update sums each tap's
// products over the pixels in the lanes (narrow_update.cc). forward, backward and update
// (conv.h) call these for the shapes narrow_*_fits accepts; same arguments, same results to
// rounding.
#pragma once

#include "layers/conv/conv.h"

namespace jb::conv {

bool narrow_forward_fits(const Shape& s, const Dispatch& dp);
// The backward by data of a unit-stride convolution: the forward of dz with the kernel
// flipped and its channels swapped.
bool narrow_backward_fits(const Shape& s, const Dispatch& dp);

// Each adds its pass's phases to `job` (parallel/job.h) for `threads` workers.
void narrow_forward(Job& job, int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* w,
                    DType w_dt, const float* bias, void* y, void* z);
void narrow_backward(Job& job, int64_t threads, const Dispatch& dp, const Shape& s, const void* dz, const void* w,
                     DType w_dt, void* dx);

// Groups of at most 8 output channels and rows of at least 8 pixels.
bool narrow_update_fits(const Shape& s, const Dispatch& dp);
void narrow_update(Job& job, int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
                   void* dw, DType dw_dt, float* db);

}  // namespace jb::conv
