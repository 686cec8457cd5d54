// The LSTM layer (paper §3.1, Algorithm 2): the whole sequence in one call, as loops around
// the batch-reduce GEMM kernel.
//
//   a_t = x_t @ W + h_{t-1} @ R + b            x_t: N x C, W: C x 4K, R: K x 4K, b: 4K
//   i, f, g, o = sig(a_i), sig(a_f), tanh(a_g), sig(a_o)     (gate order of flax's
//   c_t = f * c_{t-1} + i * g                                  OptimizedLSTMCell)
//   h_t = o * tanh(c_t)
//
// forward  per time step, work items are (K-block, group of N-blocks) tiles; an item
//          computes the four gate blocks of its tiles with one BRGEMM each (sigmoid / tanh
//          in the kernel's epilogue, into a gate tile of its own) and the cell update while
//          they are hot, writing h_t and c_t (and, training, streaming the gates out). One
//          parallel_for per step is the step barrier. Two variants:
//            fused       the batch of every gate block runs over the blocks of [x_t | h_{t-1}]
//                        against the stacked weights [W; R] (the paper's Algorithm 2);
//            precompute  x @ W + b for all t first, as one large BRGEMM pass; then per step
//                        only h_{t-1} @ R, accumulated onto those gates.
// bptt     backward through time: per step (t = T-1 .. 0), items (K-block, group of
//          N-blocks) compute dh_t = dy_t + da_{t+1} @ R^T with one BRGEMM over the blocks of
//          4K (R^T re-blocked once per call), then the fused gate derivatives of their
//          tiles: da_t, and dc_{t-1} in place. The bias gradient is summed per N-block on
//          the way (race-free, each block has one owner per step), the initial carry's
//          gradient (dc_0, dh_0 = da_0 @ R^T) comes out at the end.
// The rest of the backward is two big passes of the fully-connected layer over all time
// steps at once, after the loop (cpp/layers/fc, called from jax_brgemm/ops/lstm.py):
// dx = da @ W^T and [dW; dR] = [x | h_prev]^T @ da, where da is every step's gate gradient
// saved by bptt and [x | h_prev] the forward's xh, both in x's row order.
//
// Layouts: x (and y, da, xh) are (N, T, features) or, with time_major, (T, N, features),
// read and written in place. The forward saves for the backward (when `gates` is not null)
// the activated gates (in dt, time-major, in the backward's K-blocks: gate_block), the cell
// states c_t (T, N, K, fp32) and [x | h_prev] (xh, in x's layout and dtype). c0, c_T,
// dc are fp32; h0, h_T, y, dy, dh, da in the compute dtype dt; W and R in w_dt (fp32 or
// bf16, cast while re-blocked); bf16 multiplies as multiply_dtype(dt, dp), accumulation,
// the cell state and all element-wise math in fp32.
#pragma once

#include <array>
#include <cstdint>

#include "brgemm/brgemm.h"
#include "layers/common/blocking.h"
#include "parallel/parallel_for.h"

namespace jb::lstm {

struct Shape {
  int64_t t = 0, n = 0, c = 0, k = 0;  // steps, mini-batch, input and hidden features
  DType dt = DType::f32;               // compute dtype
  bool time_major = false;             // x is (T, N, C), else (N, T, C)
};

enum class Variant : uint8_t { automatic, fused, precompute };

// The forward variant the rule picks for a shape (automatic resolves to one of the two).
Variant forward_variant(const Shape& s, int64_t threads, const Dispatch& dp);

// Blocking of the per-step work: rows = N-block, cols = K-block (red is chosen per pass), of
// the forward and of the backward through time.
Blocking step_blocking(const Shape& s, int64_t threads, const Dispatch& dp);
Blocking bptt_blocking(const Shape& s, int64_t threads, const Dispatch& dp);

// Columns of bptt's da: 4K, padded away from a 4 KiB row period, so that the fc passes
// after it (dx, the weight update) read its first 4K columns in place.
int64_t da_width(const Shape& s);

// Columns of a block of the saved gates, which are (T, ceil(K / block), N, 4 x block): per
// step, K-blocks of about the backward's width (padded by fewer than 16 columns a block),
// each holding its rows' four gate pieces side by side.
int64_t gate_block(const Shape& s, const Dispatch& dp);
// The saved gates' dimensions: {T, ceil(K / block), N, 4 x block}.
std::array<int64_t, 4> saved_gate_dims(const Shape& s, const Dispatch& dp);

// Columns of the saved xh: C + K padded to whole reduction blocks of the forward (and
// away from a 4 KiB row period).
int64_t saved_width(const Shape& s, const Dispatch& dp);

// Runs the sequence. gates (gate_block's layout, dt), cs (T*N*K) and xh (T*N*saved_width, x's layout and
// dtype) are saved when not null (all or none): xh holds every step's [x_t | h_{t-1} | 0],
// the weight update's operand. force_blocking / variant override the heuristics (tests).
void forward(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* w,
             const void* r, DType w_dt, const float* bias, const float* c0, const void* h0,
             void* y, float* c_last, void* h_last, void* gates, float* cs, void* xh,
             Variant variant = Variant::automatic, const Blocking* force = nullptr);

// Backward through time from the forward's saved gates and cell states. dy (x's layout, K
// features), dc_last (N x K fp32) and dh_last (N x K, dt) are the incoming gradients (null
// dc_last / dh_last: zeros). Writes da (x's layout, da_width features of which the first 4K
// are the gradient, dt), db (4K fp32), dc0 (N x K fp32), dh0 (N x K dt).
void bptt(const Executor& ex, const Dispatch& dp, const Shape& s, const void* r, DType w_dt,
          const void* gates, const float* cs, const float* c0, const void* dy,
          const float* dc_last, const void* dh_last, void* da, float* db, float* dc0, void* dh0,
          const Blocking* force = nullptr);

}  // namespace jb::lstm
