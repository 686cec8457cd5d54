// The LSTM passes' plans and the layouts they share. A plan (blocking, the full and edge
// kernels of every gate, the work split, scratch sizes) depends only on the shape, dtypes,
// thread count and dispatch: built on a call site's first call, taken from a cache after.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "layers/common/emulation.h"
#include "layers/common/kernels.h"
#include "layers/common/work.h"
#include "layers/lstm/cell.h"
#include "layers/lstm/lstm.h"

namespace jb::lstm {

// K-blocks are whole register tiles (2 AVX-512 vectors of fp32 accumulators), at most 4.
constexpr int64_t kCols = 32;
constexpr int64_t kMaxCols = 4 * kCols;
// The longest reduction block of the buffers we lay out ourselves.
constexpr int64_t kMaxDepth = 256;

// Rows of x-like arrays: (t, n) is row t * N + n (time-major) or n * T + t.
inline int64_t row_of(const Shape& s, int64_t t, int64_t n) { return s.time_major ? t * s.n + n : n * s.t + t; }
// Rows between (t, n) and (t, n + 1).
inline int64_t row_step(const Shape& s) { return s.time_major ? 1 : s.t; }

// The saved gates: each step's in K-blocks of `block` columns (gate_block; the last one
// padded), [K-block][n][gate][block], so that the backward cell reads its tile's gates as
// one contiguous piece rather than as row pieces 4K apart.
struct GateLayout {
  int64_t n, block, k_blocks;
  int64_t row() const { return kGates * block; }
  int64_t step() const { return k_blocks * n * row(); }
  // Element offset of (t, row r, gate 0, column k).
  int64_t at(int64_t t, int64_t r, int64_t k) const { return t * step() + (k / block * n + r) * row() + k % block; }
};

// Calls f(k, cols) for the pieces of columns [k0, k0 + cols) within one block of `block`.
template <class F>
void for_pieces(int64_t k0, int64_t cols, int64_t block, F&& f) {
  for (int64_t k = k0, end = k0 + cols; k < end;) {
    const int64_t e = std::min(end, (k / block + 1) * block);
    f(k, e - k);
    k = e;
  }
}

// Copies `rows` rows of `cols` elements between arrays of dtypes from -> to (fp32 <-> bf16
// or the same), zero-filling columns [cols, zero_to) of each destination row.
void copy_rows(const void* src, DType from, int64_t lds, void* dst, DType to, int64_t ldd, int64_t rows,
               int64_t cols, int64_t zero_to);

// Throws std::invalid_argument unless every last_step[n] is a step, in [0, T) (null: none).
void check_last_step(const Shape& s, const int32_t* last_step, const char* pass);

// Throws std::invalid_argument unless s.products is 0, or 1, 3 or 6 with fp32 operands.
void check_products(const Shape& s, const char* pass);

// dst[j] += src[j] for `cols` values of src in dtype `from` (fp32 or bf16).
void add_row(const void* src, DType from, float* dst, int64_t cols);

// What the forward's and the backward's plans share: how they multiply, the blocking of
// the per-step work ((K-block, group of N-blocks) items, weight panels in sub-panels) and the
// saved gates' layout.
struct StepPlan : MultiplyPath {
  StepPlan(const Dispatch& dp, const Shape& s, Blocking chosen, int64_t threads);

  const emulation::Terms terms;  // the products of every multiplication (one, unless emulated)
  const Shape s;
  const Blocking b;  // rows: the N-block, cols: the K-block
  const int64_t k_blocks, n_blocks;
  const int64_t sub_width, subpanels;  // sub-panel columns, sub-panels per K-block
  const WorkGroups groups;
  const GateLayout saved_gates;
};

// The forward: A_t = [x_t | h_{t-1} | 0] for all T steps in one buffer with x's row order
// (a_ld columns, the multiply dtype), zero-padded to whole reduction blocks; the weight
// panel of (gate, K-block) holds the blocks of [W; R; 0] in the same order, in sub-panels.
// Training keeps the buffer: it is the weight update's operand [x | h_prev] (the saved xh),
// so no pass builds it again.
struct ForwardPlan : StepPlan {
  ForwardPlan(const Dispatch& dp, const Shape& s, Blocking chosen, int64_t threads);

  // Element offset of sub-panel j of the weight panel of (gate, K-block kb).
  int64_t panel(int gate, int64_t kb, int64_t j) const {
    return ((gate * k_blocks + kb) * subpanels + j) * depth_blocks * block_elems;
  }

  const CellForwardFn cell;
  int64_t h_col = 0;         // h's first column in A
  int64_t depth = 0;         // rows of [W; R] per batch element (the kernel's k)
  int64_t depth_blocks = 0;  // batch elements: C + K padded to whole blocks of depth
  int64_t a_ld = 0;          // A's columns (the saved xh's)
  int64_t a_stride = 0;      // A's elements between (t, n) and (t, n + 1)
  int64_t block_elems = 0;   // one sub-panel's re-blocked batch element
  int64_t tile_ld = 0;       // the gate tile's: rows of four K-blocks
  // Gate q's block into an item's gate tile, bias and activation in the epilogue.
  std::optional<KernelSet> gate_kernels[kGates];
  // Emulation: elements between the parts of A and of the weight panels, and the gate
  // BRGEMM's batch over (term, block): A's and the panel's offsets.
  int64_t a_part = 0, w_part = 0;
  std::vector<int64_t> a_offs, w_offs;
};

// The backward through time: R^T re-blocked [K-block][sub-panel][4K / depth][depth][sub]
// once per call; two alternating N x 4K buffers hold da_t in the multiply dtype as the next
// step's A (a compact copy reads faster than da's padded rows).
struct BpttPlan : StepPlan {
  BpttPlan(const Dispatch& dp, const Shape& s, Blocking chosen, int64_t threads);

  const int64_t depth, depth_blocks;  // the blocks of 4K, the batch of the dh BRGEMM
  const int64_t block_elems;
  const int64_t da_ld, copy_ld;  // the rows of da and of its copies
  const KernelSet kernels;
  const CellBackwardFn cell;
  // Emulation: elements between the parts of a da copy and of R^T, and the dh BRGEMM's
  // batch over (term, block): the copy's and R^T's offsets.
  int64_t da_part = 0, r_part = 0;
  std::vector<int64_t> da_offs, r_offs;
};

// The tangent (forward mode): the forward's items over R alone, in its re-blocked panels
// [gate][K-block][sub-panel][K / depth][depth][sub]; two alternating N-row buffers hold
// th_{t-1} in the multiply dtype (its parts, emulating), zero-padded to whole blocks of depth.
struct TangentPlan : StepPlan {
  TangentPlan(const Dispatch& dp, const Shape& s, Blocking chosen, int64_t threads);

  // Element offset of sub-panel j of R's panel of (gate, K-block kb).
  int64_t panel(int gate, int64_t kb, int64_t j) const {
    return ((gate * k_blocks + kb) * subpanels + j) * depth_blocks * block_elems;
  }

  const int64_t depth, depth_blocks;  // blocks of K: the batch of the th @ R BRGEMM
  const int64_t a_ld;                 // th buffers' columns
  const int64_t block_elems;          // one sub-panel's re-blocked batch element
  const int64_t tile_ld;              // the gate tile's: rows of four K-blocks
  const KernelSet kernels;            // a gate block into the tile
  const CellTangentFn cell;
  // Emulation: elements between the parts of a th buffer and of the panels, and the BRGEMM's
  // batch over (term, block): the buffer's and the panel's offsets.
  const int64_t a_part, w_part;
  std::vector<int64_t> a_offs, w_offs;
};

// The (term, block) batch of an emulated BRGEMM over `blocks` batch elements: A's block i of
// part p at p * a_part + i * a_block, likewise for B.
void term_offsets(const emulation::Terms& t, int64_t blocks, int64_t a_part, int64_t a_block, int64_t b_part,
                  int64_t b_block, std::vector<int64_t>* a_offs, std::vector<int64_t>* b_offs);

// The plans for a call (`force`: the tests' blocking, else the heuristic's).
std::shared_ptr<const ForwardPlan> forward_plan(const Dispatch& dp, const Shape& s, int64_t threads,
                                                const Blocking* force);
std::shared_ptr<const BpttPlan> bptt_plan(const Dispatch& dp, const Shape& s, int64_t threads,
                                          const Blocking* force);
std::shared_ptr<const TangentPlan> tangent_plan(const Dispatch& dp, const Shape& s, int64_t threads,
                                                const Blocking* force);

}  // namespace jb::lstm
