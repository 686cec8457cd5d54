// The LSTM's blocking heuristics, layouts and plans.
#include "layers/lstm/plan.h"

#include <array>
#include <cstring>
#include <stdexcept>
#include <string>

#include "layers/common/plan_cache.h"
#include "layers/common/reblock.h"

namespace jb::lstm {

namespace {

// Gate q's activation (flax's OptimizedLSTMCell order i, f, g, o).
constexpr Activation kGateAct[kGates] = {Activation::sigmoid, Activation::sigmoid, Activation::tanh,
                                         Activation::sigmoid};

// Bytes per element of the weight panels a pass streams: bf16 multiplied on AMX tiles counts
// as bf16 (bf16 by vdpbf16ps measured best at fp32's widths on an AMD Zen 4).
int64_t panel_elem_bytes(const Shape& s, const Dispatch& dp) {
  return dp.isa == Isa::amx && mul_dtype(s, dp) == DType::bf16 ? 2 : int64_t(sizeof(float));
}

GateLayout gate_layout(const Shape& s, const Dispatch& dp) {
  const auto d = saved_gate_dims(s, dp);
  return {s.n, d[3] / kGates, d[1]};
}

// Everything a plan depends on.
using PlanKey = std::array<int64_t, 12>;
PlanKey key_of(const Shape& s, int64_t threads, const Dispatch& dp, const Blocking* force) {
  return {s.t, s.n, s.c, s.k, int64_t(s.dt), s.time_major, threads, int64_t(dp.isa), int64_t(dp.bf16_multiply),
          force ? force->rows : -1, force ? force->cols : -1, s.products};
}

PlanCache<12, ForwardPlan> forward_plans;
PlanCache<12, BpttPlan> bptt_plans;
PlanCache<12, TangentPlan> tangent_plans;

}  // namespace

// The forward's item streams its four gate panels (rows of [W; R] x cols) for each of its
// N-blocks: K-blocks as wide as keeps them within kPanelBytes (widths experimentally
// selected on an Intel Xeon, fp32 and bf16 on AMX; docs/lstm.md).
Blocking step_blocking(const Shape& s, int64_t threads, const Dispatch& dp) {
  auto gate_panels = [&](int64_t cols) { return kGates * (s.c + s.k) * cols * panel_elem_bytes(s, dp); };
  Blocking b;
  b.cols = kCols;
  while (b.cols < kMaxCols && gate_panels(2 * b.cols) <= kPanelBytes) b.cols *= 2;
  b.cols = std::min(s.k, b.cols);
  b.rows = split_rows(s.n, ceil_div(s.k, b.cols), threads);
  return b;
}

// The backward's cell reads the saved gates and writes da row piece by row piece: wider
// K-blocks make those pieces longer, but also the R^T panel (4K x cols) each item streams
// per N-block. So 128 columns while that panel fits in L2, else 32; bf16 by vdpbf16ps takes
// 32 (experimentally selected on an AMD Zen 4 and an Intel Xeon; docs/lstm.md).
Blocking bptt_blocking(const Shape& s, int64_t threads, const Dispatch& dp) {
  const int64_t es = panel_elem_bytes(s, dp);
  const bool wide = mul_dtype(s, dp) == DType::f32 || es == 2;
  const bool fits = kGates * s.k * kMaxCols * es <= l2_bytes();
  Blocking b;
  b.cols = std::min(s.k, wide && fits ? kMaxCols : kCols);
  b.rows = split_rows(s.n, ceil_div(s.k, b.cols), threads);
  return b;
}

// The backward's K-block, narrowed when K is not a multiple of it so that the padding stays
// under 16 columns a block (K = 129 and 128-column K-blocks: two blocks of 80, not of 128).
int64_t gate_block(const Shape& s, const Dispatch& dp) {
  const int64_t cols = bptt_blocking(s, 1, dp).cols, blocks = ceil_div(s.k, cols);
  return blocks == 1 ? s.k : std::min(cols, round_up(ceil_div(s.k, blocks), 16));
}

std::array<int64_t, 4> saved_gate_dims(const Shape& s, const Dispatch& dp) {
  const int64_t b = gate_block(s, dp);
  return {s.t, ceil_div(s.k, b), s.n, kGates * b};
}

int64_t da_width(const Shape& s) { return padded_ld(kGates * s.k, dtype_size(s.dt)); }

int64_t saved_width(const Shape& s, const Dispatch& dp) {
  const DType mul_dt = mul_dtype(s, dp);
  const int64_t depth = padded_block(s.c + s.k, mul_dt == DType::bf16 ? 2 : 1, kMaxDepth);
  return padded_ld(round_up(s.c + s.k, depth), dtype_size(mul_dt), row_step(s));
}

void copy_rows(const void* src, DType from, int64_t lds, void* dst, DType to, int64_t ldd, int64_t rows,
               int64_t cols, int64_t zero_to) {
  const size_t fs = dtype_size(from), ts = dtype_size(to);
  for (int64_t r = 0; r < rows; ++r) {
    const char* s = static_cast<const char*>(src) + r * lds * int64_t(fs);
    char* d = static_cast<char*>(dst) + r * ldd * int64_t(ts);
    if (from == to) {
      std::memcpy(d, s, size_t(cols) * ts);
    } else if (from == DType::bf16) {
      const uint16_t* sh = reinterpret_cast<const uint16_t*>(s);
      float* df = reinterpret_cast<float*>(d);
      for (int64_t j = 0; j < cols; ++j) df[j] = bf16_to_f32(sh[j]);
    } else {
      const float* sf = reinterpret_cast<const float*>(s);
      uint16_t* dh = reinterpret_cast<uint16_t*>(d);
      for (int64_t j = 0; j < cols; ++j) dh[j] = f32_to_bf16(sf[j]);
    }
    if (zero_to > cols) std::memset(d + cols * int64_t(ts), 0, size_t(zero_to - cols) * ts);
  }
}

void check_last_step(const Shape& s, const int32_t* last_step, const char* pass) {
  if (!last_step) return;
  for (int64_t n = 0; n < s.n; ++n)
    if (last_step[n] < 0 || last_step[n] >= s.t)
      throw std::invalid_argument(std::string(pass) + ": last_step[" + std::to_string(n) + "] = " +
                                  std::to_string(last_step[n]) + " is not a step in [0, " + std::to_string(s.t) + ")");
}

void check_products(const Shape& s, const char* pass) {
  emulation::terms(s.products);  // throws for a count it does not know
  if (s.products && s.dt != DType::f32)
    throw std::invalid_argument(std::string(pass) + ": emulated products take float32 operands");
}

void add_row(const void* src, DType from, float* dst, int64_t cols) {
  if (from == DType::bf16) {
    const uint16_t* sh = static_cast<const uint16_t*>(src);
    for (int64_t j = 0; j < cols; ++j) dst[j] += bf16_to_f32(sh[j]);
  } else {
    const float* sf = static_cast<const float*>(src);
    for (int64_t j = 0; j < cols; ++j) dst[j] += sf[j];
  }
}

StepPlan::StepPlan(const Dispatch& dp, const Shape& s, Blocking chosen, int64_t threads)
    : MultiplyPath(s.products ? DType::bf16 : s.dt, dp),
      terms(emulation::terms(s.products)),
      s(s),
      b(clamped(chosen, s.n, s.k)),
      k_blocks(ceil_div(s.k, b.cols)),
      n_blocks(ceil_div(s.n, b.rows)),
      sub_width(sub_cols(b.cols, isa, mul_dt)),
      subpanels(ceil_div(b.cols, sub_width)),
      groups(k_blocks, n_blocks, threads),
      saved_gates(gate_layout(s, dp)) {}

ForwardPlan::ForwardPlan(const Dispatch& dp, const Shape& s, Blocking chosen, int64_t threads)
    : StepPlan(dp, s, chosen, threads), cell(cell_forward(s.dt, mul_dt, dp.isa)) {
  if (b.cols > kMaxCols) throw std::invalid_argument("lstm forward: K-blocks are at most 128 columns");
  h_col = s.c;
  depth = padded_block(h_col + s.k, vnni ? 2 : 1, kMaxDepth);
  depth_blocks = round_up(h_col + s.k, depth) / depth;
  a_ld = saved_width(s, dp);
  a_stride = row_step(s) * a_ld;
  block_elems = reblock::block_elems(depth, sub_width, vnni);
  tile_ld = padded_ld(kGates * b.cols, sizeof(float));
  a_part = s.t * s.n * a_ld;
  w_part = kGates * k_blocks * subpanels * depth_blocks * block_elems;
  term_offsets(terms, depth_blocks, a_part, depth, w_part, block_elems, &a_offs, &w_offs);
  for (int q = 0; q < kGates; ++q) {
    BrgemmDesc d = desc(depth, a_stride, sub_width, tile_ld);
    d.bias = true;
    d.act = kGateAct[q];
    gate_kernels[q].emplace(d, s.n, s.k, b.rows, sub_width, isa);
  }
}

BpttPlan::BpttPlan(const Dispatch& dp, const Shape& s, Blocking chosen, int64_t threads)
    : StepPlan(dp, s, chosen, threads),
      depth(reduction_block(kGates * s.k, vnni)),
      depth_blocks(kGates * s.k / depth),
      block_elems(reblock::block_elems(depth, sub_width, vnni)),
      da_ld(da_width(s)),
      copy_ld(padded_ld(kGates * s.k, mul_bytes)),
      kernels(desc(depth, copy_ld, sub_width, s.k), s.n, s.k, b.rows, sub_width, dp.isa),
      cell(cell_backward(s.dt, mul_dt, dp.isa)),
      da_part(s.n * copy_ld),
      r_part(k_blocks * subpanels * depth_blocks * block_elems) {
  term_offsets(terms, depth_blocks, da_part, depth, r_part, block_elems, &da_offs, &r_offs);
}

TangentPlan::TangentPlan(const Dispatch& dp, const Shape& s, Blocking chosen, int64_t threads)
    : StepPlan(dp, s, chosen, threads),
      depth(padded_block(s.k, vnni ? 2 : 1, kMaxDepth)),
      depth_blocks(round_up(s.k, depth) / depth),
      a_ld(padded_ld(depth_blocks * depth, mul_bytes)),
      block_elems(reblock::block_elems(depth, sub_width, vnni)),
      tile_ld(padded_ld(kGates * b.cols, sizeof(float))),
      kernels(desc(depth, a_ld, sub_width, tile_ld), s.n, s.k, b.rows, sub_width, dp.isa),
      cell(cell_tangent(s.dt, mul_dt, dp.isa)),
      a_part(s.n * a_ld),
      w_part(kGates * k_blocks * subpanels * depth_blocks * block_elems) {
  if (b.cols > kMaxCols) throw std::invalid_argument("lstm tangent: K-blocks are at most 128 columns");
  term_offsets(terms, depth_blocks, a_part, depth, w_part, block_elems, &a_offs, &w_offs);
}

void term_offsets(const emulation::Terms& t, int64_t blocks, int64_t a_part, int64_t a_block, int64_t b_part,
                  int64_t b_block, std::vector<int64_t>* a_offs, std::vector<int64_t>* b_offs) {
  if (!t.split) return;
  for (int q = 0; q < t.count; ++q)
    for (int64_t i = 0; i < blocks; ++i) {
      a_offs->push_back(t.of[0][q] * a_part + i * a_block);
      b_offs->push_back(t.of[1][q] * b_part + i * b_block);
    }
}

std::shared_ptr<const ForwardPlan> forward_plan(const Dispatch& dp, const Shape& s, int64_t threads,
                                                const Blocking* force) {
  return forward_plans.get(key_of(s, threads, dp, force), [&] {
    return ForwardPlan(dp, s, force ? *force : step_blocking(s, threads, dp), threads);
  });
}

std::shared_ptr<const BpttPlan> bptt_plan(const Dispatch& dp, const Shape& s, int64_t threads,
                                          const Blocking* force) {
  return bptt_plans.get(key_of(s, threads, dp, force), [&] {
    return BpttPlan(dp, s, force ? *force : bptt_blocking(s, threads, dp), threads);
  });
}

// The tangent's items are the forward's over R alone (C = 0 in its panel heuristic).
std::shared_ptr<const TangentPlan> tangent_plan(const Dispatch& dp, const Shape& s, int64_t threads,
                                                const Blocking* force) {
  Shape r = s;
  r.c = 0;
  return tangent_plans.get(key_of(r, threads, dp, force), [&] {
    return TangentPlan(dp, r, force ? *force : step_blocking(r, threads, dp), threads);
  });
}

}  // namespace jb::lstm
