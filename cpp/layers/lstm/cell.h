// The element-wise LSTM cell of one (N-block, K-block) tile piece, fused after its gate
// blocks (forward), after its dh BRGEMM (backward through time) or after its th @ R BRGEMM
// (the tangent, forward mode). One loop per direction,
// compiled for the baseline, AVX2 and AVX-512 (target::variant) and picked once by a plan.
#pragma once

#include <cstdint>

#include "brgemm/brgemm.h"

#if defined(JB_X86)
#include <immintrin.h>
#endif

namespace jb::lstm {

constexpr int kGates = 4;

// The forward cell's operands: a piece of rows x cols at (n0, k0) of every array.
struct CellForward {
  int64_t rows, cols;
  const float* gates;        // activated gate 0; gate q at column q * gate_stride
  int64_t gates_ld, gate_stride;
  const float* c_prev;       // c_{t-1}
  float* c_next;             // c_t (may be c_prev: updated in place)
  int64_t c_ld;
  void* y;                   // h_t in dt
  int64_t y_ld;
  void* h_next;              // h_t in the multiply dtype, the next step's A; or null
  int64_t h_ld;
  void* saved;               // where the activated gates are saved (dt); or null
  int64_t saved_ld, saved_gate_stride;
};

// The backward cell's operands, likewise.
struct CellBackward {
  int64_t rows, cols;
  int64_t gate_cols;         // K: gate q's columns of da, da_next and db start at q * K
  const void* gates;         // the saved activated gates (dt); gate q at q * gate_stride
  int64_t gates_ld, gate_stride;
  const float* c;            // c_t; c_prev, dh_rec and dc share its leading dimension
  const float* c_prev;       // c_{t-1}
  int64_t c_ld;
  const float* dh_rec;       // da_{t+1} @ R^T; at the last step the final carry's dh (or 0)
  const void* dy;            // dt
  int64_t dy_ld;
  float* dc;                 // in: dc_t from the step after, out: dc_{t-1}
  void* da;                  // dt
  int64_t da_ld;
  void* da_next;             // da_t in the multiply dtype, the next step's A
  int64_t da_next_ld;
  float* db;                 // this N-block's partial bias gradient
};

// The tangent cell's operands (forward mode), likewise.
struct CellTangent {
  int64_t rows, cols;
  float* pre;                // th_{t-1} @ R, gate q at column q * pre_stride; tp and tb added in place
  int64_t pre_ld, pre_stride;
  const void* tp[2];         // the rest of the pre-activation tangent (dt), gate q at q * gate_cols; or null
  int64_t tp_ld, gate_cols;
  const float* tb;           // the bias tangent, gate q at q * gate_cols, rows tb_ld apart (0: shared)
  int64_t tb_ld;
  const void* gates;         // the saved activated gates (dt); gate q at q * gate_stride
  int64_t gates_ld, gate_stride;
  const float* c;            // c_t; c_prev and tc share its leading dimension
  const float* c_prev;       // c_{t-1}
  int64_t c_ld;
  float* tc;                 // in: tc_{t-1}, out: tc_t
  void* ty;                  // th_t in dt
  int64_t ty_ld;
  void* th_next;             // th_t in the multiply dtype, the next step's A; or null
  int64_t th_ld;
};

using CellForwardFn = void (*)(const CellForward&);
using CellBackwardFn = void (*)(const CellBackward&);
using CellTangentFn = void (*)(const CellTangent&);

// The cell for a compute dtype, multiply dtype and kernel ISA.
CellForwardFn cell_forward(DType dt, DType mul_dt, Isa isa);
CellBackwardFn cell_backward(DType dt, DType mul_dt, Isa isa);
CellTangentFn cell_tangent(DType dt, DType mul_dt, Isa isa);

// Orders an item's streamed stores (the cells' non-temporal saves) before whatever reads
// them after the pass.
inline void stream_fence() {
#if defined(JB_X86)
  _mm_sfence();
#endif
}

}  // namespace jb::lstm
