// The LSTM layer (paper §3.1, Algorithm 2): the whole sequence in one call, as loops around
// the batch-reduce GEMM kernel.
//
//   a_t = x_t @ W + h_{t-1} @ R + b            x_t: N x C, W: C x 4K, R: K x 4K, b: 4K
//   i, f, g, o = sig(a_i), sig(a_f), tanh(a_g), sig(a_o)     (gate order of flax's
//   c_t = f * c_{t-1} + i * g                                  OptimizedLSTMCell)
//   h_t = o * tanh(c_t)
//
// forward  per time step, work items are (K-block, group of N-blocks) tiles; an item
//          computes the four gate blocks of its tiles with one BRGEMM each, whose batch runs
//          over the blocks of [x_t | h_{t-1}] against the stacked weights [W; R] (sigmoid /
//          tanh in the kernel's epilogue, into a gate tile of its own), then the cell update
//          while they are hot, writing h_t and c_t (and, training, streaming the gates out).
//          One parallel_for per step is the step barrier.
// bptt     backward through time: per step (t = T-1 .. 0), items (K-block, group of
//          N-blocks) compute dh_t = dy_t + da_{t+1} @ R^T with one BRGEMM over the blocks of
//          4K (R^T re-blocked once per call), then the fused gate derivatives of their
//          tiles: da_t, and dc_{t-1} in place. The bias gradient is summed per N-block on
//          the way (race-free, each block has one owner per step), the initial carry's
//          gradient (dc_0, dh_0 = da_0 @ R^T) comes out at the end.
// tangent  forward mode: per step, items (K-block, group of N-blocks) as the forward's,
//          th_{t-1} @ R by BRGEMM into a gate tile, then the gates' and cell's derivatives
//          times it (TangentArgs below); the tangents of x, W, R come in precomputed.
// The rest of the backward is two big passes of the fully-connected layer over all time
// steps at once, after the loop (cpp/layers/fc, called from jax_brgemm/ops/lstm.py):
// dx = da @ W^T and [dW; dR] = [x | h_prev]^T @ da, where da is every step's gate gradient
// saved by bptt and [x | h_prev] the forward's xh, both in x's row order.
//
// Layouts: x (and y, dy, da, xh) are (N, T, features) or, with time_major, (T, N, features),
// read and written in place. Cell states and their gradients are fp32; x, h, y and their
// gradients are in the compute dtype dt; W and R in fp32 or bf16 (cast while re-blocked);
// bf16 multiplies as multiply_dtype(dt, dp), accumulation, the cell state and all
// element-wise math in fp32. fp32 operands may ask for their products to be emulated from
// bf16 ones (Shape::products).
#pragma once

#include <array>
#include <cstdint>

#include "brgemm/brgemm.h"
#include "layers/common/blocking.h"
#include "layers/common/view.h"
#include "parallel/parallel_for.h"

namespace jb::lstm {

struct Shape {
  int64_t t = 0, n = 0, c = 0, k = 0;  // steps, mini-batch, input and hidden features
  DType dt = DType::f32;               // compute dtype
  bool time_major = false;             // x is (T, N, C), else (N, T, C)
  // fp32 only: every product from this many bf16 products of the operands' parts (1, 3 or
  // 6: layers/common/emulation.h; h_t and da_t are split where the steps make them), 0: exact.
  int64_t products = 0;
};

// The dtype the passes multiply in: the bf16 multiply dtype when emulating.
inline DType mul_dtype(const Shape& s, const Dispatch& dp) {
  return multiply_dtype(s.products ? DType::bf16 : s.dt, dp);
}

// What the forward saves for the backward: all three when training, all null otherwise.
struct ForwardSaves {
  OutView gates;         // the activated gates, saved_gate_dims(), dt
  float* cs = nullptr;   // the cell states c_t, (T, N, K)
  OutView xh;            // every step's [x_t | h_{t-1} | 0]: x's layout, saved_width() features, dt
};

// The forward's operands. The views in dt must carry dt; w and r share one dtype.
struct ForwardArgs {
  InView x;                     // x's layout, C features
  InView w, r;                  // W (C, 4K), R (K, 4K)
  const float* bias = nullptr;  // (4K)
  const float* c0 = nullptr;    // the initial carry, (N, K) each
  InView h0;
  OutView y;                    // every h_t: x's layout, K features
  float* c_last = nullptr;      // the final carry, (N, K) each
  OutView h_last;
  ForwardSaves saved;
  // Row n's carry in c_last / h_last is the one after its step last_step[n] (each in
  // [0, T)): variable-length sequences padded to T. Null: after step T-1 for every row.
  const int32_t* last_step = nullptr;  // (N)
};

// The backward through time's operands: the forward's saves and the incoming gradients
// (dc_last / dh_last null: zeros) in, the gate gradient, db and the initial carry's out.
// With last_step, dc_last / dh_last are the gradients of the carry ForwardArgs::last_step
// selected: row n's enter at step last_step[n].
struct BpttArgs {
  InView r;                        // R (K, 4K)
  InView gates;                    // the forward's saves
  const float* cs = nullptr;
  const float* c0 = nullptr;       // (N, K)
  InView dy;                       // x's layout, K features
  const float* dc_last = nullptr;  // (N, K) each
  InView dh_last;
  const int32_t* last_step = nullptr;  // (N), as the forward's; null: T-1 for every row
  OutView da;                      // x's layout, da_width() features: the first 4K, then padding
  float* db = nullptr;             // (4K)
  float* dc0 = nullptr;            // (N, K) each
  OutView dh0;
};

// Forward mode: the tangent of the forward's outputs from its operands' tangents (tx, tW,
// tR, tb, tc0, th0), linear in them, from the forward's saved gates and cell states. The
// part of every step's pre-activation tangent that is not recurrent, tx_t @ W + x_t @ tW +
// h_{t-1} @ tR, comes in (from the fully-connected passes over every step at once, in up to
// two pieces); per step the pass adds th_{t-1} @ R by BRGEMM and the bias tangent, then
//   ta = tpre * (s(1 - s) for i, f, o; 1 - g^2 for g)   (from the saved activated gates)
//   tc_t = ta_f * c_{t-1} + f * tc_{t-1} + ta_i * g + i * ta_g
//   th_t = ta_o * tanh(c_t) + o * (1 - tanh(c_t)^2) * tc_t
// With last_step, row n's carry tangent is the one after its step last_step[n].
struct TangentArgs {
  InView r;                        // R (K, 4K)
  InView gates;                    // the forward's saves
  const float* cs = nullptr;
  const float* c0 = nullptr;       // (N, K)
  InView tp[2];                    // x's layout, 4K features, dt; null: zero
  const float* tb = nullptr;       // (4K), or (N, 4K) with tb_rows (one per row of the batch)
  bool tb_rows = false;
  const float* tc0 = nullptr;      // (N, K)
  InView th0;
  const int32_t* last_step = nullptr;  // (N), as the forward's; null: T-1 for every row
  OutView ty;                      // x's layout, K features
  float* tc_last = nullptr;        // (N, K) each
  OutView th_last;
};

// Blocking of the per-step work: rows = N-block, cols = K-block (the reduction block is
// chosen per pass), of the forward and of the backward through time.
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

// Runs the sequence (an empty one passes the carry through). `force` overrides the
// blocking heuristic (tests). Throws std::invalid_argument for inconsistent dtypes or a
// last_step outside [0, T) (both passes).
void forward(const Executor& ex, const Dispatch& dp, const Shape& s, const ForwardArgs& a,
             const Blocking* force = nullptr);

// Backward through time from the forward's saved gates and cell states.
void bptt(const Executor& ex, const Dispatch& dp, const Shape& s, const BpttArgs& a,
          const Blocking* force = nullptr);

// The forward's tangent (an empty sequence passes the carry's tangent through). s.c is
// not read.
void tangent(const Executor& ex, const Dispatch& dp, const Shape& s, const TangentArgs& a,
             const Blocking* force = nullptr);

}  // namespace jb::lstm
