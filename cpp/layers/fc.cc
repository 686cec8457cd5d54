// The fully-connected layer's three passes: loops around the BRGEMM kernel, nothing else.
//
//   forward, backward  a work item re-blocks one weight panel (a K-block of w, or a C-block
//                      of w^T) into L2 and computes the output blocks of its group of
//                      N-blocks with it: one BRGEMM call each, batch-reducing over the
//                      blocks of the reduced dimension, epilogue (bias, activation) fused.
//   update             the transposed input and the blocked gradient are shared by all
//                      items, so a first parallel loop re-blocks them; then every
//                      (C-block, K-block) item owns its block of dw and reduces over the
//                      whole batch in one BRGEMM call.
//
// Each pass is a plan and its execution. The plan (blocking, the full and edge kernels, the
// work split, scratch sizes) depends only on the shape, dtypes, thread count and dispatch:
// it is built on a call site's first call and taken from a cache after that. Execution
// takes its scratch on the calling thread, then only loops and calls kernels.
#include "layers/fc.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <vector>

#include "layers/common/eltwise.h"
#include "layers/common/kernels.h"
#include "layers/common/operand.h"
#include "layers/common/plan_cache.h"
#include "layers/common/reblock.h"
#include "layers/common/scratch.h"
#include "layers/common/view.h"
#include "layers/common/work.h"

namespace jb::fc {

namespace {

// Output block width. Weight panels are this wide: 512 contiguous bytes per fp32 row pack
// about 1.5x faster than 256 (measured); the update writes its dw in longer row pieces.
constexpr int64_t kCols = 128;

// Activations this large stream from memory: the forward and backward then take turns of
// N-blocks over re-blocked panels (weights_first), and an update whose re-blocked operands
// are larger (and larger than dw) runs as the forward's pass over x^T (long_update).
constexpr int64_t kLargeBytes = int64_t(8) << 20;

// Forward (N x K output, reducing C) and backward (N x C output, reducing K) block alike.
Blocking activation_blocking(const Shape& s, int64_t out_cols, int64_t reduced, int64_t threads,
                             const Dispatch& dp) {
  const DType kd = multiply_dtype(s.dt, dp);
  Blocking b;
  b.cols = std::min(out_cols, kCols);
  // Too few rows to split: narrower panels, so that every thread still gets several items.
  if (s.n <= kRowQuantum && ceil_div(out_cols, b.cols) < kItemsPerThread * threads)
    b.cols = std::min(out_cols, kCols / 2);
  // Every N-block of an item streams the item's whole panel (reduced x cols), so a long
  // reduction takes narrower panels, at most kPanelBytes. Measured (Intel Xeon, 2 MiB L2,
  // fp32, dx of 8400 x 4096 -> 1024, the LSTM's at C = K = 1024): a 2 MiB panel 194-195
  // GFLOP/s, 1 MiB 246-255.
  while (b.cols > 32 && reduced * b.cols * int64_t(dtype_size(kd)) > kPanelBytes) b.cols /= 2;
  b.rows = split_rows(s.n, ceil_div(out_cols, b.cols), threads);
  b.red = reduction_block(reduced, kd == DType::bf16);
  // An item per panel streams all of the activations from memory, once per panel. When they
  // are large and there are many panels, the N-blocks take turns instead (see
  // Blocking::weights_first), against panels of at most kPanelBytes / 4, so that a panel
  // and an N-block's rows of x share L2. Measured (Intel Xeon, fp32, 2 threads, batch 8400,
  // medians of 7, interleaved):
  //   y = x @ w, 1024 -> 4096 (32 panels) 237-252 -> 258-264 GFLOP/s; 512 -> 2048 (16
  //   panels) 228-240 -> 249-250;
  //   dx 4096 -> 1024 (the LSTM's at C = K = 1024): 64-column panels 1.06x faster than
  //   without, 32-column ones 1.06x faster again; dx 2048 -> 512: 128-column panels without
  //   it 255, 32-column ones with it 1.11x faster (128-column ones with it 1.02x).
  // Where it did not pay: 8 panels (10000 rows 1024 -> 1024 equal), fewer N-blocks than 32
  // per two threads (2200 rows: 1024 -> 1024 and dx 2048 -> 512, 2-5 % slower: the last
  // round of N-blocks leaves a thread idle), AMX bf16 multiplies (1024 -> 4096 9 % slower).
  int64_t wf_cols = b.cols;
  while (wf_cols > 32 && reduced * wf_cols * int64_t(dtype_size(kd)) > kPanelBytes / 4) wf_cols /= 2;
  b.weights_first = kd == DType::f32 && ceil_div(out_cols, wf_cols) >= 16 &&
                    ceil_div(s.n, b.rows) >= 2 * kItemsPerThread * threads &&
                    s.n * reduced * int64_t(dtype_size(kd)) > kLargeBytes;
  if (b.weights_first) b.cols = wf_cols;
  return b;
}

// The cache key of a pass: everything its plan depends on.
using Key = std::array<int64_t, 14>;
Key key_of(const Shape& s, bool bias, int64_t threads, const Dispatch& dp, const Blocking* force) {
  return {s.n, s.c, s.k, s.ldz, int64_t(s.dt), int64_t(s.act), bias, threads, int64_t(dp.isa),
          int64_t(dp.bf16_multiply), force ? force->rows : -1, force ? force->cols : -1,
          force ? force->red : -1, force ? force->weights_first : -1};
}

// ---------------------------------------------------------------------------------------
// The plan the forward and the backward share: an N x `out_cols` output reducing over
// `reduced`. The A operand is an activation matrix (N x reduced, rows `lda` apart), read in
// place or copied once. Work items are a weight panel of `cols` output columns, re-blocked by the item
// into a leased buffer (reduced / red blocks of red x cols), and the group of N-blocks
// computed with it; or, with weights_first, every panel is re-blocked by a first parallel
// loop and an item is one N-block computed against all of them.

struct PanelPlan {
  // `act` is fused into the output (forward only).
  PanelPlan(const Dispatch& dp, const Shape& s, Blocking chosen, int64_t out_cols, int64_t reduced,
            int64_t lda, bool bias, Activation act, int64_t threads, DType out_dt)
      : b(fixed(chosen, s.n, out_cols, reduced)),
        isa(dp.isa),
        kd(multiply_dtype(s.dt, dp)),
        vnni(kd == DType::bf16),
        ks(dtype_size(kd)),
        blk(reblock::block_elems(b.red, b.cols, vnni)),
        n(s.n),
        out_cols(out_cols),
        rblk(reduced / b.red),
        aop(s.dt, kd, s.n, reduced, lda),
        kernels(desc(out_dt, out_cols, bias, act), s.n, out_cols, b.rows, b.cols, dp.isa),
        groups(ceil_div(out_cols, b.cols), ceil_div(s.n, b.rows), threads),
        panel_bytes(Scratch::aligned(size_t(rblk * blk) * ks)) {}

  // Runs the pass on the A operand a_src: pack(c0, cols, r, dst) re-blocks reduction block
  // r of the panel of output columns [c0, c0 + cols) into dst; tile(n0, rows, c0, cols,
  // multiply) computes one output block, where multiply(out, bias) is the block's BRGEMM
  // call.
  template <class Pack, class Tile>
  void run(const Executor& ex, const void* a_src, Pack&& pack, Tile&& tile) const {
    run_with(
        ex, aop.bytes(),
        [&](char* dst) {
          if (!aop.copied()) return static_cast<const char*>(a_src);
          parallel_for(ex, aop.items(), [&](int64_t i) { aop.copy(i, a_src, dst); });
          return const_cast<const char*>(dst);
        },
        pack, tile);
  }

  // run's body, with A laid out by the caller: prepare(dst) returns the A operand (rows
  // aop.ld() apart, the multiply dtype), written to dst (a_bytes of scratch) if need be.
  template <class Prepare, class Pack, class Tile>
  void run_with(const Executor& ex, size_t a_bytes, Prepare&& prepare, Pack&& pack, Tile&& tile) const {
    const int64_t npanels = ceil_div(out_cols, b.cols);
    const auto buf = Scratch::get<2>({a_bytes, panel_bytes * size_t(b.weights_first ? npanels : groups.concurrency())});
    const char* a = prepare(buf[0]);
    auto block = [&](int64_t n0, int64_t c0, const char* panel) {
      const int64_t rows = std::min(b.rows, n - n0), cols = std::min(b.cols, out_cols - c0);
      tile(n0, rows, c0, cols, [&](void* out, const float* bias) {
        kernels(rows, cols).strided(a + n0 * aop.ld() * ks, b.red, panel, blk, rblk, out, bias);
      });
    };
    if (b.weights_first) {
      parallel_for(ex, npanels, [&](int64_t i) {
        const int64_t c0 = i * b.cols, cols = std::min(b.cols, out_cols - c0);
        for (int64_t r = 0; r < rblk; ++r) pack(c0, cols, r, buf[1] + i * panel_bytes + r * blk * ks);
      });
      parallel_for(ex, ceil_div(n, b.rows), [&](int64_t nb) {
        for (int64_t i = 0; i < npanels; ++i) block(nb * b.rows, i * b.cols, buf[1] + i * panel_bytes);
      });
      return;
    }
    PanelPool panels(buf[1], panel_bytes, groups.concurrency());
    parallel_for(ex, groups.items(), [&](int64_t i) {
      const int64_t c0 = groups.panel(i) * b.cols, cols = std::min(b.cols, out_cols - c0);
      const PanelPool::Lease panel(panels);
      for (int64_t r = 0; r < rblk; ++r) pack(c0, cols, r, panel.data + r * blk * ks);
      for (int64_t nb = groups.first(i); nb < groups.last(i); ++nb) block(nb * b.rows, c0, panel.data);
    });
  }

  const Blocking b;  // the block of the reduced dimension divides it
  const Isa isa;
  const DType kd;  // the multiply dtype
  const bool vnni;
  const size_t ks;    // bytes of a kd element
  const int64_t blk;  // elements of one re-blocked reduction block
  const int64_t n, out_cols, rblk;
  const ActivationOperand aop;
  const KernelSet kernels;
  const WorkGroups groups;
  const size_t panel_bytes;

 private:
  static Blocking fixed(Blocking b, int64_t n, int64_t out_cols, int64_t reduced) {
    b = clamped(b, n, out_cols);
    if (b.red <= 0 || reduced % b.red) b.red = reduced;
    return b;
  }
  BrgemmDesc desc(DType out_dt, int64_t out_cols, bool bias, Activation act) const {
    BrgemmDesc d;
    d.k = b.red;
    d.lda = aop.ld();
    d.ldb = vnni ? 2 * b.cols : b.cols;
    d.ldc = out_cols;
    d.ab = kd;
    d.c = out_dt;
    d.bias = bias;
    d.act = act;
    return d;
  }
};

PlanCache<14, PanelPlan> forward_plans, backward_plans;

// ---------------------------------------------------------------------------------------
// The update's plan: x^T blocked [Cb][Nb][bc][bn], dz blocked [Kb][bk / sub][Nb][bn][sub]
// (VNNI pairs of n for bf16), both zero-padded to whole N-blocks; (C-block, K-block) items
// of dw, each computed as one BRGEMM per sub-panel (sub_cols). A register tile streams its B
// contiguously across the whole batch. Measured (Intel Xeon, two threads, C++ loops over
// fc::update, the LSTM's weight update at batch 8400): fp32 C = K = 1024 387-393 ms against
// 409-418 with [bn][bk] blocks (1.05x), C = K = 256 1.04x, 512 equal. For a batch whose
// re-blocked operands outgrow kLargeBytes and dw, see long_update.

struct UpdatePlan {
  UpdatePlan(const Dispatch& dp, const Shape& s, Blocking chosen, DType dw_dt)
      : b(fixed(chosen, s, multiply_dtype(s.dt, dp) == DType::bf16)),
        isa(dp.isa),
        kd(multiply_dtype(s.dt, dp)),
        vnni(kd == DType::bf16),
        ks(dtype_size(kd)),
        cblk(ceil_div(s.c, b.rows)),
        kblk(ceil_div(s.k, b.cols)),
        nblk(ceil_div(s.n, b.red)),
        blk_a(b.rows * b.red),
        sub(sub_cols(b.cols, isa, kd)),
        nsub(ceil_div(b.cols, sub)),
        blk_sub(reblock::block_elems(b.red, sub, vnni)),
        long_batch(nblk * b.red * (s.c + s.k) * int64_t(ks) >
                   std::max(kLargeBytes, s.c * s.k * int64_t(sizeof(float)))),
        kernels(desc(s, dw_dt, s.k), s.c, s.k, b.rows, sub, dp.isa),
        tile(desc(s, DType::f32, b.cols), s.c, s.k, b.rows, sub, dp.isa) {}

  // The item's block of dw (rows x cols at c), reduced over every N-block: one BRGEMM per
  // sub-panel, into c's columns (ldc and dtype as `kernels` were built).
  void run(const KernelSet& kernels, int64_t rows, int64_t cols, const char* a, const char* bb, char* c,
           size_t cs) const {
    for (int64_t j = 0; j < cols; j += sub)
      kernels(rows, std::min(sub, cols - j)).strided(a, blk_a, bb + j / sub * nblk * blk_sub * int64_t(ks), blk_sub,
                                                     nblk, c + j * int64_t(cs));
  }

  const Blocking b;
  const Isa isa;
  const DType kd;
  const bool vnni;
  const size_t ks;
  const int64_t cblk, kblk, nblk, blk_a;
  const int64_t sub, nsub, blk_sub;  // sub-panel width, sub-panels per K-block, one's block
  const bool long_batch;  // re-blocked operands above kLargeBytes and dw: long_update's
  const KernelSet kernels;  // one block of dw, stored in dw's dtype
  const KernelSet tile;     // update_sgd's: one block of dw into a b.cols-wide tile

 private:
  static Blocking fixed(Blocking b, const Shape& s, bool vnni) {
    b = clamped(b, s.c, s.k);
    if (b.red <= 0) b.red = s.n;
    if (vnni) b.red = round_up(b.red, 2);
    return b;
  }
  BrgemmDesc desc(const Shape& s, DType out, int64_t ldc) const {
    // dw is stored straight from the register tiles, with plain stores: inside a training
    // step the optimizer reads it next, from cache. (Non-temporal stores measured 1.4-2.5x
    // slower there: the optimizer then reads dw back from memory.)
    BrgemmDesc d;
    d.k = b.red;
    d.lda = b.red;
    d.ldb = vnni ? 2 * sub : sub;
    d.ldc = ldc;
    d.ab = kd;
    d.c = out;
    return d;
  }
};

PlanCache<15, UpdatePlan> update_plans;

// ---------------------------------------------------------------------------------------
// The update of a long batch (the LSTM's reduces over every step and row): dw = x^T dz as
// the forward's panel pass, x^T (transposed once into scratch, zero-padded to whole
// reduction blocks) the activations and dz the weights. Every block of dw is reduced over
// the whole batch in one BRGEMM call and written once. It replaced chunks of N-blocks
// re-blocked as UpdatePlan's while in L3, whose items stored and reloaded dw once per chunk
// and read their dz panel from L3 for only 96 rows of dw (the item's calls alone on one core:
// 111 GFLOP/s with all in L2, 98 with that panel from L3). Measured (AMD Zen 4, two threads,
// C++ loops over fc::update, batch 8400, C x K = the LSTM's (C + K) x 4K, ms chunks / this):
// fp32 C = K = 256 62-66 / 53-55, 512 229-234 / 197-203, 1024 773-804 / 732-763; bf16
// 1.03-1.20x.

struct LongUpdatePlan {
  LongUpdatePlan(const Dispatch& dp, const Shape& s, DType dw_dt, int64_t threads)
      : red(padded_block(s.n, multiply_dtype(s.dt, dp) == DType::f32 ? 1 : dp.isa == Isa::amx ? 32 : 2, 256)),
        xt{s.c, round_up(s.n, red), s.k, multiply_dtype(s.dt, dp)},
        ld(padded_ld(xt.c, dtype_size(xt.dt))),
        plan(dp, xt, blocking(dp, xt, red, threads), s.k, xt.c, ld, false, Activation::none, threads, dw_dt) {}

  const int64_t red;
  const Shape xt;    // the forward's shape: x^T (C x padded N, the multiply dtype) times dz
  const int64_t ld;  // of x^T, whose rows are never a multiple of 4 KiB apart
  const PanelPlan plan;

 private:
  static Blocking blocking(const Dispatch& dp, const Shape& xt, int64_t red, int64_t threads) {
    Blocking b = forward_blocking(xt, threads, dp);
    b.red = red;
    return b;
  }
};

PlanCache<15, LongUpdatePlan> long_update_plans;

// acc[j] += the sum over rows of src[r * ld + j] (db from a piece of dz).
void add_column_sums(const void* src, DType dt, int64_t ld, int64_t rows, int64_t cols, float* acc) {
  with_type(dt, [&](auto ts) {
    using T = decltype(ts);
    const T* t = static_cast<const T*>(src);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < cols; ++j) acc[j] += to_f32(t[r * ld + j]);
  });
}

// Rows of x^T a transposing item writes.
constexpr int64_t kTransposeRows = 16;

void long_update(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
                 void* dw, DType dw_dt, float* db, const std::array<int64_t, 15>& key) {
  const LongUpdatePlan& lp = *long_update_plans.get(key, [&] { return LongUpdatePlan(dp, s, dw_dt, ex.num_threads); });
  const PanelPlan& p = lp.plan;
  const int64_t ldx = s.ldx ? s.ldx : s.c, ldz = s.ldz ? s.ldz : s.k;
  const size_t os = dtype_size(dw_dt);
  const int64_t ks = int64_t(p.ks);
  p.run_with(
      ex, size_t(s.c * lp.ld * ks),
      [&](char* xt) {
        parallel_for(ex, ceil_div(s.c, kTransposeRows), [&](int64_t i) {
          const int64_t c0 = i * kTransposeRows, rows = std::min(kTransposeRows, s.c - c0);
          reblock::pack(at(x, s.dt, c0), s.dt, ldx, true, rows, s.n, rows, lp.ld, p.kd, false, xt + c0 * lp.ld * ks,
                        dp.isa);
        });
        return const_cast<const char*>(xt);
      },
      [&](int64_t k0, int64_t cols, int64_t r, char* dst) {
        const int64_t n0 = r * lp.red;
        reblock::pack(at(dz, s.dt, n0 * ldz + k0), s.dt, ldz, false, std::min(lp.red, s.n - n0), cols, lp.red,
                      p.b.cols, p.kd, p.vnni, dst, dp.isa);
      },
      [&](int64_t c0, int64_t, int64_t k0, int64_t, auto&& multiply) {
        multiply(static_cast<char*>(dw) + (c0 * s.k + k0) * int64_t(os), nullptr);
      });
  if (db)  // a column block of dz per item
    parallel_for(ex, ceil_div(s.k, kCols), [&](int64_t i) {
      const int64_t k0 = i * kCols, cols = std::min(kCols, s.k - k0);
      float sum[kCols] = {};
      add_column_sums(at(dz, s.dt, k0), s.dt, ldz, s.n, cols, sum);
      std::copy(sum, sum + cols, db + k0);
    });
}

}  // namespace

Saved saved_for(Activation act) {
  switch (act) {
    case Activation::none: return Saved::none;
    case Activation::gelu: return Saved::preactivation;
    default: return Saved::output;
  }
}

Blocking forward_blocking(const Shape& s, int64_t threads, const Dispatch& dp) {
  return activation_blocking(s, s.k, s.c, threads, dp);
}

Blocking backward_blocking(const Shape& s, int64_t threads, const Dispatch& dp) {
  return activation_blocking(s, s.c, s.k, threads, dp);
}

Blocking update_blocking(const Shape& s, int64_t threads, const Dispatch& dp) {
  Blocking b;
  b.cols = std::min(s.k, kCols);
  b.rows = split_rows(s.c, ceil_div(s.k, b.cols), threads);
  // The batch is padded with zeros to whole blocks (both operands are re-blocked), so the
  // block only needs to be even for bf16 VNNI pairs, and a multiple of 32 on AMX tiles (they
  // reduce 32 deep; a remainder goes through the AVX-512 path, which halved the speed of
  // blocks of 248); up to 256 long: fewer, longer batch elements per register tile.
  // Measured against blocks of up to 64 (Intel Xeon, two threads, C++ loops over
  // fc::update): fp32 batch 8400, 512 -> 2048 1.04x, 1024 -> 4096 1.02x, 2048 -> 4096 1.02x;
  // batch 250 and 1000, 1024 -> 2048 1.06x and 1.02x.
  const DType kd = multiply_dtype(s.dt, dp);
  b.red = padded_block(s.n, kd == DType::f32 ? 1 : dp.isa == Isa::amx ? 32 : 2, 256);
  return b;
}

// ---------------------------------------------------------------------------------------
// Forward: y[n, k] = act(sum_c x[n, c] w[c, k] + b[k]).
// Work items: a K-block of the weights (the paper's [Kb][Cb][bc][bk] panel, VNNI pairs for
// bf16, cast on the way) re-blocked into L2 by the item itself, then every (N-block,
// K-block) output tile of its group of N-blocks: one BRGEMM over the C-blocks each, bias and
// activation in the epilogue. x is the A operand. Re-blocking inside the item keeps the
// panel in cache for its reuse across the N-blocks instead of a separate pass through
// memory.

void forward(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* w,
             DType w_dt, const float* bias, void* y, void* z, const Blocking* force) {
  if (s.n <= 0 || s.k <= 0) return;
  const bool gelu = s.act == Activation::gelu;
  const auto plan = forward_plans.get(key_of(s, bias != nullptr, ex.num_threads, dp, force), [&] {
    return PanelPlan(dp, s, force ? *force : forward_blocking(s, ex.num_threads, dp), s.k, s.c, s.c,
                     bias != nullptr, gelu ? Activation::none : s.act, ex.num_threads, s.dt);
  });
  const PanelPlan& p = *plan;
  const size_t es = dtype_size(s.dt);
  char* out = static_cast<char*>(gelu ? z : y);
  p.run(
      ex, x,
      [&](int64_t k0, int64_t cols, int64_t cb, char* dst) {
        reblock::pack(at(w, w_dt, cb * p.b.red * s.k + k0), w_dt, s.k, false, p.b.red, cols, p.b.red,
                      p.b.cols, p.kd, p.vnni, dst, p.isa);
      },
      [&](int64_t n0, int64_t rows, int64_t k0, int64_t cols, auto&& multiply) {
        multiply(out + (n0 * s.k + k0) * es, bias ? bias + k0 : nullptr);
        if (gelu)  // the tile is still in L1: y = gelu(z) costs no memory traffic
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t off = (n0 + r) * s.k + k0;
            eltwise::activate(Activation::gelu, s.dt, at(z, s.dt, off),
                              static_cast<char*>(y) + off * es, cols, p.isa);
          }
      });
}

// ---------------------------------------------------------------------------------------
// dz = dy * act'(saved): element-wise, in chunks.

void act_grad(const Executor& ex, const Dispatch& dp, const Shape& s, const void* dy,
              const void* saved, void* dz) {
  const int64_t total = s.n * s.k;
  if (total <= 0) return;
  const int64_t chunk = std::max<int64_t>(4096, ceil_div(total, 8 * ex.num_threads));
  const int64_t es = int64_t(dtype_size(s.dt));
  parallel_for(ex, ceil_div(total, chunk), [&](int64_t i) {
    const int64_t a = i * chunk, count = std::min(chunk, total - a);
    eltwise::act_grad(s.act, s.dt, at(dy, s.dt, a), saved ? at(saved, s.dt, a) : nullptr,
                      static_cast<char*>(dz) + a * es, count, dp.isa);
  });
}

// ---------------------------------------------------------------------------------------
// Backward by data: dx[n, c] = sum_k dz[n, k] w[c, k].
// The forward's skeleton with the roles of C and K swapped: an item re-blocks a C-block of
// w transposed ([Cb][Kb][bk][bc], VNNI pairs of k) and computes the (N-block, C-block) tiles
// of dx of its group, batch-reducing over the K-blocks. dz is the A operand.

void backward(const Executor& ex, const Dispatch& dp, const Shape& s, const void* dz, const void* w,
              DType w_dt, void* dx, const Blocking* force) {
  if (s.n <= 0 || s.c <= 0) return;
  const auto plan = backward_plans.get(key_of(s, false, ex.num_threads, dp, force), [&] {
    return PanelPlan(dp, s, force ? *force : backward_blocking(s, ex.num_threads, dp), s.c, s.k,
                     s.ldz ? s.ldz : s.k, false, Activation::none, ex.num_threads, s.dt);
  });
  const PanelPlan& p = *plan;
  const size_t es = dtype_size(s.dt);
  p.run(
      ex, dz,
      [&](int64_t c0, int64_t cols, int64_t kb, char* dst) {
        reblock::pack(at(w, w_dt, c0 * s.k + kb * p.b.red), w_dt, s.k, true, p.b.red, cols, p.b.red,
                      p.b.cols, p.kd, p.vnni, dst, p.isa);
      },
      [&](int64_t n0, int64_t, int64_t c0, int64_t, auto&& multiply) {
        multiply(static_cast<char*>(dx) + (n0 * s.c + c0) * es, nullptr);
      });
}

// ---------------------------------------------------------------------------------------
// Weight update: dw[c, k] = sum_n x[n, c] dz[n, k], db[k] = sum_n dz[n, k].
// Items: (C-block, K-block) tiles of dw, each owned by one item, so the reduction over the
// batch happens inside one BRGEMM call (batch: the N-blocks) and needs no synchronization.
// A first parallel loop re-blocks the shared operands (x^T and dz, see UpdatePlan); db is
// summed from dz by the item that owns the K-block while it re-blocks that panel.

namespace {

std::array<int64_t, 15> update_key(int64_t threads, const Dispatch& dp, const Shape& s, DType dw_dt,
                                   const Blocking* force) {
  const Key k14 = key_of(s, false, threads, dp, force);
  std::array<int64_t, 15> key;
  std::copy(k14.begin(), k14.end(), key.begin());
  key[14] = int64_t(dw_dt);
  return key;
}

const UpdatePlan& update_plan(int64_t threads, const Dispatch& dp, const Shape& s, DType dw_dt,
                              const Blocking* force) {
  return *update_plans.get(update_key(threads, dp, s, dw_dt, force), [&] {
    return UpdatePlan(dp, s, force ? *force : update_blocking(s, threads, dp), dw_dt);
  });
}

// Both passes: re-block the operands (and sum db), then call item(i, xt, dzb) for each
// (C-block, K-block) item of dw, whose BRGEMM reduces over every N-block.
template <class Item>
void update_blocks(const Executor& ex, const Shape& s, const UpdatePlan& p, const void* x,
                   const void* dz, float* db, char* xt_buf, char* dz_buf, Item&& item) {
  const Blocking& b = p.b;
  const int64_t ldx = s.ldx ? s.ldx : s.c, ldz = s.ldz ? s.ldz : s.k;
  const View<char, 2> xt(xt_buf, {p.cblk * p.nblk, int64_t(p.blk_a * p.ks)});   // [Cb][Nb] blocks
  const View<char, 3> dzb(dz_buf, {p.kblk, p.nsub * p.nblk, int64_t(p.blk_sub * p.ks)});  // [Kb][sub][Nb] blocks
  parallel_for(ex, p.cblk * p.nblk + p.kblk, [&](int64_t i) {
    if (i < p.cblk * p.nblk) {  // x^T block (cb, nb)
      const int64_t cb = i / p.nblk, c0 = cb * b.rows, n0 = i % p.nblk * b.red;
      reblock::pack(at(x, s.dt, n0 * ldx + c0), s.dt, ldx, true, std::min(b.rows, s.c - c0),
                    std::min(b.red, s.n - n0), b.rows, b.red, p.kd, false, xt.at(i), p.isa);
      return;
    }
    const int64_t kb = i - p.cblk * p.nblk, k0 = kb * b.cols;  // dz column panel kb
    const int64_t cols = std::min(b.cols, s.k - k0);
    if (db) std::fill(db + k0, db + k0 + cols, 0.0f);
    for (int64_t nb = 0; nb < p.nblk; ++nb) {
      const int64_t n0 = nb * b.red, rows = std::min(b.red, s.n - n0);
      const void* src = at(dz, s.dt, n0 * ldz + k0);
      for (int64_t j = 0; j < cols; j += p.sub)
        reblock::pack(at(src, s.dt, j), s.dt, ldz, false, rows, std::min(p.sub, cols - j), b.red, p.sub, p.kd,
                      p.vnni, dzb.at(kb, j / p.sub * p.nblk + nb), p.isa);
      if (db) add_column_sums(src, s.dt, ldz, rows, cols, db + k0);
    }
  });
  // C-block major: an x^T panel is reused
  parallel_for(ex, p.cblk * p.kblk, [&](int64_t i) { item(i, xt.at(i / p.kblk * p.nblk), dzb.at(i % p.kblk)); });
}

// One row piece of the SGD step (see fc.h), g the gradient of w.
void sgd_row(const Sgd& o, const float* g, float* w, float* m, int64_t cols, Isa isa) {
  eltwise::sgd(g, w, m, cols, o.lr, o.momentum, o.weight_decay, o.nesterov, isa);
}

}  // namespace

bool update_transposes(const Shape& s, int64_t threads, const Dispatch& dp) {
  return s.n > 0 && s.c > 0 && s.k > 0 && update_plan(threads, dp, s, DType::f32, nullptr).long_batch;
}

void update(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
            void* dw, DType dw_dt, float* db, const Blocking* force) {
  if (s.c <= 0 || s.k <= 0) return;
  if (s.n <= 0) {  // an empty batch: zero gradients
    std::memset(dw, 0, size_t(s.c * s.k) * dtype_size(dw_dt));
    if (db) std::memset(db, 0, size_t(s.k) * sizeof(float));
    return;
  }
  const UpdatePlan& p = update_plan(ex.num_threads, dp, s, dw_dt, force);
  if (p.long_batch && !force)
    return long_update(ex, dp, s, x, dz, dw, dw_dt, db, update_key(ex.num_threads, dp, s, dw_dt, force));
  const Blocking& b = p.b;
  const auto buf = Scratch::get<2>(
      {size_t(p.cblk * p.nblk * p.blk_a) * p.ks, size_t(p.kblk * p.nblk * p.nsub * p.blk_sub) * p.ks});
  const size_t os = dtype_size(dw_dt);
  update_blocks(ex, s, p, x, dz, db, buf[0], buf[1], [&](int64_t i, char* a, char* bb) {
    const int64_t c0 = i / p.kblk * b.rows, k0 = i % p.kblk * b.cols;
    const int64_t rows = std::min(b.rows, s.c - c0), cols = std::min(b.cols, s.k - k0);
    p.run(p.kernels, rows, cols, a, bb, static_cast<char*>(dw) + (c0 * s.k + k0) * int64_t(os), os);
  });
}

// The fused step: an item's block of dw goes to a leased tile (L1/L2) and is applied from
// there, so dw never reaches memory; a long batch computes the whole dw first (long_update).
void update_sgd(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
                const Sgd& o, float* w, float* mw, float* b, float* mb) {
  if (s.c <= 0 || s.k <= 0) return;
  const Sgd ob{o.lr, o.momentum, 0.0f, o.nesterov};  // the bias takes no weight decay
  const Isa isa = dp.isa;
  if (s.n <= 0) {  // an empty batch: zero gradients (never in a training step)
    const std::vector<float> none(size_t(s.k), 0.0f);  // one row of them
    for (int64_t c = 0; c < s.c; ++c) sgd_row(o, none.data(), w + c * s.k, mw + c * s.k, s.k, isa);
    if (b) sgd_row(ob, none.data(), b, mb, s.k, isa);
    return;
  }
  const UpdatePlan& p = update_plan(ex.num_threads, dp, s, DType::f32, nullptr);
  if (p.long_batch) {  // the whole gradient first, in buffers of its own (update takes this
                       // thread's scratch)
    const std::unique_ptr<float[]> g(new float[size_t(s.c * s.k)]), gb(b ? new float[size_t(s.k)] : nullptr);
    update(ex, dp, s, x, dz, g.get(), DType::f32, gb.get());
    parallel_for(ex, s.c, [&](int64_t c) { sgd_row(o, g.get() + c * s.k, w + c * s.k, mw + c * s.k, s.k, isa); });
    if (b) sgd_row(ob, gb.get(), b, mb, s.k, isa);
    return;
  }
  const Blocking& bl = p.b;
  const size_t tile_bytes = size_t(bl.rows * bl.cols) * sizeof(float);
  const auto buf = Scratch::get<4>({size_t(p.cblk * p.nblk * p.blk_a) * p.ks,
                                    size_t(p.kblk * p.nblk * p.nsub * p.blk_sub) * p.ks,
                                    Scratch::aligned(tile_bytes) * size_t(ex.num_threads),
                                    b ? size_t(s.k) * sizeof(float) : 0});
  float* const db = b ? reinterpret_cast<float*>(buf[3]) : nullptr;
  PanelPool tiles(buf[2], Scratch::aligned(tile_bytes), ex.num_threads);
  update_blocks(ex, s, p, x, dz, db, buf[0], buf[1], [&](int64_t i, char* a, char* bb) {
    const int64_t c0 = i / p.kblk * bl.rows, k0 = i % p.kblk * bl.cols;
    const int64_t rows = std::min(bl.rows, s.c - c0), cols = std::min(bl.cols, s.k - k0);
    // The block's parameters and momenta start on their way from memory now and are in
    // cache when the BRGEMM is done (the MLP's fused step went from 1.01x to 1.04x stock
    // XLA with it, one interleaved run each, noisy).
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < cols; j += 16) {
        __builtin_prefetch(w + (c0 + r) * s.k + k0 + j, 1, 2);
        __builtin_prefetch(mw + (c0 + r) * s.k + k0 + j, 1, 2);
      }
    const PanelPool::Lease tile(tiles);
    float* t = reinterpret_cast<float*>(tile.data);
    p.run(p.tile, rows, cols, a, bb, reinterpret_cast<char*>(t), sizeof(float));
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t off = (c0 + r) * s.k + k0;
      sgd_row(o, t + r * bl.cols, w + off, mw + off, cols, isa);
    }
  });
  if (b) sgd_row(ob, db, b, mb, s.k, isa);
}

}  // namespace jb::fc
