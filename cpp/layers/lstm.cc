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

#include "brgemm/activation.h"
#include "layers/common/kernels.h"
#include "layers/common/operand.h"
#include "layers/common/plan_cache.h"
#include "layers/common/reblock.h"
#include "layers/common/scratch.h"
#include "layers/common/work.h"

namespace jb::lstm {

namespace {

// K-block: one register tile wide (2 AVX-512 vectors of fp32 accumulators), so each gate
// block is one column of register tiles and the four gate blocks of an item stay in L1.
constexpr int64_t kCols = 32;
constexpr int kGates = 4;
// Gate g's activation (flax's OptimizedLSTMCell order i, f, g, o).
constexpr Activation kGateAct[kGates] = {Activation::sigmoid, Activation::sigmoid, Activation::tanh,
                                         Activation::sigmoid};

// Rows of x-like arrays: (t, n) is row t * N + n (time-major) or n * T + t.
inline int64_t row_of(const Shape& s, int64_t t, int64_t n) {
  return s.time_major ? t * s.n + n : n * s.t + t;
}
// Rows between (t, n) and (t, n + 1).
inline int64_t row_step(const Shape& s) { return s.time_major ? 1 : s.t; }

// A leading dimension for a buffer we lay out ourselves: padded by a cache line when rows
// would be a multiple of 4 KiB apart (the rows of a register tile would share an L1 set).
inline int64_t padded_ld(int64_t cols, size_t es) {
  return int64_t(cols * es) % 4096 == 0 ? cols + int64_t(64 / es) : cols;
}

// The reduction block for an operand we lay out ourselves as [c | pad | k | pad], each part
// zero-padded to whole blocks: the block that minimises the padded work, with a penalty for
// short blocks (per batch element overhead of the kernel). Even for VNNI pairs.
int64_t padded_red(int64_t c, int64_t k, bool even) {
  int64_t best = 0;
  double best_cost = 0;
  for (int64_t r = even ? 2 : 1; r <= 256; r += even ? 2 : 1) {
    const double cost = double(round_up(c, r) + round_up(k, r)) * (1.0 + 8.0 / double(r));
    if (!best || cost < best_cost - 1e-9) best = r, best_cost = cost;
  }
  return best;
}

inline char* off(void* p, int64_t elems, size_t es) { return static_cast<char*>(p) + elems * int64_t(es); }
inline const char* off(const void* p, int64_t elems, size_t es) {
  return static_cast<const char*>(p) + elems * int64_t(es);
}

// ---------------------------------------------------------------------------------------
// The element-wise cell math of one (N-block, K-block) tile, fused after its gate blocks.
// One templated loop per direction, instantiated for the baseline ISA and, through a
// function-level target attribute, for AVX-512 (taken when the kernels use avx512 or amx).

#define JB_INLINE __attribute__((always_inline)) inline

struct CellFwd {
  int64_t rows, cols, k;  // tile; k = hidden size (gate g is at column offset g * k)
  const float* g;         // activated gates at (n0, k0) of gate 0, leading dim ldg
  int64_t ldg;
  const float* cp;  // c_{t-1}, leading dim ldc
  float* cn;        // c_t (may equal cp: in place)
  int64_t ldc;
  void* y;  // h_t in dt, leading dim ldy
  int64_t ldy;
  void* h;  // h_t in the multiply dtype for the next step, leading dim ldh; or null
  int64_t ldh;
};

template <class Ty, class Th>
JB_INLINE void cell_fwd_loop(const CellFwd& a) {
  const int64_t rows = a.rows, cols = a.cols, k = a.k;
  for (int64_t r = 0; r < rows; ++r) {
    const float* gi = a.g + r * a.ldg;
    const float* cp = a.cp + r * a.ldc;
    float* cn = a.cn + r * a.ldc;
    Ty* y = static_cast<Ty*>(a.y) + r * a.ldy;
    Th* h = a.h ? static_cast<Th*>(a.h) + r * a.ldh : nullptr;
    // No loop-carried dependencies: c_t may overwrite c_{t-1} in place, element by element.
    if (h) {
#pragma GCC ivdep
      for (int64_t j = 0; j < cols; ++j) {
        const float c = gi[k + j] * cp[j] + gi[j] * gi[2 * k + j];
        const float hv = gi[3 * k + j] * tanh_f(c);
        cn[j] = c;
        y[j] = from_f32<Ty>(hv);
        h[j] = from_f32<Th>(hv);
      }
    } else {
#pragma GCC ivdep
      for (int64_t j = 0; j < cols; ++j) {
        const float c = gi[k + j] * cp[j] + gi[j] * gi[2 * k + j];
        cn[j] = c;
        y[j] = from_f32<Ty>(gi[3 * k + j] * tanh_f(c));
      }
    }
  }
}

struct CellBwd {
  int64_t rows, cols, k;
  const float* g;  // saved activated gates at (n0, k0) of gate 0, leading dim ldg
  int64_t ldg;
  const float* c;   // c_t, leading dim ldc (also of cp, dhr, dc)
  const float* cp;  // c_{t-1}
  int64_t ldc;
  const float* dhr;  // da_{t+1} @ R^T, or null (last step)
  const void* dy;    // dt, leading dim ldy
  int64_t ldy;
  const void* dhl;  // dt: the final carry's dh (last step only), leading dim ldc; or null
  float* dc;        // in: dc_t from the step after, out: dc_{t-1}
  void* da;         // dt, leading dim ldda
  int64_t ldda;
  void* dak;  // the multiply dtype, for the next step's BRGEMM, leading dim lddak
  int64_t lddak;
  float* db;  // this N-block's partial bias gradient at k0 of gate 0
};

template <class Tx, class Tk>
JB_INLINE void cell_bwd_loop(const CellBwd& a) {
  const int64_t rows = a.rows, cols = a.cols, k = a.k;
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = a.g + r * a.ldg;
    const float* c = a.c + r * a.ldc;
    const float* cp = a.cp + r * a.ldc;
    const float* dhr = a.dhr ? a.dhr + r * a.ldc : nullptr;
    const Tx* dy = static_cast<const Tx*>(a.dy) + r * a.ldy;
    const Tx* dhl = a.dhl ? static_cast<const Tx*>(a.dhl) + r * a.ldc : nullptr;
    float* dc = a.dc + r * a.ldc;
    Tx* da = static_cast<Tx*>(a.da) + r * a.ldda;
    Tk* dak = static_cast<Tk*>(a.dak) + r * a.lddak;
    float* db = a.db;
    // Every array is distinct but dc, which is updated element by element in place.
#pragma GCC ivdep
    for (int64_t j = 0; j < cols; ++j) {
      float dh = to_f32(dy[j]);
      if (dhr) dh += dhr[j];
      if (dhl) dh += to_f32(dhl[j]);
      const float i = g[j], f = g[k + j], gg = g[2 * k + j], o = g[3 * k + j];
      const float tc = tanh_f(c[j]);
      const float dcur = dc[j] + dh * o * (1.0f - tc * tc);
      const float da_i = dcur * gg * i * (1.0f - i);
      const float da_f = dcur * cp[j] * f * (1.0f - f);
      const float da_g = dcur * i * (1.0f - gg * gg);
      const float da_o = dh * tc * o * (1.0f - o);
      dc[j] = dcur * f;
      da[j] = from_f32<Tx>(da_i);
      da[k + j] = from_f32<Tx>(da_f);
      da[2 * k + j] = from_f32<Tx>(da_g);
      da[3 * k + j] = from_f32<Tx>(da_o);
      dak[j] = from_f32<Tk>(da_i);
      dak[k + j] = from_f32<Tk>(da_f);
      dak[2 * k + j] = from_f32<Tk>(da_g);
      dak[3 * k + j] = from_f32<Tk>(da_o);
      db[j] += da_i;
      db[k + j] += da_f;
      db[2 * k + j] += da_g;
      db[3 * k + j] += da_o;
    }
  }
}

template <class A, class B>
void cell_fwd_base(const CellFwd& a) { cell_fwd_loop<A, B>(a); }
template <class A, class B>
void cell_bwd_base(const CellBwd& a) { cell_bwd_loop<A, B>(a); }
#if defined(JB_X86)
#define JB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
template <class A, class B>
JB_AVX512 void cell_fwd_avx512(const CellFwd& a) { cell_fwd_loop<A, B>(a); }
template <class A, class B>
JB_AVX512 void cell_bwd_avx512(const CellBwd& a) { cell_bwd_loop<A, B>(a); }
#endif

// The cell functions for (dt, multiply dtype) on an ISA, chosen once by the plan.
template <class A, class B>
void (*fwd_fn(Isa isa))(const CellFwd&) {
#if defined(JB_X86)
  if (isa >= Isa::avx512) return &cell_fwd_avx512<A, B>;
#endif
  (void)isa;
  return &cell_fwd_base<A, B>;
}
template <class A, class B>
void (*bwd_fn(Isa isa))(const CellBwd&) {
#if defined(JB_X86)
  if (isa >= Isa::avx512) return &cell_bwd_avx512<A, B>;
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

// ---------------------------------------------------------------------------------------
// The forward's plan.
//
// fused       A_t = [x_t | 0 | h_{t-1} | 0] in a buffer of T steps (N x lda each, the
//             multiply dtype), the parts padded to whole reduction blocks; the weight
//             panel of (gate, K-block) holds the blocks of [W; 0; R; 0] in the same order.
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
        groups(kblk, nblk, threads),
        cell(pick_fwd(s.dt, kd, dp.isa)) {
    // The per-step batch: the blocks of [x | h] (fused) or of h (precompute).
    red = padded_red(v == Variant::fused ? s.c : 0, s.k, vnni);
    cpad = v == Variant::fused ? round_up(s.c, red) : 0;
    kpad = round_up(s.k, red);
    lda = padded_ld(cpad + kpad, ks);
    rblk = (cpad + kpad) / red;
    blk = reblock::block_elems(red, b.cols, vnni);
    for (int g = 0; g < kGates; ++g)
      step[g].emplace(desc(red, lda, v == Variant::precompute, v == Variant::fused, kGateAct[g]), s.n,
                      s.k, b.rows, b.cols, isa);
    if (v == Variant::precompute) {
      red_x = reduction_block(s.c, vnni);
      xblk = s.c / red_x;
      blk_x = reblock::block_elems(red_x, b.cols, vnni);
      x_copy = s.dt != kd;
      ldx = x_copy ? padded_ld(s.c, ks) : row_step(s) * s.c;
      pre.emplace(desc(red_x, ldx, false, true, Activation::none), s.n, s.k, b.rows, b.cols, isa);
    }
  }

  BrgemmDesc desc(int64_t k, int64_t lda_, bool accumulate, bool bias, Activation act) const {
    BrgemmDesc d;
    d.k = k;
    d.lda = lda_;
    d.ldb = vnni ? 2 * b.cols : b.cols;
    d.ldc = kGates * s.k;
    d.ab = kd;
    d.c = DType::f32;
    d.accumulate = accumulate;
    d.bias = bias;
    d.act = act;
    return d;
  }
  // Element offset of the weight panel block (g, kb, rb) in a panel array of `nb` blocks of
  // `be` elements per panel.
  int64_t panel(int g, int64_t kb, int64_t nb, int64_t be) const { return (g * kblk + kb) * nb * be; }

  const Shape s;
  const Variant v;
  const Blocking b;
  const Isa isa;
  const DType kd;
  const bool vnni;
  const size_t ks;
  const int64_t kblk, nblk;
  const WorkGroups groups;
  void (*const cell)(const CellFwd&);
  int64_t red = 0, cpad = 0, kpad = 0, lda = 0, rblk = 0, blk = 0;
  int64_t red_x = 0, xblk = 0, blk_x = 0, ldx = 0;
  bool x_copy = false;
  std::optional<KernelSet> step[kGates];
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
        blk(reblock::block_elems(red, b.cols, vnni)),
        ldda(padded_ld(kGates * s.k, ks)),
        groups(kblk, nblk, threads),
        kernels(desc(), s.n, s.k, b.rows, b.cols, dp.isa),
        cell(pick_bwd(s.dt, kd, dp.isa)) {}

  BrgemmDesc desc() const {
    BrgemmDesc d;
    d.k = red;
    d.lda = ldda;
    d.ldb = vnni ? 2 * b.cols : b.cols;
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
  const int64_t kblk, nblk, red, rblk, blk, ldda;
  const WorkGroups groups;
  const KernelSet kernels;
  void (*const cell)(const CellBwd&);
};

PlanCache<13, BwdPlan> bwd_plans;

}  // namespace

// ---------------------------------------------------------------------------------------

Blocking step_blocking(const Shape& s, int64_t threads, const Dispatch&) {
  Blocking b;
  b.cols = std::min(s.k, kCols);
  b.rows = split_rows(s.n, ceil_div(s.k, b.cols), threads);
  return b;
}

// Measured (AMD EPYC Zen 4, 2 vCPUs, T = 50, C = K in {256, 512, 1024}, N in {64, 168}, fp32
// and bf16): fused was faster or equal in 16 of 19 samples, by up to 1.9x in bf16 at C = K =
// 256 (the precompute pass writes and re-reads every gate through memory); precompute won
// only scattered samples within the machine's noise. So: fused everywhere. The precompute
// variant stays (tested) for machines where the rule should change.
Variant forward_variant(const Shape&, int64_t, const Dispatch&) { return Variant::fused; }

void forward(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* w,
             const void* r, DType w_dt, const float* bias, const float* c0, const void* h0,
             void* y, float* c_last, void* h_last, float* gates, float* cs, Variant variant,
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
  const int64_t K = s.k, G4 = kGates * s.k, N = s.n, T = s.t;
  const size_t ks = p.ks;

  // Scratch: the weight panels (stacked [W; R] or R), W's panels (precompute), the A
  // buffers, the gates when they are not saved, a widened copy of x (precompute, bf16 x
  // with fp32 multiplies).
  const size_t panels = size_t(kGates * p.kblk * p.rblk * p.blk) * ks;
  const size_t xpanels = fused ? 0 : size_t(kGates * p.kblk * p.xblk * p.blk_x) * ks;
  const size_t abuf = size_t((fused ? T : 2) * N * p.lda) * ks;
  const size_t gbuf = save ? 0 : size_t((fused ? 1 : T) * N * G4) * sizeof(float);
  const size_t xbuf = !fused && p.x_copy ? size_t(T * N * p.ldx) * ks : 0;
  const auto buf = Scratch::get<5>({panels, xpanels, abuf, gbuf, xbuf});
  char* const wp = buf[0];
  char* const xp = buf[1];
  char* const ab = buf[2];
  float* const gs = save ? gates : reinterpret_cast<float*>(buf[3]);
  char* const xc = buf[4];

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
      // Rows [0, cpad) of the panel come from W, [cpad, cpad + kpad) from R (fused);
      // precompute: R's panel here and W's in its own array.
      char* dst = wp + p.panel(g, kb, p.rblk, p.blk) * ks;
      for (int64_t rb = 0; rb < p.rblk; ++rb) {
        const int64_t r0 = rb * p.red;
        const bool from_w = r0 < p.cpad;
        const int64_t src_row = from_w ? r0 : r0 - p.cpad;
        const int64_t rows = std::max<int64_t>(0, std::min(p.red, (from_w ? s.c : K) - src_row));
        const void* src = from_w ? w : r;
        reblock::pack(at(src, w_dt, src_row * G4 + g * K + k0), w_dt, G4, false, rows, cols, p.red,
                      b.cols, p.kd, p.vnni, dst + rb * p.blk * ks, p.isa);
      }
      if (!fused) {
        char* xdst = xp + p.panel(g, kb, p.xblk, p.blk_x) * ks;
        for (int64_t cb = 0; cb < p.xblk; ++cb)
          reblock::pack(at(w, w_dt, cb * p.red_x * G4 + g * K + k0), w_dt, G4, false, p.red_x, cols,
                        p.red_x, b.cols, p.kd, p.vnni, xdst + cb * p.blk_x * ks, p.isa);
      }
      return;
    }
    const int64_t j = i - witems;
    if (fused) {  // step j's A: [x_j | 0 | h0 (j = 0) | 0]
      char* a = ab + j * N * p.lda * ks;
      copy_rows(at(x, s.dt, row_of(s, j, 0) * s.c), s.dt, row_step(s) * s.c, a, p.kd, p.lda, N, s.c,
                p.cpad);
      if (j == 0) {
        copy_rows(h0, s.dt, K, a + p.cpad * ks, p.kd, p.lda, N, K, p.kpad);
      } else if (p.kpad > K) {
        for (int64_t n = 0; n < N; ++n)
          std::memset(a + (n * p.lda + p.cpad + K) * ks, 0, size_t(p.kpad - K) * ks);
      }
    } else if (j == 0) {  // [h0 | 0] into the first h buffer, the pad of the second
      copy_rows(h0, s.dt, K, ab, p.kd, p.lda, N, K, p.kpad);
      if (p.kpad > K)
        for (int64_t n = 0; n < N; ++n)
          std::memset(ab + ((N + n) * p.lda + K) * ks, 0, size_t(p.kpad - K) * ks);
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
          (*p.pre)(rows, cols).strided(a + n0 * p.ldx * ks, p.red_x, xp + p.panel(g, kb, p.xblk, p.blk_x) * ks,
                                       p.blk_x, p.xblk, gs + (t * N + n0) * G4 + g * K + k0,
                                       bias + g * K + k0);
      }
    });
  }

  // The time loop: one parallel_for per step (the step barrier).
  for (int64_t t = 0; t < T; ++t) {
    float* gt = gs + (fused && !save ? 0 : t * N * G4);
    const char* a_t = ab + (fused ? t : t % 2) * N * p.lda * ks;
    char* h_next = t + 1 < T ? ab + (fused ? (t + 1) * N * p.lda + p.cpad : (t + 1) % 2 * N * p.lda) * ks
                             : nullptr;
    const float* c_prev = save ? (t ? cs + (t - 1) * N * K : c0) : c_last;
    float* c_next = save ? cs + t * N * K : c_last;
    parallel_for(ex, p.groups.items(), [&](int64_t i) {
      const int64_t kb = p.groups.panel(i), k0 = kb * b.cols, cols = std::min(b.cols, K - k0);
      for (int64_t nb = p.groups.first(i); nb < p.groups.last(i); ++nb) {
        const int64_t n0 = nb * b.rows, rows = std::min(b.rows, N - n0);
        for (int g = 0; g < kGates; ++g)
          (*p.step[g])(rows, cols).strided(a_t + n0 * p.lda * ks, p.red, wp + p.panel(g, kb, p.rblk, p.blk) * ks,
                                          p.blk, p.rblk, gt + n0 * G4 + g * K + k0,
                                          fused ? bias + g * K + k0 : nullptr);
        CellFwd c{rows, cols, K, gt + n0 * G4 + k0, G4, c_prev + n0 * K + k0, c_next + n0 * K + k0, K,
                  off(y, row_of(s, t, n0) * K + k0, es), row_step(s) * K,
                  h_next ? h_next + (n0 * p.lda + k0) * ks : nullptr, p.lda};
        p.cell(c);
      }
    });
  }

  // The final carry.
  copy_rows(at(y, s.dt, row_of(s, T - 1, 0) * K), s.dt, row_step(s) * K, h_last, s.dt, K, N, K, K);
  if (save) std::memcpy(c_last, cs + (T - 1) * N * K, size_t(N * K) * sizeof(float));
}

// ---------------------------------------------------------------------------------------
// Backward through time. Per step t = T-1 .. 0, item (K-block, group of N-blocks):
//   dh  = dy_t (+ dh_last at T-1) (+ da_{t+1} @ R^T: one BRGEMM over the 4K-blocks)
//   da_t, dc_{t-1} from the saved gates and cell states (fused, the tile hot in L1)
// then dh0 = da_0 @ R^T. dc is kept in dc0 in place (each tile has one owner per step).

void bptt(const Executor& ex, const Dispatch& dp, const Shape& s, const void* r, DType w_dt,
          const float* gates, const float* cs, const float* c0, const void* dy,
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
    return BwdPlan(dp, s, force ? *force : step_blocking(s, ex.num_threads, dp), ex.num_threads);
  });
  const BwdPlan& p = *plan;
  const Blocking& b = p.b;
  const size_t ks = p.ks;

  const auto buf = Scratch::get<4>({size_t(p.kblk * p.rblk * p.blk) * ks, size_t(2 * N * p.ldda) * ks,
                                    size_t(N * K) * sizeof(float), size_t(p.nblk * G4) * sizeof(float)});
  char* const rt = buf[0];   // R^T panels [Kb][4K / red] blocks
  char* const dak = buf[1];  // da_t for the next step's A, alternating
  float* const dhr = reinterpret_cast<float*>(buf[2]);
  float* const dbp = reinterpret_cast<float*>(buf[3]);  // partial db per N-block
  std::memset(dbp, 0, size_t(p.nblk * G4) * sizeof(float));

  // R^T panel kb, block rb: element (q, j) = R[k0 + j, rb * red + q].
  parallel_for(ex, p.kblk, [&](int64_t kb) {
    const int64_t k0 = kb * b.cols, cols = std::min(b.cols, K - k0);
    for (int64_t rb = 0; rb < p.rblk; ++rb)
      reblock::pack(at(r, w_dt, k0 * G4 + rb * p.red), w_dt, G4, true, p.red, cols, p.red, b.cols, p.kd,
                    p.vnni, rt + (kb * p.rblk + rb) * p.blk * ks, p.isa);
  });

  auto recurrent = [&](int64_t kb, int64_t n0, int64_t rows, int64_t cols, const char* a) {
    p.kernels(rows, cols).strided(a + n0 * p.ldda * ks, p.red, rt + kb * p.rblk * p.blk * ks, p.blk, p.rblk,
                                  dhr + n0 * K + kb * b.cols);
  };
  for (int64_t t = T - 1; t >= 0; --t) {
    const char* a_next = dak + (t + 1) % 2 * N * p.ldda * ks;
    char* a_t = dak + t % 2 * N * p.ldda * ks;
    const float* c_prev = t ? cs + (t - 1) * N * K : c0;
    parallel_for(ex, p.groups.items(), [&](int64_t i) {
      const int64_t kb = p.groups.panel(i), k0 = kb * b.cols, cols = std::min(b.cols, K - k0);
      for (int64_t nb = p.groups.first(i); nb < p.groups.last(i); ++nb) {
        const int64_t n0 = nb * b.rows, rows = std::min(b.rows, N - n0);
        if (t + 1 < T) recurrent(kb, n0, rows, cols, a_next);
        CellBwd c{rows, cols, K, gates + (t * N + n0) * G4 + k0, G4, cs + (t * N + n0) * K + k0,
                  c_prev + n0 * K + k0, K, t + 1 < T ? dhr + n0 * K + k0 : nullptr,
                  off(dy, row_of(s, t, n0) * K + k0, es), row_step(s) * K,
                  t + 1 == T && dh_last ? off(dh_last, n0 * K + k0, es) : nullptr, dc0 + n0 * K + k0,
                  off(da, row_of(s, t, n0) * G4 + k0, es), row_step(s) * G4, a_t + (n0 * p.ldda + k0) * ks,
                  p.ldda, dbp + nb * G4 + k0};
        p.cell(c);
      }
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
