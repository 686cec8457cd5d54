// The fully-connected layer's weight update: the transposed input and the blocked gradient
// are shared by all items, so a first parallel loop re-blocks them; then every (C-block,
// K-block) item owns its block of dw and reduces over the whole batch in one BRGEMM call. A
// batch too long for that runs as the forward's panel pass over x^T (long_update). The
// update with SGD's step fused applies each block of dw while it is in cache.
#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "layers/common/plan_cache.h"
#include "layers/common/view.h"
#include "layers/fc/panel.h"
#include "parallel/job.h"

namespace jb::fc {

namespace {

// The block of the batch the update reduces over per BRGEMM batch element. The batch is
// padded with zeros to whole blocks (both operands are re-blocked), so the block only needs
// to be even for bf16 VNNI pairs, and a multiple of 32 on AMX tiles (they reduce 32 deep; a
// remainder goes through the AVX-512 path); up to 256 long: fewer, longer batch elements per
// register tile (experimentally selected on an Intel Xeon; docs/fc.md).
int64_t batch_block(const Shape& s, const Dispatch& dp) {
  return padded_block(s.n, multiply_dtype(operand_dtype(s), dp) == DType::f32 ? 1 : dp.isa == Isa::amx ? 32 : 2, 256);
}

// ---------------------------------------------------------------------------------------
// The update's plan: x^T blocked [Cb][Nb][bc][bn], dz blocked [Kb][bk / sub][Nb][bn][sub]
// (VNNI pairs of n for bf16), both zero-padded to whole N-blocks; (C-block, K-block) items
// of dw, each computed as one BRGEMM per sub-panel (sub_cols). A register tile streams its B
// contiguously across the whole batch. For a batch whose re-blocked operands outgrow
// kLargeBytes and dw, see long_update. Emulated products: each operand's parts follow each
// other (a_step, b_step elements apart) and the batch walks every (term, N-block) pair.

struct UpdatePlan : MultiplyPath {
  UpdatePlan(const Dispatch& dp, const Shape& s, Blocking chosen, DType dw_dt)
      : MultiplyPath(operand_dtype(s), dp),
        terms(emulation::terms(s.products)),
        b(fixed(chosen, s, vnni)),
        cblk(ceil_div(s.c, b.rows)),
        kblk(ceil_div(s.k, b.cols)),
        nblk(ceil_div(s.n, b.red)),
        blk_a(b.rows * b.red),
        sub(sub_cols(b.cols, isa, mul_dt)),
        nsub(ceil_div(b.cols, sub)),
        blk_sub(reblock::block_elems(b.red, sub, vnni)),
        a_step(cblk * nblk * blk_a),
        b_step(kblk * nsub * nblk * blk_sub),
        tmp_floats(2 * b.red * std::max(b.rows, sub)),
        long_batch(nblk * b.red * (s.c * terms.parts[0] + s.k * terms.parts[1]) * int64_t(mul_bytes) >
                   std::max(kLargeBytes, s.c * s.k * int64_t(sizeof(float)))),
        // dw is stored straight from the register tiles, with plain stores: inside a training
        // step the optimizer reads it next, from cache (non-temporal stores were much slower).
        kernels(desc(b.red, b.red, sub, s.k, dw_dt), s.c, s.k, b.rows, sub, dp.isa),
        tile(desc(b.red, b.red, sub, b.cols), s.c, s.k, b.rows, sub, dp.isa) {
    for (int t = 0; terms.split && t < terms.count; ++t)  // term-major, the small products first
      for (int64_t nb = 0; nb < nblk; ++nb) {
        a_offs.push_back(nb * blk_a + terms.of[0][t] * a_step);
        b_offs.push_back(nb * blk_sub + terms.of[1][t] * b_step);
      }
  }

  // The item's block of dw (rows x cols at c), reduced over every N-block: one BRGEMM per
  // sub-panel, into c's columns (ldc and dtype as `kernels` were built).
  void run(const KernelSet& kernels, int64_t rows, int64_t cols, const char* a, const char* bb, char* c,
           size_t cs) const {
    for (int64_t j = 0; j < cols; j += sub) {
      const Brgemm& k = kernels(rows, std::min(sub, cols - j));
      const char* bj = bb + j / sub * nblk * blk_sub * int64_t(mul_bytes);
      if (terms.split) k.offsets(a, a_offs.data(), bj, b_offs.data(), int64_t(a_offs.size()), c + j * int64_t(cs));
      else k.strided(a, blk_a, bj, blk_sub, nblk, c + j * int64_t(cs));
    }
  }

  // Bytes of the re-blocked x^T and dz, every part of them.
  size_t xt_bytes() const { return size_t(a_step * terms.parts[0]) * mul_bytes; }
  size_t dz_bytes() const { return size_t(b_step * terms.parts[1]) * mul_bytes; }

  const emulation::Terms terms;  // the products of every multiplication (one, unless emulated)

  const Blocking b;
  const int64_t cblk, kblk, nblk, blk_a;
  const int64_t sub, nsub, blk_sub;  // sub-panel width, sub-panels per K-block, one's block
  const int64_t a_step, b_step;  // elements from one part of x^T (of dz) to the next
  const int64_t tmp_floats;      // emulation::pack's scratch for one block
  const bool long_batch;  // re-blocked operands above kLargeBytes and dw: long_update's
  const KernelSet kernels;  // one block of dw, stored in dw's dtype
  const KernelSet tile;     // update_sgd's: one block of dw into a b.cols-wide tile
  std::vector<int64_t> a_offs, b_offs;  // emulated: the batch, (term, N-block) pairs

 private:
  static Blocking fixed(Blocking b, const Shape& s, bool vnni) {
    b = clamped(b, s.c, s.k);
    if (b.red <= 0) b.red = s.n;
    if (vnni) b.red = round_up(b.red, 2);
    return b;
  }
};

PlanCache<15, UpdatePlan> update_plans;

// ---------------------------------------------------------------------------------------
// The update of a long batch (the LSTM's reduces over every step and row): dw = x^T dz as
// the forward's panel pass, x^T (transposed once into scratch, zero-padded to whole
// reduction blocks) the activations and dz the weights. Every block of dw is reduced over
// the whole batch in one BRGEMM call and written once, rather than stored and reloaded once
// per chunk of the batch.

struct LongUpdatePlan {
  LongUpdatePlan(const Dispatch& dp, const Shape& s, DType dw_dt, int64_t threads)
      : red(batch_block(s, dp)),
        xt{s.c, round_up(s.n, red), s.k, multiply_dtype(operand_dtype(s), dp), Activation::none, 0, 0, s.products},
        ld(padded_ld(xt.c, dtype_size(xt.dt))),
        plan(dp, xt, blocking(dp, xt, red, threads), s.k, xt.c, ld, false, Activation::none, threads, dw_dt) {}

  const int64_t red;
  const Shape xt;    // the forward's shape: x^T (C x padded N, the multiply dtype; its parts) times dz
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

// Rows of x^T a transposing item writes.
constexpr int64_t kTransposeRows = 16;

void add_long_update(Job& job, int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
                     void* dw, DType dw_dt, float* db, const PlanKey& key) {
  const auto plan = long_update_plans.get(key, [&] { return LongUpdatePlan(dp, s, dw_dt, threads); });
  job.keep.push_back(plan);
  const LongUpdatePlan* lp = plan.get();
  const PanelPlan* p = &lp->plan;
  const int64_t ldx = s.ldx ? s.ldx : s.c, ldz = s.ldz ? s.ldz : s.k;
  const int64_t os = int64_t(dtype_size(dw_dt));
  const int64_t mul_bytes = int64_t(p->mul_bytes);
  const Isa isa = dp.isa;
  const bool split = p->terms.split;
  const auto buf = job_scratch<3>(job, {size_t(p->aop.step() * mul_bytes * p->terms.parts[0]), p->scratch_bytes(),
                                        split ? size_t(s.c * lp->ld) * sizeof(float) : 0});
  char* xt = buf[0];
  float* xf = reinterpret_cast<float*>(buf[2]);
  job.add(ceil_div(s.c, kTransposeRows), [=](int64_t i) {
    const ReblockTimer timer;
    const int64_t c0 = i * kTransposeRows, rows = std::min(kTransposeRows, s.c - c0);
    char* dst = xt + c0 * lp->ld * mul_bytes;
    if (!split) {
      reblock::pack(at(x, s.dt, c0), s.dt, ldx, true, rows, s.n, rows, lp->ld, p->mul_dt, false, dst, isa);
      return;
    }
    // x^T in fp32 (zeros past the batch: whole reduction blocks), then its parts
    float* xfc = xf + c0 * lp->ld;
    reblock::pack(at(x, s.dt, c0), s.dt, ldx, true, rows, s.n, rows, lp->ld, DType::f32, false, xfc, isa);
    emulation::split_rows(p->terms, 0, xfc, lp->ld, dst, p->mul_dt, lp->ld, p->aop.step(), rows, lp->ld, lp->ld);
  });
  p->add_with(
      job, xt, buf[1],
      [=](int64_t k0, int64_t cols, int64_t r, char* dst, float* tmp) {
        const int64_t n0 = r * lp->red;
        emulation::pack(p->terms, 1, at(dz, s.dt, n0 * ldz + k0), s.dt, ldz, false, std::min(lp->red, s.n - n0),
                        cols, lp->red, p->b.cols, p->mul_dt, p->vnni, dst, p->part_step, isa, tmp);
      },
      [=](int64_t c0, int64_t, int64_t k0, int64_t, auto&& multiply) {
        multiply(static_cast<char*>(dw) + (c0 * s.k + k0) * os, nullptr);
      });
  if (db)  // a column block of dz per item
    job.add(ceil_div(s.k, kCols), [=](int64_t i) {
      const int64_t k0 = i * kCols, cols = std::min(kCols, s.k - k0);
      float sum[kCols] = {};
      add_column_sums(at(dz, s.dt, k0), s.dt, ldz, s.n, cols, sum);
      std::copy(sum, sum + cols, db + k0);
    });
}

}  // namespace

Blocking update_blocking(const Shape& s, int64_t threads, const Dispatch& dp) {
  Blocking b;
  b.cols = std::min(s.k, kCols);
  b.rows = split_rows(s.c, ceil_div(s.k, b.cols), threads);
  b.red = batch_block(s, dp);
  return b;
}

// ---------------------------------------------------------------------------------------
// Weight update: dw[c, k] = sum_n x[n, c] dz[n, k], db[k] = sum_n dz[n, k].
// Items: (C-block, K-block) tiles of dw, each owned by one item, so the reduction over the
// batch happens inside one BRGEMM call (batch: the N-blocks) and needs no synchronization.
// A first parallel loop re-blocks the shared operands (x^T and dz, see UpdatePlan); db is
// summed from dz by the item that owns the K-block while it re-blocks that panel.

namespace {

std::shared_ptr<const UpdatePlan> update_plan(int64_t threads, const Dispatch& dp, const Shape& s, DType dw_dt,
                                              const Blocking* force) {
  return update_plans.get(key_of(s, int64_t(dw_dt), threads, dp, force), [&] {
    return UpdatePlan(dp, s, force ? *force : update_blocking(s, threads, dp), dw_dt);
  });
}

// Both passes' phases: re-block the operands (and sum db), then call item(i, xt, dzb) for
// each (C-block, K-block) item of dw, whose BRGEMM reduces over every N-block. `item` is
// copied into the job.
template <class Item>
void add_update_blocks(Job& job, int64_t threads, const Shape& s, const UpdatePlan* p, const void* x,
                       const void* dz, float* db, char* xt_buf, char* dz_buf, Item item) {
  const int64_t ldx = s.ldx ? s.ldx : s.c, ldz = s.ldz ? s.ldz : s.k;
  // emulation::pack's scratch, one per running item
  PanelPool* tmps = p->terms.split ? job_leases(job, size_t(p->tmp_floats) * sizeof(float), threads) : nullptr;
  const View<char, 2> xt(xt_buf, {p->cblk * p->nblk, int64_t(p->blk_a * p->mul_bytes)});   // [Cb][Nb] blocks
  const View<char, 3> dzb(dz_buf, {p->kblk, p->nsub * p->nblk, int64_t(p->blk_sub * p->mul_bytes)});  // [Kb][sub][Nb]
  job.add(p->cblk * p->nblk + p->kblk, [=](int64_t i) {
    const ReblockTimer timer;
    const Blocking& b = p->b;
    std::optional<PanelPool::Lease> lease;
    if (tmps) lease.emplace(*tmps);
    float* tmp = tmps ? reinterpret_cast<float*>(lease->data) : nullptr;
    if (i < p->cblk * p->nblk) {  // x^T block (cb, nb)
      const int64_t cb = i / p->nblk, c0 = cb * b.rows, n0 = i % p->nblk * b.red;
      emulation::pack(p->terms, 0, at(x, s.dt, n0 * ldx + c0), s.dt, ldx, true, std::min(b.rows, s.c - c0),
                      std::min(b.red, s.n - n0), b.rows, b.red, p->mul_dt, false, xt.at(i), p->a_step, p->isa, tmp);
      return;
    }
    const int64_t kb = i - p->cblk * p->nblk, k0 = kb * b.cols;  // dz column panel kb
    const int64_t cols = std::min(b.cols, s.k - k0);
    if (db) std::fill(db + k0, db + k0 + cols, 0.0f);
    for (int64_t nb = 0; nb < p->nblk; ++nb) {
      const int64_t n0 = nb * b.red, rows = std::min(b.red, s.n - n0);
      const void* src = at(dz, s.dt, n0 * ldz + k0);
      for (int64_t j = 0; j < cols; j += p->sub)
        emulation::pack(p->terms, 1, at(src, s.dt, j), s.dt, ldz, false, rows, std::min(p->sub, cols - j), b.red,
                        p->sub, p->mul_dt, p->vnni, dzb.at(kb, j / p->sub * p->nblk + nb), p->b_step, p->isa, tmp);
      if (db) add_column_sums(src, s.dt, ldz, rows, cols, db + k0);
    }
  });
  // C-block major: an x^T panel is reused
  job.add(p->cblk * p->kblk, [=](int64_t i) { item(i, xt.at(i / p->kblk * p->nblk), dzb.at(i % p->kblk)); });
}

}  // namespace

bool update_transposes(const Shape& s, int64_t threads, const Dispatch& dp) {
  return s.n > 0 && s.c > 0 && s.k > 0 && update_plan(threads, dp, s, DType::f32, nullptr)->long_batch;
}

Job update_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* dz, void* dw,
               DType dw_dt, float* db, const Blocking* force) {
  Job job;
  job.name = "fc_upd";
  if (s.c <= 0 || s.k <= 0) return job;
  if (s.n <= 0) {  // an empty batch: zero gradients
    job.add(1, [=](int64_t) {
      std::memset(dw, 0, size_t(s.c * s.k) * dtype_size(dw_dt));
      if (db) std::memset(db, 0, size_t(s.k) * sizeof(float));
    });
    return job;
  }
  job.flops = 2.0 * double(s.n) * double(s.c) * double(s.k);
  const auto plan = update_plan(threads, dp, s, dw_dt, force);
  if (plan->long_batch && !force) {
    add_long_update(job, threads, dp, s, x, dz, dw, dw_dt, db, key_of(s, int64_t(dw_dt), threads, dp, force));
    return job;
  }
  const UpdatePlan* p = plan.get();
  job.keep.push_back(plan);
  const auto buf = job_scratch<2>(job, {p->xt_bytes(), p->dz_bytes()});
  const int64_t os = int64_t(dtype_size(dw_dt));
  add_update_blocks(job, threads, s, p, x, dz, db, buf[0], buf[1], [=](int64_t i, char* a, char* bb) {
    const Blocking& b = p->b;
    const int64_t c0 = i / p->kblk * b.rows, k0 = i % p->kblk * b.cols;
    const int64_t rows = std::min(b.rows, s.c - c0), cols = std::min(b.cols, s.k - k0);
    p->run(p->kernels, rows, cols, a, bb, static_cast<char*>(dw) + (c0 * s.k + k0) * os, size_t(os));
  });
  return job;
}

void update(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
            void* dw, DType dw_dt, float* db, const Blocking* force) {
  run(ex, update_job(ex.num_threads, dp, s, x, dz, dw, dw_dt, db, force));
}

// The fused step: an item's block of dw goes to a leased tile (L1/L2) and is applied from
// there, so dw never reaches memory; a long batch computes the whole dw first (long_update).
// apply(g, off, n) applies n gradients at g to the parameters (and their state) from element
// off of w; bias(g) the K gradients of the bias; fetch(off, n) starts the parameters and
// state of such a piece on their way into cache.
namespace {

template <class Apply, class Bias, class Fetch>
Job fused_update_job(const char* name, int64_t threads, const Dispatch& dp, const Shape& s, const void* x,
                     const void* dz, bool has_bias, Apply apply, Bias bias, Fetch fetch) {
  Job job;
  job.name = name;
  if (s.c <= 0 || s.k <= 0) return job;
  if (s.n <= 0) {  // an empty batch: zero gradients (never in a training step)
    job.add(1, [=](int64_t) {
      const std::vector<float> none(size_t(s.k), 0.0f);  // one row of them
      for (int64_t c = 0; c < s.c; ++c) apply(none.data(), c * s.k, s.k);
      if (has_bias) bias(none.data());
    });
    return job;
  }
  job.flops = 2.0 * double(s.n) * double(s.c) * double(s.k);
  const auto plan = update_plan(threads, dp, s, DType::f32, nullptr);
  const UpdatePlan* p = plan.get();
  job.keep.push_back(plan);
  if (p->long_batch) {  // the whole gradient first, into scratch of its own
    const auto g = job_scratch<2>(job, {size_t(s.c * s.k) * sizeof(float), has_bias ? size_t(s.k) * sizeof(float) : 0});
    float* gw = reinterpret_cast<float*>(g[0]);
    float* gb = has_bias ? reinterpret_cast<float*>(g[1]) : nullptr;
    Job grad = update_job(threads, dp, s, x, dz, gw, DType::f32, gb);
    grad.flops = 0;
    job.then(std::move(grad));
    job.add(s.c, [=](int64_t c) { apply(gw + c * s.k, c * s.k, s.k); });
    if (has_bias) job.add(1, [=](int64_t) { bias(gb); });
    return job;
  }
  const Blocking bl = p->b;
  const size_t tile_bytes = Scratch::aligned(size_t(bl.rows * bl.cols) * sizeof(float));
  const auto buf = job_scratch<4>(job, {p->xt_bytes(), p->dz_bytes(),
                                        tile_bytes * size_t(threads), has_bias ? size_t(s.k) * sizeof(float) : 0});
  float* const db = has_bias ? reinterpret_cast<float*>(buf[3]) : nullptr;
  auto pool = std::make_shared<PanelPool>(buf[2], tile_bytes, threads);
  PanelPool* tiles = pool.get();
  job.keep.push_back(std::move(pool));
  add_update_blocks(job, threads, s, p, x, dz, db, buf[0], buf[1], [=](int64_t i, char* a, char* bb) {
    const int64_t c0 = i / p->kblk * bl.rows, k0 = i % p->kblk * bl.cols;
    const int64_t rows = std::min(bl.rows, s.c - c0), cols = std::min(bl.cols, s.k - k0);
    // The block's parameters and state start on their way from memory now and are in
    // cache when the BRGEMM is done.
    for (int64_t r = 0; r < rows; ++r) fetch((c0 + r) * s.k + k0, cols);
    const PanelPool::Lease tile(*tiles);
    float* t = reinterpret_cast<float*>(tile.data);
    p->run(p->tile, rows, cols, a, bb, reinterpret_cast<char*>(t), sizeof(float));
    for (int64_t r = 0; r < rows; ++r) apply(t + r * bl.cols, (c0 + r) * s.k + k0, cols);
  });
  if (has_bias) job.add(1, [=](int64_t) { bias(db); });
  return job;
}

void prefetch_row(const float* a, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) __builtin_prefetch(a + j, 1, 2);
}

}  // namespace

Job update_sgd_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* dz, const Sgd& o,
                   float* w, float* mw, float* b, float* mb) {
  Sgd ob = o;
  ob.weight_decay = o.bias_weight_decay;
  const Isa isa = dp.isa;
  return fused_update_job(
      "fc_upd_sgd", threads, dp, s, x, dz, b != nullptr,
      [=](const float* g, int64_t off, int64_t n) { sgd_step(o, g, w + off, mw + off, n, isa); },
      [=](const float* g) { sgd_step(ob, g, b, mb, s.k, isa); },
      [=](int64_t off, int64_t n) {
        prefetch_row(w + off, n);
        prefetch_row(mw + off, n);
      });
}

void update_sgd(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
                const Sgd& o, float* w, float* mw, float* b, float* mb) {
  run(ex, update_sgd_job(ex.num_threads, dp, s, x, dz, o, w, mw, b, mb));
}

Job update_adamw_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
                     const AdamW& o, float* w, float* mu, float* nu, float* b, float* bmu, float* bnu) {
  AdamW ob = o;
  ob.weight_decay = o.bias_weight_decay;
  const Isa isa = dp.isa;
  return fused_update_job(
      "fc_upd_adamw", threads, dp, s, x, dz, b != nullptr,
      [=](const float* g, int64_t off, int64_t n) { adamw_step(o, g, w + off, mu + off, nu + off, n, isa); },
      [=](const float* g) { adamw_step(ob, g, b, bmu, bnu, s.k, isa); },
      [=](int64_t off, int64_t n) {
        prefetch_row(w + off, n);
        prefetch_row(mu + off, n);
        prefetch_row(nu + off, n);
      });
}

void update_adamw(const Executor& ex, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
                  const AdamW& o, float* w, float* mu, float* nu, float* b, float* bmu, float* bnu) {
  run(ex, update_adamw_job(ex.num_threads, dp, s, x, dz, o, w, mu, nu, b, bmu, bnu));
}

}  // namespace jb::fc
