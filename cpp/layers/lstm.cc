// The LSTM layer: the forward over the whole sequence and the backward through time, as loops
// around the BRGEMM kernel (see lstm.h for the math and the passes).
//
// Each pass is a plan and its execution. The plan (blocking, the full and edge kernels of
// every gate, the work split, scratch sizes) depends only on the shape, dtypes, thread count
// and dispatch: built on a call site's first call, taken from a cache after that. Execution
// takes its scratch on the calling thread, re-blocks the weights once (a parallel pass), then
// runs one parallel_for per time step that only loops, calls kernels and the fused
// element-wise cell math.
#include "layers/lstm.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <type_traits>
#if defined(JB_X86)
#include <immintrin.h>
#endif

#include "brgemm/activation.h"
#include "layers/common/kernels.h"
#include "layers/common/operand.h"
#include "layers/common/plan_cache.h"
#include "layers/common/reblock.h"
#include "layers/common/target.h"
#include "layers/common/scratch.h"
#include "layers/common/work.h"

namespace jb::lstm {

namespace {

// K-blocks are whole register tiles (2 AVX-512 vectors of fp32 accumulators), at most 4.
constexpr int64_t kCols = 32;
constexpr int64_t kMaxCols = 4 * kCols;
constexpr int kGates = 4;
// The longest reduction block of the buffers we lay out ourselves.
constexpr int64_t kMaxRed = 256;
// Gate g's activation (flax's OptimizedLSTMCell order i, f, g, o).
constexpr Activation kGateAct[kGates] = {Activation::sigmoid, Activation::sigmoid, Activation::tanh,
                                         Activation::sigmoid};

// Rows of x-like arrays: (t, n) is row t * N + n (time-major) or n * T + t.
inline int64_t row_of(const Shape& s, int64_t t, int64_t n) {
  return s.time_major ? t * s.n + n : n * s.t + t;
}
// Rows between (t, n) and (t, n + 1).
inline int64_t row_step(const Shape& s) { return s.time_major ? 1 : s.t; }

// The saved gates: each step's in K-blocks of bc columns (gate_block; the last one padded to
// bc), [K-block][n][gate][bc], so that the backward cell reads its tile's gates as one
// contiguous piece rather than as row pieces 4K apart.
struct GateLayout {
  int64_t n, bc, kblk;
  int64_t row() const { return kGates * bc; }
  int64_t step() const { return kblk * n * row(); }
  // Element offset of (t, row r, gate 0, column k).
  int64_t at(int64_t t, int64_t r, int64_t k) const { return t * step() + (k / bc * n + r) * row() + k % bc; }
};

// Calls f(k, cols) for the pieces of columns [k0, k0 + cols) within one block of bc columns.
template <class F>
void for_pieces(int64_t k0, int64_t cols, int64_t bc, F&& f) {
  for (int64_t k = k0, end = k0 + cols; k < end;) {
    const int64_t e = std::min(end, (k / bc + 1) * bc);
    f(k, e - k);
    k = e;
  }
}

inline char* off(void* p, int64_t elems, size_t es) { return static_cast<char*>(p) + elems * int64_t(es); }
inline const char* off(const void* p, int64_t elems, size_t es) {
  return static_cast<const char*>(p) + elems * int64_t(es);
}

// ---------------------------------------------------------------------------------------
// The element-wise cell math of one (N-block, K-block) tile, fused after its gate blocks.
// One templated loop per direction, instantiated for the baseline ISA, AVX2 and AVX-512
// (layers/common/target.h), taken by the kernel ISA in use.

// Copies `bytes` from src to dst with non-temporal stores where dst is 16-byte aligned: for
// rows written now and read back only by a later pass (from memory anyway), this skips the
// read-for-ownership of every line and keeps them out of the caches.
JB_INLINE void stream_bytes(void* dst, const void* src, size_t bytes) {
#if defined(JB_X86)
  if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    auto* d = static_cast<__m128i*>(dst);
    auto* q = static_cast<const char*>(src);
    size_t i = 0;
    for (; i + 16 <= bytes; i += 16) _mm_stream_si128(d++, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
    std::memcpy(static_cast<char*>(dst) + i, q + i, bytes - i);
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}
// Orders an item's streamed stores before whatever reads them after the pass.
inline void stream_fence() {
#if defined(JB_X86)
  _mm_sfence();
#endif
}

struct CellFwd {
  int64_t rows, cols;  // tile
  const float* g;  // activated gates at (n0, k0) of gate 0, gate q at column q * gk
  int64_t ldg, gk;  // of the step's gate buffer (ldg 4K, gk K) or an item's gate tile
  const float* cp;  // c_{t-1}, leading dim ldc
  float* cn;        // c_t (may equal cp: in place)
  int64_t ldc;
  void* y;  // h_t in dt, leading dim ldy
  int64_t ldy;
  void* h;  // h_t in the multiply dtype for the next step, leading dim ldh; or null
  int64_t ldh;
  void* saved;  // where the cell saves the activated gates (dt) at (t, n0, k0); or null
  int64_t lds, sk;  // its rows' stride and gate q's column offset (GateLayout)
};

template <class Ty, class Th, bool H, bool G>
JB_INLINE void cell_fwd_rows(const CellFwd& a) {
  // fp32 gates are saved as they are: streamed from the tile after each row (below).
  constexpr bool S = G && std::is_same_v<Ty, float>;
  const int64_t rows = a.rows, cols = a.cols, gk = a.gk, sk = a.sk;
  for (int64_t r = 0; r < rows; ++r) {
    const float* gi = a.g + r * a.ldg;
    const float* cp = a.cp + r * a.ldc;
    float* cn = a.cn + r * a.ldc;
    Ty* y = static_cast<Ty*>(a.y) + r * a.ldy;
    Th* h = H ? static_cast<Th*>(a.h) + r * a.ldh : nullptr;
    Ty* sv = G ? static_cast<Ty*>(a.saved) + r * a.lds : nullptr;
    // c_t, y and the saved gates go to memory nothing has touched yet: ask for the row two
    // ahead's lines for writing now, so their read-for-ownership overlaps this row's work.
    // Measured (Intel Xeon with AMX, T = 50, N = 168, C = K = 512, C++ loops over
    // lstm::forward, two threads): with the bf16 gate saves, the bf16 forward with saves 1.08x
    // (the bf16 saves alone, or the prefetch alone: 1.00-1.02x), inference 1.03-1.07x; fp32
    // equal.
    if (r + 2 < rows) {
      for (int64_t j = 0; j < cols; j += int64_t(64 / sizeof(float))) __builtin_prefetch(cn + 2 * a.ldc + j, 1, 3);
      for (int64_t j = 0; j < cols; j += int64_t(64 / sizeof(Ty))) {
        __builtin_prefetch(y + 2 * a.ldy + j, 1, 3);
        if constexpr (G && !S)
          for (int q = 0; q < kGates; ++q) __builtin_prefetch(sv + 2 * a.lds + q * sk + j, 1, 3);
      }
    }
    // No loop-carried dependencies: c_t may overwrite c_{t-1} in place, element by element.
#pragma GCC ivdep
    for (int64_t j = 0; j < cols; ++j) {
      const float c = gi[gk + j] * cp[j] + gi[j] * gi[2 * gk + j];
      const float hv = gi[3 * gk + j] * tanh_f(c);
      cn[j] = c;
      y[j] = from_f32<Ty>(hv);
      if constexpr (H) h[j] = from_f32<Th>(hv);
      if constexpr (G && !S)
        for (int q = 0; q < kGates; ++q) sv[q * sk + j] = from_f32<Ty>(gi[q * gk + j]);
    }
    if constexpr (S)
      for (int q = 0; q < kGates; ++q) stream_bytes(sv + q * sk, gi + q * gk, size_t(cols) * sizeof(float));
  }
}

template <class Ty, class Th>
JB_INLINE void cell_fwd_loop(const CellFwd& a) {
  if (a.h) a.saved ? cell_fwd_rows<Ty, Th, true, true>(a) : cell_fwd_rows<Ty, Th, true, false>(a);
  else a.saved ? cell_fwd_rows<Ty, Th, false, true>(a) : cell_fwd_rows<Ty, Th, false, false>(a);
}

struct CellBwd {
  int64_t rows, cols, k;
  const void* g;  // saved activated gates (dt) at (n0, k0) of gate 0, rows ldg apart,
  int64_t ldg, gk;  // gate q at column q * gk (GateLayout)
  const float* c;   // c_t, leading dim ldc (also of cp, dhr, dc)
  const float* cp;  // c_{t-1}
  int64_t ldc;
  const float* dhr;  // da_{t+1} @ R^T; at the last step the final carry's dh (or zeros)
  const void* dy;    // dt, leading dim ldy
  int64_t ldy;
  float* dc;         // in: dc_t from the step after, out: dc_{t-1}
  void* da;          // dt, leading dim ldda
  int64_t ldda;
  void* dak;  // the multiply dtype, for the next step's BRGEMM, leading dim lddak
  int64_t lddak;
  float* db;  // this N-block's partial bias gradient at k0 of gate 0
};

template <class Tx, class Tk>
JB_INLINE void cell_bwd_loop(const CellBwd& a) {
  // When da and the next step's copy share a dtype, da is streamed from that copy after each
  // row (below) instead of stored element by element.
  constexpr bool S = std::is_same_v<Tx, Tk>;
  const int64_t rows = a.rows, cols = a.cols, k = a.k, gk = a.gk;
  for (int64_t r = 0; r < rows; ++r) {
    const Tx* g = static_cast<const Tx*>(a.g) + r * a.ldg;
    const float* c = a.c + r * a.ldc;
    const float* cp = a.cp + r * a.ldc;
    const float* dhr = a.dhr + r * a.ldc;
    const Tx* dy = static_cast<const Tx*>(a.dy) + r * a.ldy;
    float* dc = a.dc + r * a.ldc;
    Tx* da = static_cast<Tx*>(a.da) + r * a.ldda;
    Tk* dak = static_cast<Tk*>(a.dak) + r * a.lddak;
    float* db = a.db;
    // da goes to memory nothing has read for a long time (T x N x 4K). Stored element by
    // element, ask for the row two ahead's lines for writing now, so their
    // read-for-ownership overlaps this row's work. Measured (Intel Xeon, fp32, T = 50,
    // interleaved pairs of lstm::bptt, medians of 15): 1.05-1.06x at N = 168, C = K = 512,
    // 1.04x at 1024, 1.05x at N = 64, C = K = 256. The same for the reads (the gates, c, dy)
    // gained nothing. Streamed (no read-for-ownership at all), against that (AMD EPYC Zen 4,
    // C++ loops over lstm::bptt, interleaved): fp32 1.03-1.06x at N = 168, C = K = 256,
    // 1.00-1.02x at 512 and 1024 (N = 64: 1.00-1.07x at 512, within +-4 % at 1024); bf16
    // at N = 168 1.03-1.44x at C = K = 256, 0.88-1.09x at 512 (noisy).
    if (!S && r + 2 < rows)
      for (int64_t j = 0; j < cols; j += int64_t(64 / sizeof(Tx)))
        for (int g = 0; g < kGates; ++g) __builtin_prefetch(static_cast<Tx*>(a.da) + (r + 2) * a.ldda + g * k + j, 1, 3);
    // Every array is distinct but dc, which is updated element by element in place. No
    // conditions in the loop: the vectorizer turns them into masked loads, and a masked
    // load from a null array (the fault suppressed lane by lane) took 40 % of the loop's
    // time on the Zen 4 measured.
#pragma GCC ivdep
    for (int64_t j = 0; j < cols; ++j) {
      const float dh = to_f32(dy[j]) + dhr[j];
      const float i = to_f32(g[j]), f = to_f32(g[gk + j]), gg = to_f32(g[2 * gk + j]), o = to_f32(g[3 * gk + j]);
      const float tc = tanh_f(c[j]);
      const float dcur = dc[j] + dh * o * (1.0f - tc * tc);
      const float da_i = dcur * gg * i * (1.0f - i);
      const float da_f = dcur * cp[j] * f * (1.0f - f);
      const float da_g = dcur * i * (1.0f - gg * gg);
      const float da_o = dh * tc * o * (1.0f - o);
      dc[j] = dcur * f;
      if constexpr (!S) {
        da[j] = from_f32<Tx>(da_i);
        da[k + j] = from_f32<Tx>(da_f);
        da[2 * k + j] = from_f32<Tx>(da_g);
        da[3 * k + j] = from_f32<Tx>(da_o);
      }
      dak[j] = from_f32<Tk>(da_i);
      dak[k + j] = from_f32<Tk>(da_f);
      dak[2 * k + j] = from_f32<Tk>(da_g);
      dak[3 * k + j] = from_f32<Tk>(da_o);
      db[j] += da_i;
      db[k + j] += da_f;
      db[2 * k + j] += da_g;
      db[3 * k + j] += da_o;
    }
    if constexpr (S)
      for (int q = 0; q < kGates; ++q) stream_bytes(da + q * k, dak + q * k, size_t(cols) * sizeof(Tx));
  }
}

template <class A, class B>
void cell_fwd_base(const CellFwd& a) { cell_fwd_loop<A, B>(a); }
template <class A, class B>
void cell_bwd_base(const CellBwd& a) { cell_bwd_loop<A, B>(a); }
#if defined(JB_X86)
template <class A, class B>
JB_TARGET_AVX2 void cell_fwd_avx2(const CellFwd& a) { cell_fwd_loop<A, B>(a); }
template <class A, class B>
JB_TARGET_AVX2 void cell_bwd_avx2(const CellBwd& a) { cell_bwd_loop<A, B>(a); }
template <class A, class B>
JB_TARGET_AVX512 void cell_fwd_avx512(const CellFwd& a) { cell_fwd_loop<A, B>(a); }
template <class A, class B>
JB_TARGET_AVX512 void cell_bwd_avx512(const CellBwd& a) { cell_bwd_loop<A, B>(a); }
#endif

// The cell functions for (dt, multiply dtype) on an ISA, chosen once by the plan.
template <class A, class B>
void (*fwd_fn(Isa isa))(const CellFwd&) {
#if defined(JB_X86)
  if (isa >= Isa::avx512) return &cell_fwd_avx512<A, B>;
  if (isa == Isa::avx2) return &cell_fwd_avx2<A, B>;
#endif
  (void)isa;
  return &cell_fwd_base<A, B>;
}
template <class A, class B>
void (*bwd_fn(Isa isa))(const CellBwd&) {
#if defined(JB_X86)
  if (isa >= Isa::avx512) return &cell_bwd_avx512<A, B>;
  if (isa == Isa::avx2) return &cell_bwd_avx2<A, B>;
#endif
  (void)isa;
  return &cell_bwd_base<A, B>;
}

void (*pick_fwd(DType dt, DType kd, Isa isa))(const CellFwd&) {
  if (dt == DType::f32) return fwd_fn<float, float>(isa);
  return kd == DType::f32 ? fwd_fn<uint16_t, float>(isa) : fwd_fn<uint16_t, uint16_t>(isa);
}
void (*pick_bwd(DType dt, DType kd, Isa isa))(const CellBwd&) {
  if (dt == DType::f32) return bwd_fn<float, float>(isa);
  return kd == DType::f32 ? bwd_fn<uint16_t, float>(isa) : bwd_fn<uint16_t, uint16_t>(isa);
}

// Copies `rows` rows of `cols` elements between arrays of dtypes from -> to (fp32 <-> bf16
// or the same), zero-filling columns [cols, zero_to) of each destination row.
void copy_rows(const void* src, DType from, int64_t lds, void* dst, DType to, int64_t ldd,
               int64_t rows, int64_t cols, int64_t zero_to) {
  const size_t fs = dtype_size(from), ts = dtype_size(to);
  for (int64_t r = 0; r < rows; ++r) {
    const char* s = off(src, r * lds, fs);
    char* d = off(dst, r * ldd, ts);
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

// Packs rows [r0, r0 + red) of the stacked weights [W; R; 0] (W: rows [0, hoff), R: rows
// [hoff, hoff + k)), columns [col, col + cols) of both (leading dimension ld), into one
// reduction block. A block straddling W and R is staged contiguously first, in `stage`
// (kMaxRed x kMaxCols elements of w_dt).
void pack_stacked(const void* w, const void* r, DType w_dt, int64_t hoff, int64_t k, int64_t ld,
                  int64_t col, int64_t r0, int64_t red, int64_t cols, int64_t bc, DType kd, bool vnni,
                  char* dst, char* stage, Isa isa) {
  const int64_t r1 = r0 + red;
  if (r1 <= hoff || r0 >= hoff) {  // all from W, or all from R and its zero pad
    const bool from_w = r1 <= hoff;
    const int64_t src_row = from_w ? r0 : r0 - hoff;
    const int64_t rows = std::max<int64_t>(0, std::min(red, (from_w ? hoff : k) - src_row));
    reblock::pack(at(from_w ? w : r, w_dt, src_row * ld + col), w_dt, ld, false, rows, cols, red, bc, kd,
                  vnni, dst, isa);
    return;
  }
  const size_t ws = dtype_size(w_dt);
  const int64_t wrows = hoff - r0, rrows = std::min(r1 - hoff, k);
  for (int64_t q = 0; q < wrows; ++q)
    std::memcpy(stage + q * cols * int64_t(ws), at(w, w_dt, (r0 + q) * ld + col), size_t(cols) * ws);
  for (int64_t q = 0; q < rrows; ++q)
    std::memcpy(stage + (wrows + q) * cols * int64_t(ws), at(r, w_dt, q * ld + col), size_t(cols) * ws);
  reblock::pack(stage, w_dt, cols, false, wrows + rrows, cols, red, bc, kd, vnni, dst, isa);
}

GateLayout gate_layout(const Shape& s, const Dispatch& dp) {
  const auto d = saved_gate_dims(s, dp);
  return {s.n, d[3] / kGates, d[1]};
}

// ---------------------------------------------------------------------------------------
// The forward's plan.
//
// fused       A_t = [x_t | h_{t-1} | 0] for all T steps in one buffer with x's row order
//             (lda columns, the multiply dtype), zero-padded to whole reduction blocks; the
//             weight panel of (gate, K-block) holds the blocks of [W; R; 0] in the same
//             order. Training keeps the buffer: it is the weight update's operand
//             [x | h_prev] (the `xh` output), so no pass builds it again.
// precompute  gates = x @ W + b first (A: x in place, or copied when it must be widened);
//             A_t = [h_{t-1} | 0] in two alternating buffers; per step the gate blocks
//             accumulate h_{t-1} @ R onto the precomputed ones.

struct FwdPlan {
  FwdPlan(const Dispatch& dp, const Shape& s, Variant v, Blocking chosen, int64_t threads)
      : s(s),
        v(v),
        b(clamped(chosen, s.n, s.k)),
        isa(dp.isa),
        kd(multiply_dtype(s.dt, dp)),
        vnni(kd == DType::bf16),
        ks(dtype_size(kd)),
        kblk(ceil_div(s.k, b.cols)),
        nblk(ceil_div(s.n, b.rows)),
        sub(sub_cols(b.cols, isa, kd)),
        nsub(ceil_div(b.cols, sub)),
        groups(kblk, nblk, threads),
        gl(gate_layout(s, dp)),
        cell(pick_fwd(s.dt, kd, dp.isa)) {
    if (b.cols > kMaxCols) throw std::invalid_argument("lstm forward: K-blocks are at most 128 columns");
    // The per-step batch: the blocks of [x | h] (fused) or of h (precompute).
    hoff = v == Variant::fused ? s.c : 0;
    red = padded_block(hoff + s.k, vnni ? 2 : 1, kMaxRed);
    rpad = round_up(hoff + s.k, red);
    lda = v == Variant::fused ? saved_width(s, dp) : padded_ld(rpad, ks);
    astride = v == Variant::fused ? row_step(s) * lda : lda;
    rblk = rpad / red;
    blk = reblock::block_elems(red, sub, vnni);
    ldt = padded_ld(kGates * b.cols, sizeof(float));
    for (int g = 0; g < kGates; ++g) {
      step[g].emplace(desc(red, astride, v == Variant::precompute, v == Variant::fused, kGateAct[g], kGates * s.k),
                      s.n, s.k, b.rows, sub, isa);
      if (v == Variant::fused) step_tile[g].emplace(desc(red, astride, false, true, kGateAct[g], ldt), s.n, s.k, b.rows, sub, isa);
    }
    if (v == Variant::precompute) {
      red_x = reduction_block(s.c, vnni);
      xblk = s.c / red_x;
      blk_x = reblock::block_elems(red_x, sub, vnni);
      x_copy = s.dt != kd;
      ldx = x_copy ? padded_ld(s.c, ks) : row_step(s) * s.c;
      pre.emplace(desc(red_x, ldx, false, true, Activation::none, kGates * s.k), s.n, s.k, b.rows, sub, isa);
    }
  }

  BrgemmDesc desc(int64_t k, int64_t lda_, bool accumulate, bool bias, Activation act, int64_t ldc) const {
    BrgemmDesc d;
    d.k = k;
    d.lda = lda_;
    d.ldb = vnni ? 2 * sub : sub;
    d.ldc = ldc;
    d.ab = kd;
    d.c = DType::f32;
    d.accumulate = accumulate;
    d.bias = bias;
    d.act = act;
    return d;
  }
  // Element offset of sub-panel j of the weight panel (g, kb) in a panel array of `nb`
  // blocks of `be` elements per sub-panel.
  int64_t panel(int g, int64_t kb, int64_t j, int64_t nb, int64_t be) const {
    return ((g * kblk + kb) * nsub + j) * nb * be;
  }

  const Shape s;
  const Variant v;
  const Blocking b;
  const Isa isa;
  const DType kd;
  const bool vnni;
  const size_t ks;
  const int64_t kblk, nblk;
  const int64_t sub, nsub;  // sub-panel width and sub-panels per K-block
  const WorkGroups groups;
  const GateLayout gl;  // of the saved gates
  void (*const cell)(const CellFwd&);
  // h's column in A, the padded reduction, A's columns and the rows between (t, n) and
  // (t, n + 1) in A.
  int64_t hoff = 0, red = 0, rpad = 0, lda = 0, astride = 0, rblk = 0, blk = 0;
  int64_t ldt = 0;  // the gate tile's leading dimension (rows of four K-blocks)
  int64_t red_x = 0, xblk = 0, blk_x = 0, ldx = 0;
  bool x_copy = false;
  // The gates into the step's gate buffer (N x 4K), or into an item's gate tile (fused).
  std::optional<KernelSet> step[kGates], step_tile[kGates];
  std::optional<KernelSet> pre;
};

// Everything a plan depends on.
using Key = std::array<int64_t, 13>;
Key key_of(const Shape& s, int64_t variant, int64_t threads, const Dispatch& dp, const Blocking* f) {
  return {s.t, s.n, s.c, s.k, int64_t(s.dt), s.time_major, variant, threads, int64_t(dp.isa),
          int64_t(dp.bf16_multiply), f ? f->rows : -1, f ? f->cols : -1, 0};
}

PlanCache<13, FwdPlan> fwd_plans;

// ---------------------------------------------------------------------------------------
// The backward-through-time plan: R^T re-blocked [Kb][4K / red][red][bk] once per call;
// two alternating N x 4K buffers hold da_t in the multiply dtype as the next step's A.
// (Reading da_t in place instead, its rows padded, measured 2-4 % slower inside jitted
// bptt calls, fp32 N = 168 C = K = 1024, Intel Xeon: the compact copy is the better A.)

struct BwdPlan {
  BwdPlan(const Dispatch& dp, const Shape& s, Blocking chosen, int64_t threads)
      : s(s),
        b(clamped(chosen, s.n, s.k)),
        isa(dp.isa),
        kd(multiply_dtype(s.dt, dp)),
        vnni(kd == DType::bf16),
        ks(dtype_size(kd)),
        kblk(ceil_div(s.k, b.cols)),
        nblk(ceil_div(s.n, b.rows)),
        red(reduction_block(kGates * s.k, vnni)),
        rblk(kGates * s.k / red),
        sub(sub_cols(b.cols, isa, kd)),
        nsub(ceil_div(b.cols, sub)),
        blk(reblock::block_elems(red, sub, vnni)),
        width(da_width(s)),
        ldda(padded_ld(kGates * s.k, ks)),
        groups(kblk, nblk, threads),
        gl(gate_layout(s, dp)),
        kernels(desc(), s.n, s.k, b.rows, sub, dp.isa),
        cell(pick_bwd(s.dt, kd, dp.isa)) {}

  BrgemmDesc desc() const {
    BrgemmDesc d;
    d.k = red;
    d.lda = ldda;
    d.ldb = vnni ? 2 * sub : sub;
    d.ldc = s.k;
    d.ab = kd;
    d.c = DType::f32;
    return d;
  }

  const Shape s;
  const Blocking b;
  const Isa isa;
  const DType kd;
  const bool vnni;
  const size_t ks;
  const int64_t kblk, nblk, red, rblk, sub, nsub, blk;  // blk: one sub-panel's block
  const int64_t width, ldda;  // the rows of da and of its copies
  const WorkGroups groups;
  const GateLayout gl;  // of the saved gates
  const KernelSet kernels;
  void (*const cell)(const CellBwd&);
};

PlanCache<13, BwdPlan> bwd_plans;

}  // namespace

// ---------------------------------------------------------------------------------------

// Bytes per element of the weight panels a pass streams: bf16 multiplied on AMX tiles counts
// as bf16. (bf16 by vdpbf16ps on the AMD EPYC Zen 4 measured best at fp32's widths.)
int64_t panel_elem_bytes(const Shape& s, const Dispatch& dp) {
  return dp.isa == Isa::amx && multiply_dtype(s.dt, dp) == DType::bf16 ? 2 : int64_t(sizeof(float));
}

// The forward's item streams its four gate panels (rows of [W; R] x cols) for each of its
// N-blocks: K-blocks as wide as keeps them within kPanelBytes. Measured (Intel Xeon, T = 50,
// forward with saves, three alternating runs each): fp32 C = K = 256 at N = 64 and 168: 32
// columns 146-165 GFLOP/s, 128 columns 196-210; C = K = 512: 64 columns 3-5 % faster than 32,
// 128 columns (2 MiB) 5-15 % slower at N = 64; C = K = 1024: 32 columns (the only width
// within 1 MiB) equal to or faster than 64 and 128. bf16 on AMX (C++ loops, two threads,
// ms): C = K = 512, N = 168: 32 columns 51-62, 64: 48-51, 128: 44-48; N = 64: 21-22, 21,
// 20; C = K = 1024, N = 168: 142-145, 136-143, 132-141; N = 64: 60, 57-58, 65.
Blocking step_blocking(const Shape& s, int64_t threads, const Dispatch& dp) {
  auto gate_panels = [&](int64_t cols) { return kGates * (s.c + s.k) * cols * panel_elem_bytes(s, dp); };
  Blocking b;
  b.cols = kCols;
  while (b.cols < kMaxCols && gate_panels(2 * b.cols) <= kPanelBytes) b.cols *= 2;
  b.cols = std::min(s.k, b.cols);
  b.rows = split_rows(s.n, ceil_div(s.k, b.cols), threads);
  return b;
}

// The backward's cell reads the saved gates and writes da from and to memory, row piece by
// row piece: wider K-blocks make those pieces longer, but also the R^T panel each item
// streams per N-block (4K x cols). Measured (AMD EPYC Zen 4, 1 MiB L2, T = 50, ms of bptt):
//   fp32 K = 512, N = 168:   128 columns 115, 32 columns 138 (64: 139, 256: 123)
//   fp32 K = 256, N = 168:   128: 35, 32: 41
//   fp32 K = 1024, N = 64:   128: 204-211, 32: 183-185 (the 2 MiB panel leaves L2)
//   fp32 K = 1024, N = 168:  equal within the noise
//   bf16 K = 256, N = 168:   128: 24, 32: 18; K = 512: equal
// So 128 columns while that panel fits in L2, else 32; bf16 by vdpbf16ps takes 32. On an
// Intel Xeon with a 2 MiB L2 (fp32, N = 168, C++ loop, medians of 6), with panels of
// [red][cols] blocks:
//   K = 512:   32 columns 107-109, 64: 101-103, 128: 89-93, 256: 96-100 (rows 24-84 equal)
//   K = 1024:  32 columns 342-361, 64: 373-385, 128: 437-448, 256: 436-482
// and with the panels in 32-column sub-panels (kSubCols; two threads, ms): K = 1024, N = 168:
// 32 columns 250, 64: 236, 128: 222 (rows 24: 238, 48: 228, 168: 219); N = 64: 98 and 93 (32,
// 128); K = 256: 25 and 15. For bf16 on its AMX tiles, whose panels are half the bytes (C++
// loops, two threads, [red][cols] blocks):
//   N = 168:   K = 256: 32 columns 11, 128: 7; K = 512: 30, 25; K = 1024: 87-88, 76-77
//   N = 64:    K = 256: 4.4, 3.0; K = 512: 10.3, 9.8; K = 1024: 30-34, 33
// The Zen 4 numbers predate the sub-panels; its 1 MiB L2 keeps its measured choices.
Blocking bptt_blocking(const Shape& s, int64_t threads, const Dispatch& dp) {
  const int64_t es = panel_elem_bytes(s, dp);
  const bool wide = multiply_dtype(s.dt, dp) == DType::f32 || es == 2;
  const bool fits = kGates * s.k * kMaxCols * es <= l2_bytes();
  Blocking b;
  b.cols = std::min(s.k, wide && fits ? kMaxCols : kCols);
  b.rows = split_rows(s.n, ceil_div(s.k, b.cols), threads);
  return b;
}

// Measured (AMD EPYC Zen 4, 2 vCPUs, T = 50, C = K in {256, 512, 1024}, N in {64, 168}, fp32
// and bf16): fused was faster or equal in 16 of 19 samples, by up to 1.9x in bf16 at C = K =
// 256 (the precompute pass writes and re-reads every gate through memory); precompute won
// only scattered samples within the machine's noise. So: fused everywhere. An Intel Xeon
// agreed (fp32, forward with saves, medians of 7): fused 7-11 % faster at C = K = 256 and
// 512, equal at 1024. The precompute variant stays (tested) for machines where the rule
// should change.
Variant forward_variant(const Shape&, int64_t, const Dispatch&) { return Variant::fused; }

// Measured (AMD EPYC Zen 4, fp32, T = 50, C++ loops over lstm::forward and lstm::bptt, six
// alternating pairs): against the gates saved as (T, N, 4K) rows, bptt 1.01-1.04x at N = 168,
// C = K = 1024 (32-column blocks) and 1.05x at N = 64; the forward and 256 / 512 (128-column
// blocks) equal.
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
  const DType kd = multiply_dtype(s.dt, dp);
  const int64_t red = padded_block(s.c + s.k, kd == DType::bf16 ? 2 : 1, kMaxRed);
  return padded_ld(round_up(s.c + s.k, red), dtype_size(kd), row_step(s));
}

void forward(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* w,
             const void* r, DType w_dt, const float* bias, const float* c0, const void* h0,
             void* y, float* c_last, void* h_last, void* gates, float* cs, void* xh, Variant variant,
             const Blocking* force) {
  if (s.n <= 0 || s.k <= 0) return;
  const size_t es = dtype_size(s.dt);
  if (s.t <= 0) {  // an empty sequence: the carry passes through
    std::memcpy(c_last, c0, size_t(s.n * s.k) * sizeof(float));
    std::memcpy(h_last, h0, size_t(s.n * s.k) * es);
    return;
  }
  if (variant == Variant::automatic || s.c <= 0) variant = s.c <= 0 ? Variant::fused : forward_variant(s, ex.num_threads, dp);
  const auto plan = fwd_plans.get(key_of(s, int64_t(variant), ex.num_threads, dp, force), [&] {
    return FwdPlan(dp, s, variant, force ? *force : step_blocking(s, ex.num_threads, dp), ex.num_threads);
  });
  const FwdPlan& p = *plan;
  const Blocking& b = p.b;
  const bool fused = p.v == Variant::fused, save = gates != nullptr;
  // Fused, the BRGEMMs write the gates to a gate tile of the item's own, hot in L2, from
  // which the cell reads them and saves them when training: fp32 streamed to memory as they
  // are, bf16 as bf16 copies (half the bytes to memory here and in the backward). Streaming
  // measured (AMD EPYC Zen 4, fp32, T = 50, N = 168, C++ loops over lstm::forward, medians of
  // 25 interleaved pairs) 1.04-1.08x at C = K = 256, 1.01-1.02x at 512, against the BRGEMMs
  // writing the gates to the saved array themselves, which had beaten a copy by ordinary
  // stores (0.93-0.99x). Precompute saves them from its gate buffer the same way.
  const bool tiles = fused;
  const int64_t K = s.k, G4 = kGates * s.k, N = s.n, T = s.t;
  const size_t ks = p.ks;
  // The fused A buffer is the saved xh itself when training in the multiply dtype;
  // otherwise xh is filled from x and y after the loop.
  const bool a_is_xh = fused && xh && s.dt == p.kd;

  // Scratch: the weight panels (stacked [W; R] or R), W's panels (precompute), the A
  // buffers, every step's fp32 gates (precompute, unless saved in place), a widened copy of
  // x (precompute, bf16 x with fp32 multiplies), pack_stacked's stages and the gate tiles
  // (one per item running at once).
  const size_t panels = size_t(kGates * p.kblk * p.nsub * p.rblk * p.blk) * ks;
  const size_t xpanels = fused ? 0 : size_t(kGates * p.kblk * p.nsub * p.xblk * p.blk_x) * ks;
  const size_t abuf = a_is_xh ? 0 : size_t((fused ? T : 2) * N * p.lda) * ks;
  const size_t gbuf = fused ? 0 : size_t(T * N * G4) * sizeof(float);
  const size_t xbuf = !fused && p.x_copy ? size_t(T * N * p.ldx) * ks : 0;
  const size_t stage = size_t(kMaxRed * kMaxCols) * dtype_size(w_dt);
  const int64_t stages = std::max<int64_t>(1, ex.num_threads);
  const size_t tile = tiles ? size_t(b.rows * p.ldt) * sizeof(float) : 0;
  const auto buf = Scratch::get<7>({panels, xpanels, abuf, gbuf, xbuf, size_t(stages) * stage,
                                    size_t(stages) * round_up(tile, 64)});
  PanelPool stage_pool(buf[5], stage, stages), tile_pool(buf[6], tile, stages);
  char* const wp = buf[0];
  char* const xp = buf[1];
  char* const ab = a_is_xh ? static_cast<char*>(xh) : buf[2];
  float* const gs = reinterpret_cast<float*>(buf[3]);
  char* const xc = buf[4];
  // Step t's A and (t, n0)'s row in it.
  auto a_step = [&](int64_t t) { return ab + (fused ? row_of(s, t, 0) * p.lda : t % 2 * N * p.lda) * ks; };

  // The cell state: the saved c_t, or c_last updated in place.
  if (!save) std::memcpy(c_last, c0, size_t(N * K) * sizeof(float));

  // Re-blocking, once per call: the weight panels (one item per gate and K-block), and the
  // A buffers (one item per step: x_t, or h0 into step 0's h part, zero pads).
  const int64_t witems = kGates * p.kblk;
  const int64_t aitems = fused ? T : 1 + (p.x_copy ? T : 0);
  parallel_for(ex, witems + aitems, [&](int64_t i) {
    if (i < witems) {
      const int g = int(i / p.kblk);
      const int64_t kb = i % p.kblk, k0 = kb * b.cols, cols = std::min(b.cols, K - k0);
      // Rows [0, hoff) of the panel come from W, [hoff, hoff + K) from R (fused; a block may
      // straddle the two), zeros after; precompute: R's panel here and W's in its own array.
      const PanelPool::Lease st(stage_pool);
      for (int64_t j = 0; j < p.nsub && j * p.sub < cols; ++j) {
        const int64_t col = g * K + k0 + j * p.sub, w_cols = std::min(p.sub, cols - j * p.sub);
        char* dst = wp + p.panel(g, kb, j, p.rblk, p.blk) * ks;
        for (int64_t rb = 0; rb < p.rblk; ++rb)
          pack_stacked(w, r, w_dt, p.hoff, K, G4, col, rb * p.red, p.red, w_cols, p.sub, p.kd, p.vnni,
                       dst + rb * p.blk * ks, st.data, p.isa);
        if (fused) continue;
        char* xdst = xp + p.panel(g, kb, j, p.xblk, p.blk_x) * ks;
        for (int64_t cb = 0; cb < p.xblk; ++cb)
          reblock::pack(at(w, w_dt, cb * p.red_x * G4 + col), w_dt, G4, false, p.red_x, w_cols, p.red_x,
                        p.sub, p.kd, p.vnni, xdst + cb * p.blk_x * ks, p.isa);
      }
      return;
    }
    const int64_t j = i - witems;
    if (fused) {  // step j's A: [x_j | h0 (j = 0) | 0]
      char* a = a_step(j);
      copy_rows(at(x, s.dt, row_of(s, j, 0) * s.c), s.dt, row_step(s) * s.c, a, p.kd, p.astride, N, s.c,
                s.c);
      if (j == 0) {
        copy_rows(h0, s.dt, K, a + s.c * ks, p.kd, p.astride, N, K, p.lda - s.c);
      } else if (p.lda > s.c + K) {
        for (int64_t n = 0; n < N; ++n)
          std::memset(a + (n * p.astride + s.c + K) * ks, 0, size_t(p.lda - s.c - K) * ks);
      }
    } else if (j == 0) {  // [h0 | 0] into the first h buffer, the pad of the second
      copy_rows(h0, s.dt, K, ab, p.kd, p.lda, N, K, p.rpad);
      if (p.rpad > K)
        for (int64_t n = 0; n < N; ++n)
          std::memset(ab + ((N + n) * p.lda + K) * ks, 0, size_t(p.rpad - K) * ks);
    } else {  // x_{j-1} widened for the precompute pass
      const int64_t t = j - 1;
      copy_rows(at(x, s.dt, row_of(s, t, 0) * s.c), s.dt, row_step(s) * s.c, xc + t * N * p.ldx * ks,
                p.kd, p.ldx, N, s.c, s.c);
    }
  });

  // precompute: gates = x @ W + b for every step, one large pass; items (K-block, step),
  // the four gates of an item share its x rows, its W panels serve every N-block.
  if (!fused) {
    const char* xa = p.x_copy ? xc : static_cast<const char*>(x);
    parallel_for(ex, p.kblk * T, [&](int64_t i) {
      const int64_t kb = i / T, t = i % T, k0 = kb * b.cols, cols = std::min(b.cols, K - k0);
      const char* a = p.x_copy ? xa + t * N * p.ldx * ks : off(x, row_of(s, t, 0) * s.c, ks);
      for (int64_t nb = 0; nb < p.nblk; ++nb) {
        const int64_t n0 = nb * b.rows, rows = std::min(b.rows, N - n0);
        for (int g = 0; g < kGates; ++g)
          for (int64_t j = 0; j * p.sub < cols; ++j) {
            const int64_t c0 = g * K + k0 + j * p.sub;
            (*p.pre)(rows, std::min(p.sub, cols - j * p.sub))
                .strided(a + n0 * p.ldx * ks, p.red_x, xp + p.panel(g, kb, j, p.xblk, p.blk_x) * ks, p.blk_x,
                         p.xblk, gs + (t * N + n0) * G4 + c0, bias + c0);
          }
      }
    });
  }

  // The time loop: one parallel_for per step (the step barrier).
  for (int64_t t = 0; t < T; ++t) {
    float* gt = tiles ? nullptr : gs + t * N * G4;
    const char* a_t = a_step(t);
    char* h_next = t + 1 < T ? a_step(t + 1) + p.hoff * ks : nullptr;
    const float* c_prev = save ? (t ? cs + (t - 1) * N * K : c0) : c_last;
    float* c_next = save ? cs + t * N * K : c_last;
    parallel_for(ex, p.groups.items(), [&](int64_t i) {
      const int64_t kb = p.groups.panel(i), k0 = kb * b.cols, cols = std::min(b.cols, K - k0);
      const PanelPool::Lease lt(tile_pool);
      float* const gtile = reinterpret_cast<float*>(lt.data);
      for (int64_t nb = p.groups.first(i); nb < p.groups.last(i); ++nb) {
        const int64_t n0 = nb * b.rows, rows = std::min(b.rows, N - n0);
        float* const g0 = tiles ? gtile : gt + n0 * G4 + k0;  // gate 0 of the tile
        const int64_t ldg = tiles ? p.ldt : G4, gk = tiles ? b.cols : K;
        for (int g = 0; g < kGates; ++g)
          for (int64_t j = 0; j * p.sub < cols; ++j)
            (*(tiles ? p.step_tile : p.step)[g])(rows, std::min(p.sub, cols - j * p.sub))
                .strided(a_t + n0 * p.astride * ks, p.red, wp + p.panel(g, kb, j, p.rblk, p.blk) * ks, p.blk,
                         p.rblk, g0 + g * gk + j * p.sub, fused ? bias + g * K + k0 + j * p.sub : nullptr);
        // The cell per piece of the tile within one block of the saved gates.
        for_pieces(k0, cols, save ? p.gl.bc : K, [&](int64_t k, int64_t w) {
          CellFwd c{rows, w, g0 + (k - k0), ldg, gk, c_prev + n0 * K + k, c_next + n0 * K + k, K,
                    off(y, row_of(s, t, n0) * K + k, es), row_step(s) * K,
                    h_next ? h_next + (n0 * p.astride + k) * ks : nullptr, p.astride,
                    save ? off(gates, p.gl.at(t, n0, k), es) : nullptr, p.gl.row(), p.gl.bc};
          p.cell(c);
        });
      }
      stream_fence();
    });
  }

  // The final carry.
  copy_rows(at(y, s.dt, row_of(s, T - 1, 0) * K), s.dt, row_step(s) * K, h_last, s.dt, K, N, K, K);
  if (save) std::memcpy(c_last, cs + (T - 1) * N * K, size_t(N * K) * sizeof(float));

  // xh when the loop did not run in it: [x_t | h_{t-1} | 0] from x, h0 and y, one item a step.
  if (xh && !a_is_xh) {
    const int64_t ld = saved_width(s, dp), stride = row_step(s) * ld;
    parallel_for(ex, T, [&](int64_t t) {
      char* dst = off(xh, row_of(s, t, 0) * ld, es);
      copy_rows(at(x, s.dt, row_of(s, t, 0) * s.c), s.dt, row_step(s) * s.c, dst, s.dt, stride, N, s.c, s.c);
      if (t == 0) copy_rows(h0, s.dt, K, dst + s.c * es, s.dt, stride, N, K, ld - s.c);
      else copy_rows(at(y, s.dt, row_of(s, t - 1, 0) * K), s.dt, row_step(s) * K, dst + s.c * es, s.dt, stride,
                     N, K, ld - s.c);
    });
  }
}

// ---------------------------------------------------------------------------------------
// Backward through time. Per step t = T-1 .. 0, item (K-block, group of N-blocks):
//   dh  = dy_t + (da_{t+1} @ R^T: one BRGEMM over the 4K-blocks; at T-1 dh_last or 0)
//   da_t, dc_{t-1} from the saved gates and cell states (fused, the tile hot in L1)
// then dh0 = da_0 @ R^T. dc is kept in dc0 in place (each tile has one owner per step).

void bptt(const Executor& ex, const Dispatch& dp, const Shape& s, const void* r, DType w_dt,
          const void* gates, const float* cs, const float* c0, const void* dy,
          const float* dc_last, const void* dh_last, void* da, float* db, float* dc0, void* dh0,
          const Blocking* force) {
  const int64_t K = s.k, G4 = kGates * s.k, N = s.n, T = s.t;
  if (K <= 0) return;
  const size_t es = dtype_size(s.dt);
  std::memset(db, 0, size_t(G4) * sizeof(float));
  if (N <= 0) return;
  if (dc_last) std::memcpy(dc0, dc_last, size_t(N * K) * sizeof(float));
  else std::memset(dc0, 0, size_t(N * K) * sizeof(float));
  if (T <= 0) {
    if (dh_last) std::memcpy(dh0, dh_last, size_t(N * K) * es);
    else std::memset(dh0, 0, size_t(N * K) * es);
    return;
  }
  const auto plan = bwd_plans.get(key_of(s, -1, ex.num_threads, dp, force), [&] {
    return BwdPlan(dp, s, force ? *force : bptt_blocking(s, ex.num_threads, dp), ex.num_threads);
  });
  const BwdPlan& p = *plan;
  const Blocking& b = p.b;
  const size_t ks = p.ks;

  const auto buf = Scratch::get<4>({size_t(p.kblk * p.nsub * p.rblk * p.blk) * ks, size_t(2 * N * p.ldda) * ks,
                                    size_t(N * K) * sizeof(float), size_t(p.nblk * G4) * sizeof(float)});
  char* const rt = buf[0];   // R^T panels [Kb][4K / red] blocks
  char* const dak = buf[1];  // da_t for the next step's A, alternating
  float* const dhr = reinterpret_cast<float*>(buf[2]);
  float* const dbp = reinterpret_cast<float*>(buf[3]);  // partial db per N-block
  std::memset(dbp, 0, size_t(p.nblk * G4) * sizeof(float));

  // R^T panel kb, sub-panel j, block rb: element (q, jj) = R[k0 + j * sub + jj, rb * red + q].
  parallel_for(ex, p.kblk, [&](int64_t kb) {
    const int64_t k0 = kb * b.cols, cols = std::min(b.cols, K - k0);
    for (int64_t j = 0; j * p.sub < cols; ++j)
      for (int64_t rb = 0; rb < p.rblk; ++rb)
        reblock::pack(at(r, w_dt, (k0 + j * p.sub) * G4 + rb * p.red), w_dt, G4, true, p.red,
                      std::min(p.sub, cols - j * p.sub), p.red, p.sub, p.kd, p.vnni,
                      rt + ((kb * p.nsub + j) * p.rblk + rb) * p.blk * ks, p.isa);
  });

  auto recurrent = [&](int64_t kb, int64_t n0, int64_t rows, int64_t cols, const char* a) {
    for (int64_t j = 0; j * p.sub < cols; ++j)
      p.kernels(rows, std::min(p.sub, cols - j * p.sub))
          .strided(a + n0 * p.ldda * ks, p.red, rt + (kb * p.nsub + j) * p.rblk * p.blk * ks, p.blk, p.rblk,
                   dhr + n0 * K + kb * b.cols + j * p.sub);
  };
  for (int64_t t = T - 1; t >= 0; --t) {
    const char* a_next = dak + (t + 1) % 2 * N * p.ldda * ks;
    char* a_t = dak + t % 2 * N * p.ldda * ks;
    const float* c_prev = t ? cs + (t - 1) * N * K : c0;
    parallel_for(ex, p.groups.items(), [&](int64_t i) {
      const int64_t kb = p.groups.panel(i), k0 = kb * b.cols, cols = std::min(b.cols, K - k0);
      for (int64_t nb = p.groups.first(i); nb < p.groups.last(i); ++nb) {
        const int64_t n0 = nb * b.rows, rows = std::min(b.rows, N - n0);
        float* dh_in = dhr + n0 * K + k0;
        if (t + 1 < T) recurrent(kb, n0, rows, cols, a_next);
        else if (dh_last) copy_rows(off(dh_last, n0 * K + k0, es), s.dt, K, dh_in, DType::f32, K, rows, cols, cols);
        else for (int64_t q = 0; q < rows; ++q) std::fill_n(dh_in + q * K, cols, 0.0f);
        for_pieces(k0, cols, p.gl.bc, [&](int64_t k, int64_t w) {
          CellBwd c{rows, w, K, off(gates, p.gl.at(t, n0, k), es), p.gl.row(), p.gl.bc,
                    cs + (t * N + n0) * K + k, c_prev + n0 * K + k, K, dhr + n0 * K + k,
                    off(dy, row_of(s, t, n0) * K + k, es), row_step(s) * K, dc0 + n0 * K + k,
                    off(da, row_of(s, t, n0) * p.width + k, es), row_step(s) * p.width,
                    a_t + (n0 * p.ldda + k) * ks, p.ldda, dbp + nb * G4 + k};
          p.cell(c);
        });
      }
      stream_fence();
    });
  }
  // dh0 = da_0 @ R^T, and the bias gradient from the per-N-block partials.
  parallel_for(ex, p.groups.items(), [&](int64_t i) {
    const int64_t kb = p.groups.panel(i), k0 = kb * b.cols, cols = std::min(b.cols, K - k0);
    for (int64_t nb = p.groups.first(i); nb < p.groups.last(i); ++nb) {
      const int64_t n0 = nb * b.rows, rows = std::min(b.rows, N - n0);
      recurrent(kb, n0, rows, cols, dak);
      copy_rows(dhr + n0 * K + k0, DType::f32, K, off(dh0, n0 * K + k0, es), s.dt, K, rows, cols, cols);
    }
  });
  for (int64_t nb = 0; nb < p.nblk; ++nb)
    for (int64_t j = 0; j < G4; ++j) db[j] += dbp[nb * G4 + j];
}

}  // namespace jb::lstm
