// The LSTM layer against a naive double-precision LSTM: forward outputs, the final carry (or
// each row's carry after its own last step) and every gradient (x, both kernels, the bias,
// the initial carry) for both layouts, fp32 and bf16 (both multiply paths), odd sizes and
// sizes of 1, forced small blockings (edge tiles everywhere), one thread and several, every
// ISA this CPU runs. The
// backward's dx, dW and dR come from the fully-connected passes over bptt's da, as in the
// Python op. The reference's own gradients are checked by finite differences once.
#include <array>
#include <cmath>
#include <functional>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "check.h"
#include "fixtures.h"
#include "layers/fc/fc.h"
#include "layers/lstm/lstm.h"

namespace {

using jbtest::Tensor, jbtest::TestPool;
using jb::DType;
namespace lstm = jb::lstm;

bool close(const Tensor& got, const std::vector<double>& want, double tol, const char* what,
           const char* ctx) {
  int bad = 0;
  double scale = 0;
  for (double v : want) scale = std::max(scale, std::fabs(v));
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = got.get(i);
    if (!(std::fabs(g - want[i]) <= tol * (0.5 * scale + std::fabs(want[i])) + 1e-6)) {
      if (bad++ < 3) CHECK(false) << ctx << " " << what << "[" << i << "] = " << g << ", want " << want[i];
    }
  }
  return bad == 0;
}

double sig(double v) { return 1 / (1 + std::exp(-v)); }

// The problem: sizes, layout, and the values as the kernels see them (x, h0 in dt; the
// weights as the multiply dtype rounds them).
struct Problem {
  int64_t t, n, c, k;
  bool tm;
  std::vector<double> x, w, r, b, c0, h0, dy, dcl, dhl;  // x in (t, n, c) order here
  std::vector<int32_t> last;  // row n's carry is after step last[n]; empty: T-1 for every row
  int64_t step_of(int64_t nn) const { return last.empty() ? t - 1 : last[nn]; }
  int64_t row(int64_t tt, int64_t nn) const { return tm ? tt * n + nn : nn * t + tt; }
};

struct Ref {
  std::vector<double> y, cl, hl, gates;         // y in (t, n, k), the activated gates (t, n, 4k)
  std::vector<double> dx, dw, dr, db, dc0, dh0;  // dx in (t, n, c) order
};

// The naive LSTM in double precision, forward and reverse mode. `hround` rounds h before
// it is multiplied by R (bf16 multiplies).
Ref reference(const Problem& p, const std::function<double(double)>& hround) {
  const int64_t T = p.t, N = p.n, C = p.c, K = p.k, G = 4 * K;
  Ref o;
  std::vector<double> gates(T * N * G), cs(T * N * K), hs((T + 1) * N * K);
  o.cl.assign(N * K, 0), o.hl.assign(N * K, 0);
  for (int64_t i = 0; i < N * K; ++i) hs[i] = p.h0[i];
  std::vector<double> cprev = p.c0;
  o.y.assign(T * N * K, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double* g = &gates[(t * N + n) * G];
      for (int64_t j = 0; j < G; ++j) {
        double acc = p.b[j];
        for (int64_t q = 0; q < C; ++q) acc += p.x[(t * N + n) * C + q] * p.w[q * G + j];
        for (int64_t q = 0; q < K; ++q) acc += hround(hs[(t * N + n) * K + q]) * p.r[q * G + j];
        g[j] = acc;
      }
      for (int64_t j = 0; j < K; ++j) {
        const double i = sig(g[j]), f = sig(g[K + j]), gg = std::tanh(g[2 * K + j]), og = sig(g[3 * K + j]);
        g[j] = i, g[K + j] = f, g[2 * K + j] = gg, g[3 * K + j] = og;
        const double c = f * cprev[n * K + j] + i * gg;
        cs[(t * N + n) * K + j] = c;
        hs[((t + 1) * N + n) * K + j] = og * std::tanh(c);
        o.y[(t * N + n) * K + j] = og * std::tanh(c);
        if (p.step_of(n) == t) o.cl[n * K + j] = c, o.hl[n * K + j] = og * std::tanh(c);
      }
      if (n == N - 1)
        for (int64_t q = 0; q < N * K; ++q) cprev[q] = cs[t * N * K + q];
    }
  o.gates = gates;
  if (!T) o.cl = p.c0, o.hl = p.h0;
  // Reverse mode: the carry's gradients enter at each row's last step.
  o.dx.assign(T * N * C, 0), o.dw.assign(C * G, 0), o.dr.assign(K * G, 0), o.db.assign(G, 0);
  std::vector<double> dh(N * K, 0), dc(N * K, 0), da(G);
  if (!T) dh = p.dhl, dc = p.dcl;
  for (int64_t t = T - 1; t >= 0; --t) {
    std::vector<double> dh_prev(N * K, 0);
    for (int64_t n = 0; n < N; ++n) {
      if (p.step_of(n) == t)
        for (int64_t j = 0; j < K; ++j) dh[n * K + j] += p.dhl[n * K + j], dc[n * K + j] += p.dcl[n * K + j];
      const double* g = &gates[(t * N + n) * G];
      for (int64_t j = 0; j < K; ++j) {
        const double h = dh[n * K + j] + p.dy[(t * N + n) * K + j];
        const double c = cs[(t * N + n) * K + j];
        const double cp = t ? cs[((t - 1) * N + n) * K + j] : p.c0[n * K + j];
        const double i = g[j], f = g[K + j], gg = g[2 * K + j], og = g[3 * K + j], tc = std::tanh(c);
        const double dcur = dc[n * K + j] + h * og * (1 - tc * tc);
        da[j] = dcur * gg * i * (1 - i);
        da[K + j] = dcur * cp * f * (1 - f);
        da[2 * K + j] = dcur * i * (1 - gg * gg);
        da[3 * K + j] = h * tc * og * (1 - og);
        dc[n * K + j] = dcur * f;
      }
      for (int64_t j = 0; j < G; ++j) {
        o.db[j] += da[j];
        for (int64_t q = 0; q < C; ++q) {
          o.dx[(t * N + n) * C + q] += da[j] * p.w[q * G + j];
          o.dw[q * G + j] += p.x[(t * N + n) * C + q] * da[j];
        }
        for (int64_t q = 0; q < K; ++q) {
          dh_prev[n * K + q] += da[j] * p.r[q * G + j];
          o.dr[q * G + j] += hround(hs[(t * N + n) * K + q]) * da[j];
        }
      }
    }
    dh = dh_prev;
  }
  o.dc0 = dc;
  o.dh0 = dh;
  return o;
}

Problem make_problem(int64_t t, int64_t n, int64_t c, int64_t k, bool tm, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(-1, 1);
  Problem p{t, n, c, k, tm, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  auto fill = [&](std::vector<double>& v, size_t size, double scale) {
    v.resize(size);
    for (auto& e : v) e = scale * u(rng);
  };
  fill(p.x, t * n * c, 1.0);
  fill(p.w, c * 4 * k, 1.0 / std::sqrt(double(c)));
  fill(p.r, k * 4 * k, 1.0 / std::sqrt(double(k)));
  fill(p.b, 4 * k, 0.5);
  fill(p.c0, n * k, 1.0);
  fill(p.h0, n * k, 1.0);
  fill(p.dy, t * n * k, 1.0);
  fill(p.dcl, n * k, 1.0);
  fill(p.dhl, n * k, 1.0);
  return p;
}

struct Opts {
  DType dt = DType::f32;
  DType w_dt = DType::f32;
  int64_t threads = 2;
  const jb::Blocking* force = nullptr;
  jb::Dispatch dp = jb::dispatch();
  bool no_carry_grads = false;  // bptt gets null dc_last / dh_last (meaning zeros)
  bool row_steps = false;       // each row's own last step (the first row's T-1, the second's 0)
  int64_t products = 0;         // fp32 emulated from bf16 products (0: exact)
};

// Last steps for N rows of T steps: T-1, 0, then a spread over every step.
std::vector<int32_t> row_steps(int64_t T, int64_t N) {
  std::vector<int32_t> last(N);
  for (int64_t n = 0; n < N; ++n) last[n] = int32_t(n == 0 ? T - 1 : n == 1 ? 0 : (n * 5 + 2) % T);
  return last;
}

void run_case(int64_t T, int64_t N, int64_t C, int64_t K, bool tm, const Opts& o) {
  char ctx[180];
  std::snprintf(ctx, sizeof ctx, "[T=%ld N=%ld C=%ld K=%ld tm=%d dt=%d w=%d thr=%ld isa=%s mul=%d steps=%d]",
                long(T), long(N), long(C), long(K), int(tm), int(o.dt), int(o.w_dt),
                long(o.threads), jb::isa_name(o.dp.isa), int(o.dp.bf16_multiply), int(o.row_steps));
  Problem p = make_problem(T, N, C, K, tm, unsigned(T * 1000 + N * 100 + C * 10 + K));
  if (o.row_steps) p.last = row_steps(T, N);
  if (o.no_carry_grads) std::fill(p.dhl.begin(), p.dhl.end(), 0.0), std::fill(p.dcl.begin(), p.dcl.end(), 0.0);
  const int64_t G = 4 * K;
  const DType kd = jb::multiply_dtype(o.dt, o.dp);
  // Storage in the layer's layouts and dtypes; the problem's values become the stored ones.
  Tensor x(o.dt, T * N * C), w(o.w_dt, C * G), r(o.w_dt, K * G), h0(o.dt, N * K), dy(o.dt, T * N * K),
      dhl(o.dt, N * K);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t q = 0; q < C; ++q) {
        x.set(p.row(t, n) * C + q, float(p.x[(t * N + n) * C + q]));
        p.x[(t * N + n) * C + q] = x.get(p.row(t, n) * C + q);
      }
  auto rnd = [&](double v) { return kd == DType::bf16 ? double(jb::bf16_to_f32(jb::f32_to_bf16(float(v)))) : double(float(v)); };
  for (size_t i = 0; i < p.w.size(); ++i) w.set(i, float(p.w[i])), p.w[i] = rnd(w.get(i));
  for (size_t i = 0; i < p.r.size(); ++i) r.set(i, float(p.r[i])), p.r[i] = rnd(r.get(i));
  for (size_t i = 0; i < p.h0.size(); ++i) h0.set(i, float(p.h0[i])), p.h0[i] = h0.get(i);
  for (size_t i = 0; i < p.dhl.size(); ++i) dhl.set(i, float(p.dhl[i])), p.dhl[i] = dhl.get(i);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t q = 0; q < K; ++q) {
        dy.set(p.row(t, n) * K + q, float(p.dy[(t * N + n) * K + q]));
        p.dy[(t * N + n) * K + q] = dy.get(p.row(t, n) * K + q);
      }
  std::vector<float> b(p.b.begin(), p.b.end()), c0(p.c0.begin(), p.c0.end()),
      dcl(p.dcl.begin(), p.dcl.end());
  for (size_t i = 0; i < b.size(); ++i) p.b[i] = b[i];
  for (size_t i = 0; i < c0.size(); ++i) p.c0[i] = c0[i], p.dcl[i] = dcl[i];

  const Ref ref = reference(p, [&](double v) { return kd == DType::bf16 ? double(jb::bf16_to_f32(jb::f32_to_bf16(float(v)))) : v; });

  TestPool pool;
  const jb::Executor ex = pool.executor(o.threads);
  const lstm::Shape s{T, N, C, K, o.dt, tm, o.products};
  const bool bf16 = o.dt == DType::bf16 || o.products == 1;  // one bf16 product: bf16's accuracy
  const double tol = bf16 ? 3e-2 : 2e-4;

  // Inference forward (nothing saved) and training forward (gates and cell states saved).
  for (bool save : {false, true}) {
    Tensor y(o.dt, T * N * K), hl(o.dt, N * K), cl(DType::f32, N * K);
    // The saved gates: per step, K-blocks of B columns, each holding its rows' [i | f | g | o].
    const auto gd = lstm::saved_gate_dims(s, o.dp);
    const int64_t KB = gd[1], B = gd[3] / 4;
    CHECK(gd[0] == T && gd[2] == N && KB == (K + B - 1) / B) << ctx;
    Tensor gates(o.dt, save ? T * KB * N * 4 * B : 0);
    std::vector<float> cs(save ? T * N * K : 0);
    const int64_t width = lstm::saved_width(s, o.dp);
    Tensor xh(o.dt, save ? T * N * width : 0);
    lstm::ForwardArgs fa;
    fa.x = {x.data(), o.dt};
    fa.w = {w.data(), o.w_dt};
    fa.r = {r.data(), o.w_dt};
    fa.bias = b.data();
    fa.c0 = c0.data();
    fa.h0 = {h0.data(), o.dt};
    fa.y = {y.data(), o.dt};
    fa.c_last = cl.f.data();
    fa.h_last = {hl.data(), o.dt};
    if (save) fa.saved = {{gates.data(), o.dt}, cs.data(), {xh.data(), o.dt}};
    fa.last_step = o.row_steps ? p.last.data() : nullptr;
    lstm::forward(ex, o.dp, s, fa, o.force);
    std::vector<double> y_ref(T * N * K);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t q = 0; q < K; ++q) y_ref[p.row(t, n) * K + q] = ref.y[(t * N + n) * K + q];
    close(y, y_ref, tol, save ? "y(train)" : "y", ctx);
    close(hl, ref.hl, tol, "h_T", ctx);
    close(cl, ref.cl, tol, "c_T", ctx);
    if (!save) continue;
    Tensor saved(o.dt, T * N * G);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t q = 0; q < G; ++q)
          saved.set((t * N + n) * G + q, gates.get(((t * KB + q % K / B) * N + n) * 4 * B + q / K * B + q % K % B));
    close(saved, ref.gates, tol, "saved gates", ctx);

    const int64_t da_w = lstm::da_width(s);
    CHECK(da_w >= G) << ctx;
    Tensor da(o.dt, T * N * da_w), dh0(o.dt, N * K), dc0(DType::f32, N * K), db(DType::f32, G);
    lstm::BpttArgs ba;
    ba.r = {r.data(), o.w_dt};
    ba.gates = {gates.data(), o.dt};
    ba.cs = cs.data();
    ba.c0 = c0.data();
    ba.dy = {dy.data(), o.dt};
    ba.dc_last = o.no_carry_grads ? nullptr : dcl.data();
    ba.dh_last = {o.no_carry_grads ? nullptr : dhl.data(), o.dt};
    ba.last_step = o.row_steps ? p.last.data() : nullptr;
    ba.da = {da.data(), o.dt};
    ba.db = db.f.data();
    ba.dc0 = dc0.f.data();
    ba.dh0 = {dh0.data(), o.dt};
    lstm::bptt(ex, o.dp, s, ba, o.force);
    const double gtol = bf16 ? 5e-2 : 5e-4;
    close(db, ref.db, gtol, "db", ctx);
    close(dc0, ref.dc0, gtol, "dc0", ctx);
    close(dh0, ref.dh0, gtol, "dh0", ctx);
    // The saved xh is [x_t | h_{t-1} | 0] in x's row order, exactly.
    CHECK(width >= C + K) << ctx;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t q = 0; q < width; ++q) {
          const float want = q < C ? x.get(p.row(t, n) * C + q)
                             : q >= C + K ? 0.0f
                             : t ? y.get(p.row(t - 1, n) * K + q - C) : h0.get(n * K + q - C);
          const float got = xh.get(p.row(t, n) * width + q);
          if (got != want) {
            CHECK(got == want) << "xh(t=" << t << ", n=" << n << ", " << q << ") " << got << " vs " << want << " " << ctx;
            return;
          }
        }
    // The rest of the backward: the FC passes over all steps at once, the update over xh.
    const jb::fc::Shape fx{T * N, C, G, o.dt, jb::Activation::none, 0, da_w};
    const jb::fc::Shape fxh{T * N, C + K, G, o.dt, jb::Activation::none, width, da_w};
    Tensor dx(o.dt, T * N * C), dwr(o.w_dt, (C + K) * G), dw(o.w_dt, C * G), dr(o.w_dt, K * G);
    jb::fc::backward(ex, o.dp, fx, da.data(), w.data(), o.w_dt, dx.data());
    jb::fc::update(ex, o.dp, fxh, xh.data(), da.data(), dwr.data(), o.w_dt, nullptr);
    for (int64_t i = 0; i < C * G; ++i) dw.set(i, dwr.get(i));
    for (int64_t i = 0; i < K * G; ++i) dr.set(i, dwr.get(C * G + i));
    std::vector<double> dx_ref(T * N * C);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t q = 0; q < C; ++q) dx_ref[p.row(t, n) * C + q] = ref.dx[(t * N + n) * C + q];
    close(dx, dx_ref, gtol, "dx", ctx);
    close(dw, ref.dw, gtol, "dW", ctx);
    close(dr, ref.dr, gtol, "dR", ctx);
  }
}

}  // namespace

TEST(lstm_reference_gradients_match_finite_differences) {
  // The double reference's reverse mode against central differences of its forward, for a
  // loss sum(y * dy) + sum(c_T * dc) + sum(h_T * dh), with the final carry and with each
  // row's own last step.
  for (bool steps : {false, true}) {
    Problem p = make_problem(3, 3, 3, 2, true, 7);
    if (steps) p.last = row_steps(3, 3);
    auto id = [](double v) { return v; };
    auto loss = [&](const Problem& q) {
      const Ref o = reference(q, id);
      double l = 0;
      for (size_t i = 0; i < o.y.size(); ++i) l += o.y[i] * q.dy[i];
      for (size_t i = 0; i < o.cl.size(); ++i) l += o.cl[i] * q.dcl[i] + o.hl[i] * q.dhl[i];
      return l;
    };
    const Ref g = reference(p, id);
    const double eps = 1e-6;
    auto check = [&](std::vector<double> Problem::*field, const std::vector<double>& grad, const char* what) {
      for (size_t i = 0; i < grad.size(); ++i) {
        Problem a = p, b = p;
        (a.*field)[i] += eps;
        (b.*field)[i] -= eps;
        const double fd = (loss(a) - loss(b)) / (2 * eps);
        CHECK(std::fabs(fd - grad[i]) < 1e-6 * (1 + std::fabs(fd))) << what << "[" << i << "] " << grad[i] << " vs " << fd;
      }
    };
    check(&Problem::x, g.dx, "dx");
    check(&Problem::w, g.dw, "dw");
    check(&Problem::r, g.dr, "dr");
    check(&Problem::b, g.db, "db");
    check(&Problem::c0, g.dc0, "dc0");
    check(&Problem::h0, g.dh0, "dh0");
  }
}

TEST(lstm_fp32_shapes_and_layouts) {
  const std::array<int64_t, 4> shapes[] = {{1, 1, 1, 1}, {3, 5, 7, 9}, {4, 13, 37, 33}, {2, 30, 64, 70},
                                           {5, 3, 20, 1}, {1, 25, 1, 40}, {3, 17, 100, 48}};
  for (const auto& sh : shapes)
    for (bool tm : {false, true}) run_case(sh[0], sh[1], sh[2], sh[3], tm, Opts{});
}

TEST(lstm_da_rows_padded_away_from_a_4k_period) {
  // 4K = 1024 fp32 or 2048 bf16 values: 4 KiB rows, which bptt pads (the fc passes after it
  // read the first 4K columns in place).
  CHECK(lstm::da_width({2, 5, 3, 256, DType::f32, false}) > 4 * 256);
  CHECK(lstm::da_width({2, 5, 3, 512, DType::bf16, true}) > 4 * 512);
  CHECK(lstm::da_width({2, 5, 3, 100, DType::f32, false}) == 4 * 100);
  run_case(2, 5, 3, 256, false, Opts{});
  run_case(3, 4, 3, 256, true, Opts{});
  Opts o;
  o.dt = DType::bf16;
  for (const char* mode : {"dot", "fp32"}) {
    o.dp = jb::make_dispatch(jb::best_isa(), mode);
    run_case(2, 3, 5, 512, false, o);
  }
}

TEST(lstm_bf16_both_multiply_paths) {
  for (const char* mode : {"dot", "fp32"}) {
    Opts o;
    o.dt = DType::bf16;
    o.dp = jb::make_dispatch(jb::best_isa(), mode);
    run_case(4, 13, 37, 33, false, o);
    run_case(2, 7, 64, 20, true, o);
    o.w_dt = DType::bf16;
    run_case(3, 12, 16, 32, false, o);
  }
}

// A forced blocking over 1 and 3 threads, fp32 and bf16 (shape {T, N, C, K} each).
void run_forced(const jb::Blocking& bl, std::array<int64_t, 4> f32, std::array<int64_t, 4> bf16) {
  for (int64_t threads : {1, 3}) {
    Opts o;
    o.force = &bl;
    o.threads = threads;
    run_case(f32[0], f32[1], f32[2], f32[3], threads == 1, o);
    o.dt = DType::bf16;
    run_case(bf16[0], bf16[1], bf16[2], bf16[3], threads != 1, o);
  }
}

TEST(lstm_forced_small_blocks_and_threads) {
  for (const jb::Blocking& bl : {jb::Blocking{5, 7, 0}, jb::Blocking{1, 1, 0}, jb::Blocking{12, 16, 0}})
    run_forced(bl, {3, 11, 9, 19}, {2, 11, 9, 19});
}

TEST(lstm_wide_k_blocks) {
  // K-blocks of up to 128 columns (several register tiles, an edge block of 2), reduction
  // blocks straddling W and R (staged).
  for (const jb::Blocking& bl : {jb::Blocking{12, 128, 0}, jb::Blocking{5, 96, 0}, jb::Blocking{24, 64, 0}})
    run_forced(bl, {2, 9, 150, 130}, {2, 9, 151, 130});
  // The default blocking takes wide fp32 K-blocks when the four gate panels fit.
  const lstm::Shape small{50, 168, 256, 256, DType::f32, false};
  CHECK(lstm::step_blocking(small, 2, jb::dispatch()).cols == 128);
  const lstm::Shape mid{50, 168, 512, 512, DType::f32, false};
  CHECK(lstm::step_blocking(mid, 2, jb::dispatch()).cols == 64);
  const lstm::Shape big{50, 168, 1024, 1024, DType::f32, false};
  CHECK(lstm::step_blocking(big, 2, jb::dispatch()).cols == 32);
}

TEST(lstm_every_isa) {
  for (jb::Isa isa : {jb::Isa::generic, jb::Isa::avx2, jb::Isa::avx512, jb::Isa::amx}) {
    if (isa > jb::best_isa()) continue;
    for (DType dt : {DType::f32, DType::bf16}) {
      Opts o;
      o.dt = dt;
      o.dp = jb::make_dispatch(isa, "");
      run_case(3, 14, 23, 35, false, o);
    }
  }
}

// fp32 from 1, 3 and 6 bf16 products, h_t and da_t split where the steps make them: every
// ISA up to the host's and both bf16 multiply paths, and reduction blocks straddling W and R.
TEST(lstm_emulated_products) {
  for (jb::Isa isa : {jb::Isa::generic, jb::Isa::avx2, jb::Isa::avx512, jb::Isa::amx}) {
    if (isa > jb::best_isa()) continue;
    for (const char* mode : {"dot", "fp32"})
      for (int64_t products : {1, 3, 6}) {
        Opts o;
        o.dp = jb::make_dispatch(isa, mode);
        o.products = products;
        run_case(3, 13, 37, 33, products == 3, o);
      }
  }
  const jb::Blocking bl{5, 96, 0};
  Opts o;
  o.force = &bl;
  o.products = 3;
  o.row_steps = true;
  run_case(2, 9, 150, 130, true, o);
}

TEST(lstm_bptt_without_final_carry_gradients) {
  for (DType dt : {DType::f32, DType::bf16}) {
    Opts o;
    o.dt = dt;
    o.no_carry_grads = true;
    run_case(3, 13, 9, 37, false, o);
    run_case(1, 2, 3, 5, true, o);
  }
}

TEST(lstm_saved_gate_blocks_pad_little) {
  // The saved gates' K-blocks: at most the widest K-block, one block (no padding) for small
  // K, and under 16 columns of padding per block.
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t k = 1; k <= 700; ++k) {
      const int64_t b = lstm::gate_block({2, 5, 3, k, dt, false}, jb::dispatch());
      const int64_t padded = (k + b - 1) / b * b;
      CHECK(b >= 1 && b <= 128) << "k " << k << " block " << b;
      CHECK(padded - k < 16 * ((k + b - 1) / b)) << "k " << k << " block " << b;
      if (k <= 32) CHECK(b == k) << "k " << k << " block " << b;
    }
}

TEST(lstm_empty_sequence_passes_the_carry) {
  TestPool pool;
  const jb::Executor ex = pool.executor(2);
  const lstm::Shape s{0, 3, 4, 5, DType::f32, false};
  std::vector<float> w(4 * 20), r(5 * 20), b(20), c0(15, 0.5f), h0(15, -0.25f), cl(15), hl(15);
  lstm::ForwardArgs a;
  a.w = {w.data(), DType::f32};
  a.r = {r.data(), DType::f32};
  a.bias = b.data();
  a.c0 = c0.data();
  a.h0 = {h0.data(), DType::f32};
  a.c_last = cl.data();
  a.h_last = {hl.data(), DType::f32};
  lstm::forward(ex, jb::dispatch(), s, a);
  for (int i = 0; i < 15; ++i) CHECK(cl[i] == 0.5f && hl[i] == -0.25f) << i;
}

TEST(lstm_rejects_inconsistent_dtypes) {
  TestPool pool;
  const jb::Executor ex = pool.executor(1);
  const lstm::Shape s{2, 3, 4, 5, DType::bf16, false};
  std::vector<float> w(4 * 20), r(5 * 20), b(20), c0(15), cl(15), x(2 * 3 * 4), h(15), y(2 * 15);
  lstm::ForwardArgs a;
  a.x = {x.data(), DType::f32};  // not the compute dtype
  a.w = {w.data(), DType::f32};
  a.r = {r.data(), DType::f32};
  a.bias = b.data();
  a.c0 = c0.data();
  a.h0 = {h.data(), DType::bf16};
  a.y = {y.data(), DType::bf16};
  a.c_last = cl.data();
  a.h_last = {h.data(), DType::bf16};
  bool threw = false;
  try {
    lstm::forward(ex, jb::dispatch(), s, a);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw) << "x in fp32 with a bf16 compute dtype";
  a.x.dt = DType::bf16;
  a.r.dt = DType::bf16;  // w and r differ
  threw = false;
  try {
    lstm::forward(ex, jb::dispatch(), s, a);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw) << "w and r in different dtypes";
}

TEST(lstm_each_rows_own_last_step) {
  // The carry after each row's own step (variable-length sequences padded to T) out of the
  // forward, with and without saves, and its gradients into bptt at those steps.
  for (DType dt : {DType::f32, DType::bf16}) {
    Opts o;
    o.dt = dt;
    o.row_steps = true;
    run_case(4, 13, 9, 37, false, o);
    run_case(5, 3, 20, 33, true, o);
    run_case(1, 2, 3, 5, false, o);
    o.no_carry_grads = true;
    run_case(3, 7, 5, 6, true, o);
  }
  for (const jb::Blocking& bl : {jb::Blocking{5, 7, 0}, jb::Blocking{1, 1, 0}})
    for (int64_t threads : {1, 3}) {
      Opts o;
      o.force = &bl;
      o.threads = threads;
      o.row_steps = true;
      run_case(3, 11, 9, 19, threads == 1, o);
    }
}

TEST(lstm_rejects_a_last_step_outside_the_sequence) {
  TestPool pool;
  const jb::Executor ex = pool.executor(1);
  const lstm::Shape s{2, 3, 4, 5, DType::f32, false};
  std::vector<float> w(4 * 20), r(5 * 20), b(20), c0(15), cl(15), x(2 * 3 * 4), h(15), y(2 * 15), dy(2 * 15),
      gates(2 * 3 * 20 * 4), cs(2 * 15), da(2 * 3 * 20), db(20), dc0(15), dh0(15);
  lstm::ForwardArgs a;
  a.x = {x.data(), DType::f32};
  a.w = {w.data(), DType::f32};
  a.r = {r.data(), DType::f32};
  a.bias = b.data();
  a.c0 = c0.data();
  a.h0 = {h.data(), DType::f32};
  a.y = {y.data(), DType::f32};
  a.c_last = cl.data();
  a.h_last = {h.data(), DType::f32};
  lstm::BpttArgs g;
  g.r = {r.data(), DType::f32};
  g.gates = {gates.data(), DType::f32};
  g.cs = cs.data();
  g.c0 = c0.data();
  g.dy = {dy.data(), DType::f32};
  g.da = {da.data(), DType::f32};
  g.db = db.data();
  g.dc0 = dc0.data();
  g.dh0 = {dh0.data(), DType::f32};
  for (const std::vector<int32_t>& last : {std::vector<int32_t>{0, 2, 1}, std::vector<int32_t>{-1, 0, 1}}) {
    a.last_step = g.last_step = last.data();
    for (int pass = 0; pass < 2; ++pass) {
      bool threw = false;
      try {
        if (pass == 0) lstm::forward(ex, jb::dispatch(), s, a);
        else lstm::bptt(ex, jb::dispatch(), s, g);
      } catch (const std::invalid_argument&) {
        threw = true;
      }
      CHECK(threw) << (pass ? "bptt" : "forward") << " with last_step " << last[0] << ", " << last[1] << ", " << last[2];
    }
  }
}
