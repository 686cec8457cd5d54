// The FC layer's passes against naive loops in double precision: fp32 and bf16, every
// activation, shapes that are not multiples of the blocks, forced small blockings (many
// blocks and edge blocks), one thread and several.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "check.h"
#include "fixtures.h"
#include "layers/fc/fc.h"

namespace {

using jbtest::act_ref, jbtest::close, jbtest::Tensor, jbtest::TestPool;
using jb::Activation, jb::DType;
namespace fc = jb::fc;

double act_grad_ref(Activation a, double z) {
  const double h = 1e-5;
  if (a == Activation::relu) return z > 0 ? 1 : 0;
  if (a == Activation::none) return 1;
  return (act_ref(a, z + h) - act_ref(a, z - h)) / (2 * h);
}

void run_case(int64_t n, int64_t c, int64_t k, DType dt, DType w_dt, Activation act, bool bias,
              int64_t threads, const jb::Blocking* force, const jb::Dispatch& dp = jb::dispatch()) {
  std::mt19937 rng(unsigned(n * 131 + c * 17 + k));
  TestPool pool;
  const jb::Executor ex = pool.executor(threads);
  fc::Shape s{n, c, k, dt, act};
  Tensor x(dt, n * c), w(w_dt, c * k), dy(dt, n * k);
  x.fill(rng);
  w.fill(rng, 1.0f / std::sqrt(float(c)));
  dy.fill(rng);
  std::vector<float> b(k);
  for (auto& v : b) v = std::uniform_real_distribution<float>(-0.5f, 0.5f)(rng);
  // The kernel computes with w cast to dt.
  auto wv = [&](int64_t i) -> double {
    return dt == DType::bf16 ? jb::bf16_to_f32(jb::f32_to_bf16(w.f[i])) : w.f[i];
  };

  // forward
  std::vector<double> z_ref(n * k), y_ref(n * k);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j) {
      double acc = bias ? b[j] : 0;
      for (int64_t q = 0; q < c; ++q) acc += double(x.f[i * c + q]) * wv(q * k + j);
      z_ref[i * k + j] = acc;
      y_ref[i * k + j] = act_ref(act, acc);
    }
  Tensor y(dt, n * k), z(dt, n * k);
  fc::forward(ex, dp, s, x.data(), w.data(), w_dt, bias ? b.data() : nullptr, y.data(),
              act == Activation::gelu ? z.data() : nullptr, force);
  const double tol = dt == DType::bf16 ? 2e-2 : 1e-4;
  close(y, y_ref, tol, "y");
  if (act == Activation::gelu) close(z, z_ref, tol, "z");

  // act_grad, from what the forward saves
  Tensor dz(dt, n * k);
  const fc::Saved saved = fc::saved_for(act);
  const void* sv = saved == fc::Saved::output ? y.data() : saved == fc::Saved::preactivation ? z.data() : nullptr;
  fc::act_grad(ex, dp, s, dy.data(), sv, dz.data());
  std::vector<double> dz_ref(n * k);
  for (int64_t i = 0; i < n * k; ++i) dz_ref[i] = dy.f[i] * act_grad_ref(act, z_ref[i]);
  // relu's derivative flips where z rounds to the other side of 0: compare on the kernel's own dz.
  if (act != Activation::relu || dt == DType::f32) close(dz, dz_ref, dt == DType::bf16 ? 3e-2 : 1e-3, "dz");
  for (int64_t i = 0; i < n * k; ++i) dz_ref[i] = dz.get(i);

  // backward: dx = dz w^T
  std::vector<double> dx_ref(n * c);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t q = 0; q < c; ++q) {
      double acc = 0;
      for (int64_t j = 0; j < k; ++j) acc += dz_ref[i * k + j] * wv(q * k + j);
      dx_ref[i * c + q] = acc;
    }
  Tensor dx(dt, n * c);
  fc::backward(ex, dp, s, dz.data(), w.data(), w_dt, dx.data(), force);
  close(dx, dx_ref, tol, "dx");

  // update: dw = x^T dz (in w's dtype), db = sum dz
  std::vector<double> dw_ref(c * k, 0.0), db_ref(k, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j) {
      db_ref[j] += dz_ref[i * k + j];
      for (int64_t q = 0; q < c; ++q) dw_ref[q * k + j] += double(x.f[i * c + q]) * dz_ref[i * k + j];
    }
  Tensor dw(w_dt, c * k);
  std::vector<float> db(k, -1.0f);
  fc::update(ex, dp, s, x.data(), dz.data(), dw.data(), w_dt, bias ? db.data() : nullptr, force);
  close(dw, dw_ref, w_dt == DType::bf16 ? 2e-2 : 1e-4, "dw");
  if (bias) {
    Tensor dbt(DType::f32, k);
    dbt.f = db;
    close(dbt, db_ref, 1e-4, "db");
  }
}

const Activation kActs[] = {Activation::none, Activation::relu, Activation::gelu,
                            Activation::sigmoid, Activation::tanh};

}  // namespace

TEST(fc_all_passes_heuristic_blocking) {
  for (DType dt : {DType::f32, DType::bf16})
    for (Activation act : kActs)
      for (auto [n, c, k] : {std::array<int64_t, 3>{1, 1, 1}, {3, 5, 7}, {37, 70, 130},
                             {64, 512, 96}, {130, 48, 10},
                             {13, 1024, 20}, {9, 40, 1024},  // 4 KiB rows: padded A copies
                             {3, 1024, 520}})                 // dw of 2 MiB
        run_case(n, c, k, dt, dt, act, true, 2, nullptr);
}

TEST(fc_fp32_weights_with_bf16_compute) {
  for (Activation act : {Activation::none, Activation::tanh})
    run_case(29, 66, 75, DType::bf16, DType::f32, act, true, 2, nullptr);
}

TEST(fc_forced_small_blocks_and_edges) {
  // Many blocks of every kind: edge rows and columns, several reduction blocks (the
  // reduction block of bf16 odd on purpose: VNNI pairs padded per block), zero padding of
  // the update's batch blocks.
  const jb::Blocking blockings[] = {{5, 7, 3}, {12, 16, 8}, {1, 1, 1}, {24, 64, 6}};
  for (const auto& bl : blockings)
    for (DType dt : {DType::f32, DType::bf16})
      for (Activation act : {Activation::none, Activation::relu, Activation::gelu})
        run_case(23, 24, 19, dt, dt, act, act != Activation::relu, 1, &bl);
  const jb::Blocking odd{6, 16, 5};
  run_case(17, 25, 35, DType::bf16, DType::bf16, Activation::sigmoid, true, 3, &odd);
}

TEST(fc_weights_first) {
  // Every panel re-blocked first, then N-block items over all of them: edge rows and
  // columns, several reduction blocks, bias and activations, both dtypes, forced on small
  // shapes; and the heuristic takes it for a large fp32 batch against many panels.
  const jb::Blocking blockings[] = {{12, 16, 8, true}, {5, 7, 3, true}, {24, 64, 6, true}};
  for (const auto& bl : blockings)
    for (DType dt : {DType::f32, DType::bf16})
      for (Activation act : {Activation::none, Activation::gelu})
        run_case(23, 24, 19, dt, dt, act, true, 2, &bl);
  const fc::Shape big{8400, 1024, 4096, DType::f32, Activation::none};
  CHECK(fc::forward_blocking(big, 2, jb::dispatch()).weights_first);
  CHECK(fc::backward_blocking(big, 2, jb::dispatch()).weights_first);
  const fc::Shape test_dense{3100, 1030, 1030, DType::f32, Activation::none};  // test_dense.py's
  CHECK(fc::forward_blocking(test_dense, 2, jb::dispatch()).weights_first);
  CHECK(fc::backward_blocking(test_dense, 2, jb::dispatch()).weights_first);
  const fc::Shape small{256, 1024, 4096, DType::f32, Activation::none};
  CHECK(!fc::forward_blocking(small, 2, jb::dispatch()).weights_first);
  const fc::Shape few_blocks{2200, 1024, 1024, DType::f32, Activation::none};  // 23 N-blocks
  CHECK(!fc::forward_blocking(few_blocks, 2, jb::dispatch()).weights_first);
  const fc::Shape few_panels{8400, 256, 1024, DType::f32, Activation::none};  // the LSTM's dx at 256
  CHECK(!fc::backward_blocking(few_panels, 2, jb::dispatch()).weights_first);
  // Long reductions take narrow panels (an N-block's rows of x and a panel share L2).
  const fc::Shape dx512{8400, 512, 2048, DType::f32, Activation::none};  // the LSTM's dx at 512
  const jb::Blocking dx = fc::backward_blocking(dx512, 2, jb::dispatch());
  CHECK(dx.weights_first && dx.cols == 32);
}

TEST(fc_update_sub_panels) {
  // K-blocks of several 32-column sub-panels of dz, and an edge K-block whose last
  // sub-panel is narrower (K = 100: 64 + 36; K = 200: 96 + 96 + 8), dw in both dtypes.
  const jb::Blocking wide[] = {{24, 64, 6}, {12, 96, 4}};
  for (DType dt : {DType::f32, DType::bf16})
    for (DType w_dt : {DType::f32, DType::bf16}) {
      if (dt == DType::f32 && w_dt == DType::bf16) continue;
      run_case(23, 24, 100, dt, w_dt, Activation::none, true, 2, &wide[0]);
      run_case(23, 30, 200, dt, w_dt, Activation::none, true, 3, &wide[1]);
    }
}

TEST(fc_update_of_a_long_batch) {
  // A batch longer than one chunk: dw as the forward's pass over x^T, zero-padded to whole
  // reduction blocks (n prime), edge panels and rows; x's and dz's rows wider than c and k
  // (jb.lstm's saved xh and da, extra columns NaN and never read); db; fp32 and bf16.
  TestPool pool;
  const jb::Executor ex = pool.executor(2);
  const int64_t c = 333, k = 400, ldx = 340, ldz = 416;
  for (DType dt : {DType::f32, DType::bf16})
    for (DType w_dt : {DType::f32, DType::bf16}) {
      if (dt == DType::f32 && w_dt == DType::bf16) continue;
      const int64_t n = dt == DType::f32 ? 3001 : 6007;  // a chunk holds twice the bf16 rows
      const fc::Shape s{n, c, k, dt, Activation::none, ldx, ldz};
      CHECK(fc::update_transposes(s, 2, jb::dispatch())) << "the batch is not long enough";
      std::mt19937 rng{unsigned(7 + int(dt) + 3 * int(w_dt))};
      Tensor x(dt, n * ldx), dz(dt, n * ldz);
      x.fill(rng);
      dz.fill(rng);
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = c; j < ldx; ++j) x.set(i * ldx + j, NAN);
        for (int64_t j = k; j < ldz; ++j) dz.set(i * ldz + j, NAN);
      }
      std::vector<double> dw_ref(c * k, 0.0), db_ref(k, 0.0);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t q = 0; q < c; ++q) {
          const double xv = x.get(i * ldx + q);
          for (int64_t j = 0; j < k; ++j) dw_ref[q * k + j] += xv * dz.get(i * ldz + j);
        }
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < k; ++j) db_ref[j] += dz.get(i * ldz + j);
      Tensor dw(w_dt, c * k), dbt(DType::f32, k);
      dbt.f.assign(k, -1.0f);
      fc::update(ex, jb::dispatch(), s, x.data(), dz.data(), dw.data(), w_dt, dbt.f.data());
      // a sum of 3001 products: bf16 inputs are exact in fp32, so only the output's rounding
      close(dw, dw_ref, w_dt == DType::bf16 ? 1e-2 : 1e-4, "dw");
      close(dbt, db_ref, 1e-4, "db");
    }
}

TEST(fc_backward_and_update_read_the_first_k_columns_of_a_wider_dz) {
  // jb.lstm's da: rows ldz apart, extra columns (here NaN) never read. ldz = 1024 fp32 is a
  // 4 KiB row period (dx copies its A operand), 1040 is read in place.
  TestPool pool;
  const jb::Executor ex = pool.executor(2);
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t ldz : {int64_t(1000), int64_t(1024), int64_t(1040)}) {
      const int64_t n = 37, c = 29, k = 1000;
      std::mt19937 rng{unsigned(ldz)};
      Tensor x(dt, n * c), w(DType::f32, c * k), dz(dt, n * k), wide(dt, n * ldz);
      x.fill(rng);
      w.fill(rng, 0.05f);
      dz.fill(rng);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < ldz; ++j) wide.set(i * ldz + j, j < k ? dz.get(i * k + j) : NAN);
      const fc::Shape dense{n, c, k, dt}, padded{n, c, k, dt, Activation::none, 0, ldz};
      Tensor dx(dt, n * c), dx_w(dt, n * c), dw(DType::f32, c * k), dw_w(DType::f32, c * k);
      std::vector<float> db(k), db_w(k);
      fc::backward(ex, jb::dispatch(), dense, dz.data(), w.data(), DType::f32, dx.data());
      fc::backward(ex, jb::dispatch(), padded, wide.data(), w.data(), DType::f32, dx_w.data());
      fc::update(ex, jb::dispatch(), dense, x.data(), dz.data(), dw.data(), DType::f32, db.data());
      fc::update(ex, jb::dispatch(), padded, x.data(), wide.data(), dw_w.data(), DType::f32, db_w.data());
      for (int64_t i = 0; i < n * c; ++i) CHECK(dx_w.get(i) == dx.get(i)) << "dx[" << i << "] ldz " << ldz;
      for (int64_t i = 0; i < c * k; ++i) CHECK(dw_w.get(i) == dw.get(i)) << "dw[" << i << "] ldz " << ldz;
      CHECK(db_w == db) << "db, ldz " << ldz;
    }
}

// update_sgd against update() followed by the SGD step in double precision.
void sgd_case(int64_t n, int64_t c, int64_t k, DType dt, const fc::Sgd& o, bool bias, int64_t threads,
              const jb::Dispatch& dp = jb::dispatch()) {
  std::mt19937 rng(unsigned(n * 7 + c * 3 + k));
  TestPool pool;
  const jb::Executor ex = pool.executor(threads);
  const fc::Shape s{n, c, k, dt, Activation::none};
  Tensor x(dt, n * c), dz(dt, n * k);
  x.fill(rng);
  dz.fill(rng);
  std::vector<float> w(c * k), m(c * k), b(k), mb(k), dw(c * k), db(k);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto* v : {&w, &m, &b, &mb})
    for (float& e : *v) e = u(rng);
  std::vector<float> w0 = w, m0 = m, b0 = b, mb0 = mb;
  fc::update(ex, dp, s, x.data(), dz.data(), dw.data(), DType::f32, db.data());
  fc::update_sgd(ex, dp, s, x.data(), dz.data(), o, w.data(), m.data(), bias ? b.data() : nullptr,
                 bias ? mb.data() : nullptr);
  int bad = 0;
  auto expect = [&](const char* what, size_t i, double got, double want) {
    if (!(std::fabs(got - want) <= 1e-5 * (1 + std::fabs(want))) && bad++ < 3)
      CHECK(false) << what << "[" << i << "] = " << got << ", want " << want << " (n=" << n << " c=" << c
                   << " k=" << k << " nesterov=" << o.nesterov << ")";
  };
  auto step = [&](const char* what, const std::vector<float>& g, const std::vector<float>& p0,
                  const std::vector<float>& m_0, const std::vector<float>& p, const std::vector<float>& mm,
                  double wd) {
    for (size_t i = 0; i < g.size(); ++i) {
      const double gi = g[i] + wd * p0[i], mi = gi + o.momentum * double(m_0[i]);
      expect(what, i, mm[i], mi);
      expect(what, i, p[i], p0[i] - o.lr * (o.nesterov ? gi + o.momentum * mi : mi));
    }
  };
  step("w", dw, w0, m0, w, m, o.weight_decay);
  if (bias) step("b", db, b0, mb0, b, mb, o.bias_weight_decay);
  else CHECK(b == b0 && mb == mb0) << "bias touched without one";
}

TEST(fc_update_sgd) {
  // The optimizer step fused into the weight update: nesterov or not, weight decay on the
  // kernel only, edge blocks, one thread and two, and a long batch (the whole dw computed
  // by long_update before the step).
  for (DType dt : {DType::f32, DType::bf16}) {
    sgd_case(23, 24, 19, dt, {0.05f, 0.9f, 0.0f, true}, true, 2);
    sgd_case(1, 1, 1, dt, {0.1f, 0.8f, 1e-3f, false}, true, 1);
    sgd_case(37, 130, 141, dt, {0.01f, 0.95f, 5e-4f, true}, false, 2);
    sgd_case(17, 30, 33, dt, {0.01f, 0.9f, 5e-4f, false, 5e-4f}, true, 2);  // the bias decays too
    sgd_case(0, 5, 7, dt, {0.1f, 0.9f, 1e-3f, true}, true, 2);
  }
  CHECK(fc::update_transposes(fc::Shape{2200, 500, 500, DType::f32}, 2, jb::dispatch()));
  sgd_case(2200, 500, 500, DType::f32, {0.02f, 0.9f, 1e-4f, true}, true, 2);
  for (jb::Isa isa : {jb::Isa::generic, jb::Isa::avx2})  // the element-wise step's other paths
    if (isa <= jb::best_isa())
      sgd_case(29, 40, 37, DType::f32, {0.05f, 0.9f, 1e-3f, true}, true, 2, jb::make_dispatch(isa, ""));
}

// update_adamw against update() followed by optax's AdamW step in double precision.
void adamw_case(int64_t n, int64_t c, int64_t k, DType dt, const fc::AdamW& o, bool bias, int64_t threads,
                const jb::Dispatch& dp = jb::dispatch()) {
  std::mt19937 rng(unsigned(n * 5 + c * 11 + k));
  TestPool pool;
  const jb::Executor ex = pool.executor(threads);
  const fc::Shape s{n, c, k, dt, Activation::none};
  Tensor x(dt, n * c), dz(dt, n * k);
  x.fill(rng);
  dz.fill(rng);
  std::vector<float> w(c * k), mu(c * k), nu(c * k), b(k), bmu(k), bnu(k), dw(c * k), db(k);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto* v : {&w, &mu, &b, &bmu})
    for (float& e : *v) e = u(rng);
  for (auto* v : {&nu, &bnu})
    for (float& e : *v) e = std::fabs(u(rng));
  const std::vector<float> w0 = w, mu0 = mu, nu0 = nu, b0 = b, bmu0 = bmu, bnu0 = bnu;
  fc::update(ex, dp, s, x.data(), dz.data(), dw.data(), DType::f32, db.data());
  fc::update_adamw(ex, dp, s, x.data(), dz.data(), o, w.data(), mu.data(), nu.data(), bias ? b.data() : nullptr,
                   bias ? bmu.data() : nullptr, bias ? bnu.data() : nullptr);
  int bad = 0;
  auto expect = [&](const char* what, size_t i, double got, double want) {
    if (!(std::fabs(got - want) <= 1e-5 * (1 + std::fabs(want))) && bad++ < 3)
      CHECK(false) << what << "[" << i << "] = " << got << ", want " << want << " (n=" << n << " c=" << c
                   << " k=" << k << ")";
  };
  auto step = [&](const char* what, const std::vector<float>& g, const std::vector<float>& p0,
                  const std::vector<float>& m0, const std::vector<float>& v0, const std::vector<float>& p,
                  const std::vector<float>& m, const std::vector<float>& v, double wd) {
    for (size_t i = 0; i < g.size(); ++i) {
      const double mi = (1 - double(o.b1)) * g[i] + o.b1 * double(m0[i]);
      const double vi = (1 - double(o.b2)) * double(g[i]) * g[i] + o.b2 * double(v0[i]);
      const double ui = mi / o.bc1 / (std::sqrt(vi / o.bc2 + o.eps_root) + o.eps) + wd * p0[i];
      expect(what, i, m[i], mi);
      expect(what, i, v[i], vi);
      expect(what, i, p[i], p0[i] - o.lr * ui);
    }
  };
  step("w", dw, w0, mu0, nu0, w, mu, nu, o.weight_decay);
  if (bias) step("b", db, b0, bmu0, bnu0, b, bmu, bnu, o.bias_weight_decay);
  else CHECK(b == b0 && bmu == bmu0 && bnu == bnu0) << "bias touched without one";
}

TEST(fc_update_adamw) {
  // AdamW fused into the weight update: weight decay on the kernel and not or also on the
  // bias, edge blocks, one thread and two, a long batch, and every ISA's element-wise loop.
  auto rule = [](float lr, float wd, float bwd, int t) {
    const float b1 = 0.9f, b2 = 0.999f;
    return fc::AdamW{lr, b1, b2, 1 - b1, 1 - b2, 1e-8f, 0.0f, wd,
                     float(1 - std::pow(double(b1), t)), float(1 - std::pow(double(b2), t)), bwd};
  };
  for (DType dt : {DType::f32, DType::bf16}) {
    adamw_case(23, 24, 19, dt, rule(1e-3f, 1e-2f, 0.0f, 1), true, 2);
    adamw_case(1, 1, 1, dt, rule(1e-2f, 0.0f, 0.0f, 7), true, 1);
    adamw_case(37, 130, 141, dt, rule(1e-3f, 1e-4f, 1e-4f, 3), false, 2);
    adamw_case(0, 5, 7, dt, rule(1e-3f, 1e-4f, 1e-4f, 2), true, 2);
  }
  adamw_case(2200, 500, 500, DType::f32, rule(1e-3f, 1e-4f, 1e-4f, 5), true, 2);
  for (jb::Isa isa : {jb::Isa::generic, jb::Isa::avx2})
    if (isa <= jb::best_isa())
      adamw_case(29, 40, 37, DType::f32, rule(1e-3f, 1e-2f, 1e-2f, 2), true, 2, jb::make_dispatch(isa, ""));
}

TEST(fc_blocking_parallelizes_small_batches) {
  for (int64_t n : {1, 8, 64, 256, 1024}) {
    fc::Shape s{n, 1024, 1024, DType::f32, Activation::none};
    const jb::Blocking b = fc::forward_blocking(s, 2, jb::dispatch());
    const int64_t items = (n + b.rows - 1) / b.rows * ((1024 + b.cols - 1) / b.cols);
    CHECK(items >= 16) << "n=" << n << " gives only " << items << " forward items";
    CHECK(b.rows <= n && b.rows >= 1) << "rows=" << b.rows;
    CHECK(1024 % b.red == 0) << "red=" << b.red;
  }
  fc::Shape s{256, 784, 1024, DType::bf16, Activation::none};
  CHECK(784 % fc::forward_blocking(s, 2, jb::dispatch()).red == 0);
  CHECK(fc::update_blocking(s, 2, jb::dispatch()).red % 2 == 0);
}

TEST(fc_nan_propagates) {
  TestPool pool;
  const jb::Executor ex = pool.executor(2);
  fc::Shape s{4, 8, 20, DType::f32, Activation::none};
  std::vector<float> x(4 * 8, 1.0f), w(8 * 20, 1.0f), y(4 * 20);
  x[1 * 8 + 3] = NAN;
  fc::forward(ex, jb::dispatch(), s, x.data(), w.data(), DType::f32, nullptr, y.data(), nullptr);
  for (int j = 0; j < 20; ++j) {
    CHECK(std::isnan(y[1 * 20 + j])) << "row 1 col " << j;
    CHECK(y[0 * 20 + j] == 8.0f) << "row 0 col " << j << " = " << y[j];
  }
}

TEST(fc_bf16_both_multiply_paths) {
  // bf16 operands multiply either with bf16 dot products or widened to fp32 FMAs (decided
  // once per process from the CPU); both paths must agree with the reference.
  for (const char* mode : {"dot", "fp32"}) {
    const jb::Dispatch dp = jb::make_dispatch(jb::best_isa(), mode);
    CHECK(jb::multiply_dtype(DType::bf16, dp) == (mode[0] == 'd' ? DType::bf16 : DType::f32)) << mode;
    CHECK(jb::multiply_dtype(DType::f32, dp) == DType::f32) << mode;
    for (Activation act : {Activation::none, Activation::gelu})
      run_case(41, 130, 70, DType::bf16, DType::f32, act, true, 2, nullptr, dp);
    run_case(7, 1024, 36, DType::bf16, DType::f32, Activation::relu, true, 2, nullptr, dp);
    const jb::Blocking small{12, 16, 5};
    run_case(19, 35, 33, DType::bf16, DType::bf16, Activation::relu, true, 1, &small, dp);
  }
}

TEST(fc_every_isa) {
  // The layer on every kernel variant this CPU can run, with the default multiply path.
  for (jb::Isa isa : {jb::Isa::generic, jb::Isa::avx2, jb::Isa::avx512, jb::Isa::amx}) {
    if (isa > jb::best_isa()) continue;
    const jb::Dispatch dp = jb::make_dispatch(isa, "");
    for (DType dt : {DType::f32, DType::bf16})
      run_case(29, 66, 75, dt, DType::f32, Activation::gelu, true, 2, nullptr, dp);
    const jb::Blocking small{12, 16, 6};
    run_case(19, 35, 33, DType::bf16, DType::bf16, Activation::relu, true, 1, &small, dp);
  }
}

// --- fp32 from bf16 products (Shape::products) --------------------------------------

namespace {

using jbtest::part_products;

// Every pass held to fp32's rounding of the sum of its operands' part products: it
// multiplies exactly those parts (one bf16 product is ~1e-3 from the exact result, so a
// pass that skipped the split, or a term, would fail by far).
void emulated_case(int64_t n, int64_t c, int64_t k, int64_t products, Activation act, const jb::Dispatch& dp,
                   const jb::Blocking* force = nullptr) {
  std::mt19937 rng(unsigned(n * 7 + c * 3 + k + products));
  TestPool pool;
  const jb::Executor ex = pool.executor(2);
  const fc::Shape s{n, c, k, DType::f32, act, 0, 0, products};
  Tensor x(DType::f32, n * c), w(DType::f32, c * k), dz(DType::f32, n * k);
  x.fill(rng);
  w.fill(rng, 1.0f / std::sqrt(float(c)));
  dz.fill(rng);
  std::vector<float> b(static_cast<size_t>(k));
  for (auto& v : b) v = std::uniform_real_distribution<float>(-0.5f, 0.5f)(rng);

  std::vector<double> y_ref = part_products(products, x.f.data(), c, 1, w.f.data(), k, 1, n, c, k);
  std::vector<double> z_ref = y_ref;
  for (int64_t i = 0; i < n * k; ++i) z_ref[size_t(i)] += b[size_t(i % k)], y_ref[size_t(i)] = act_ref(act, z_ref[size_t(i)]);
  Tensor y(DType::f32, n * k), z(DType::f32, n * k);
  fc::forward(ex, dp, s, x.data(), w.data(), DType::f32, b.data(), y.data(),
              act == Activation::gelu ? z.data() : nullptr, force);
  close(y, y_ref, 1e-5, "emulated y");
  if (act == Activation::gelu) close(z, z_ref, 1e-5, "emulated z");

  Tensor dx(DType::f32, n * c);
  fc::backward(ex, dp, s, dz.data(), w.data(), DType::f32, dx.data(), force);
  close(dx, part_products(products, dz.f.data(), k, 1, w.f.data(), 1, k, n, k, c), 1e-5, "emulated dx");

  Tensor dw(DType::f32, c * k);
  fc::update(ex, dp, s, x.data(), dz.data(), dw.data(), DType::f32, nullptr, force);
  close(dw, part_products(products, x.f.data(), 1, c, dz.f.data(), k, 1, c, n, k), 1e-5, "emulated dw");
}

}  // namespace

TEST(fc_emulated_products) {
  for (jb::Isa isa : {jb::Isa::generic, jb::Isa::avx2, jb::Isa::avx512, jb::Isa::amx}) {
    if (isa > jb::best_isa()) continue;
    for (const char* mode : {"dot", "fp32"})
      for (int64_t products : {1, 3, 6}) {
        const jb::Dispatch dp = jb::make_dispatch(isa, mode);
        emulated_case(29, 67, 75, products, products == 3 ? Activation::gelu : Activation::relu, dp);
      }
  }
  // edge blocks of every pass; panels re-blocked first
  const jb::Blocking small{12, 16, 6}, first{12, 32, 0, true};
  emulated_case(19, 36, 33, 3, Activation::none, jb::dispatch(), &small);
  emulated_case(50, 40, 70, 6, Activation::sigmoid, jb::dispatch(), &first);
}

TEST(fc_emulated_update_of_a_long_batch) {
  // x^T split after its transpose, zero-padded to whole reduction blocks (n prime)
  TestPool pool;
  const jb::Executor ex = pool.executor(2);
  const int64_t n = 60013, c = 16, k = 24;
  const fc::Shape s{n, c, k, DType::f32, Activation::none, 0, 0, 3};
  CHECK(fc::update_transposes(s, 2, jb::dispatch())) << "the batch is not long enough";
  std::mt19937 rng{11};
  Tensor x(DType::f32, n * c), dz(DType::f32, n * k), dw(DType::f32, c * k);
  x.fill(rng);
  dz.fill(rng);
  fc::update(ex, jb::dispatch(), s, x.data(), dz.data(), dw.data(), DType::f32, nullptr);
  close(dw, part_products(3, x.f.data(), 1, c, dz.f.data(), k, 1, c, n, k), 1e-4, "emulated dw");  // 60k terms
}

TEST(dispatch_rejects_bad_overrides) {
  bool threw = false;
  try {
    jb::make_dispatch(jb::Isa::generic, "fast");
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  CHECK(jb::make_dispatch(jb::Isa::generic, "").bf16_multiply == DType::f32);
  CHECK(jb::make_dispatch(jb::Isa::amx, "auto").bf16_multiply == DType::bf16);
}
