// The LSTM's tangent pass (forward mode) against a naive double-precision LSTM carrying
// tangents (dual numbers): every step's th, the final carry's tangent (or each row's after
// its own last step), for both layouts, fp32 and bf16 (both multiply paths), emulated
// products, odd sizes and sizes of 1, forced small and wide blockings over one thread and
// several, every ISA this CPU runs, the incoming pre-activation tangent in zero, one or two
// pieces and the bias tangent shared or per row. The pass reads the layer's own forward
// saves. The naive tangent is checked against central differences once.
#include <array>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <stdexcept>
#include <vector>

#include "check.h"
#include "fixtures.h"
#include "layers/lstm/lstm.h"

namespace {

using jbtest::Tensor, jbtest::TestPool;
using jb::DType;
namespace lstm = jb::lstm;
using Vec = std::vector<double>;

bool near(const Tensor& got, const Vec& want, double tol, const char* what, const char* ctx) {
  double scale = 0;
  for (double v : want) scale = std::max(scale, std::fabs(v));
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = got.get(i);
    if (!(std::fabs(g - want[i]) <= tol * (0.5 * scale + std::fabs(want[i])) + 1e-6) && bad++ < 3)
      CHECK(false) << ctx << " " << what << "[" << i << "] = " << g << ", want " << want[i];
  }
  return bad == 0;
}

double sig(double v) { return 1 / (1 + std::exp(-v)); }

// The operands (x and every per-step array in (t, n, .) order here) and their tangents.
struct Lstm {
  int64_t t, n, c, k;
  Vec x, w, r, b, c0, h0;
  std::vector<int32_t> last;  // empty: T-1 for every row
  int64_t step_of(int64_t nn) const { return last.empty() ? t - 1 : last[nn]; }
};
struct Tangents {
  Vec x, w, r, b, c0, h0;  // b: (4K) or, per_row, (N, 4K)
  bool per_row = false;
};
struct Out {
  Vec y, cl, hl, ty, tcl, thl;  // y, ty in (t, n, k)
};

// The LSTM and its tangent together; `round` rounds h and th before they multiply R (the
// bf16 multiply path rounds them).
Out dual(const Lstm& p, const Tangents& d, const std::function<double(double)>& round) {
  const int64_t T = p.t, N = p.n, C = p.c, K = p.k, G = 4 * K;
  Out o;
  o.y.assign(T * N * K, 0), o.ty.assign(T * N * K, 0);
  o.cl = p.c0, o.hl = p.h0, o.tcl = d.c0, o.thl = d.h0;
  Vec c = p.c0, h = p.h0, tc = d.c0, th = d.h0, a(G), ta(G);
  for (int64_t t = 0; t < T; ++t) {
    Vec hn(N * K), thn(N * K);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t j = 0; j < G; ++j) {
        double v = p.b[j], tv = d.b[(d.per_row ? n * G : 0) + j];
        for (int64_t q = 0; q < C; ++q) {
          const double xv = p.x[(t * N + n) * C + q];
          v += xv * p.w[q * G + j];
          tv += d.x[(t * N + n) * C + q] * p.w[q * G + j] + xv * d.w[q * G + j];
        }
        for (int64_t q = 0; q < K; ++q) {
          v += round(h[n * K + q]) * p.r[q * G + j];
          tv += round(th[n * K + q]) * p.r[q * G + j] + round(h[n * K + q]) * d.r[q * G + j];
        }
        a[j] = v, ta[j] = tv;
      }
      for (int64_t j = 0; j < K; ++j) {
        const double i = sig(a[j]), f = sig(a[K + j]), g = std::tanh(a[2 * K + j]), og = sig(a[3 * K + j]);
        const double ti = ta[j] * i * (1 - i), tf = ta[K + j] * f * (1 - f), tg = ta[2 * K + j] * (1 - g * g),
                     to = ta[3 * K + j] * og * (1 - og);
        const int64_t at = n * K + j;
        const double cn = f * c[at] + i * g, tcn = tf * c[at] + f * tc[at] + ti * g + i * tg;
        const double tch = std::tanh(cn);
        c[at] = cn, tc[at] = tcn;
        hn[at] = og * tch, thn[at] = to * tch + og * (1 - tch * tch) * tcn;
        o.y[(t * N + n) * K + j] = hn[at], o.ty[(t * N + n) * K + j] = thn[at];
        if (p.step_of(n) == t) o.cl[at] = cn, o.hl[at] = hn[at], o.tcl[at] = tcn, o.thl[at] = thn[at];
      }
    }
    h = hn, th = thn;
  }
  return o;
}

Lstm make(int64_t t, int64_t n, int64_t c, int64_t k, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-1, 1);
  auto fill = [&](int64_t size, double scale) {
    Vec v(static_cast<size_t>(size));
    for (auto& e : v) e = scale * u(rng);
    return v;
  };
  return {t, n, c, k, fill(t * n * c, 1), fill(c * 4 * k, 1 / std::sqrt(double(c))),
          fill(k * 4 * k, 1 / std::sqrt(double(k))), fill(4 * k, 0.5), fill(n * k, 1), fill(n * k, 1), {}};
}

Tangents make_tangents(const Lstm& p, bool per_row, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-0.5, 0.5);
  auto like = [&](const Vec& v) {
    Vec o(v.size());
    for (auto& e : o) e = u(rng);
    return o;
  };
  Tangents d{like(p.x), like(p.w), like(p.r), like(per_row ? Vec(size_t(p.n * 4 * p.k)) : p.b), like(p.c0),
             like(p.h0), per_row};
  return d;
}

struct Opts {
  DType dt = DType::f32;
  DType w_dt = DType::f32;
  int64_t threads = 2;
  const jb::Blocking* force = nullptr;
  jb::Dispatch dp = jb::dispatch();
  int64_t products = 0;
  int pieces = 2;        // the incoming pre-activation tangent in 0, 1 or 2 pieces
  bool row_steps = false;
  bool tb_rows = false;
};

void run_case(int64_t T, int64_t N, int64_t C, int64_t K, bool tm, const Opts& o) {
  char ctx[200];
  std::snprintf(ctx, sizeof ctx, "[T=%ld N=%ld C=%ld K=%ld tm=%d dt=%d w=%d thr=%ld isa=%s mul=%d prod=%ld pieces=%d "
                "steps=%d tb_rows=%d]", long(T), long(N), long(C), long(K), int(tm), int(o.dt), int(o.w_dt),
                long(o.threads), jb::isa_name(o.dp.isa), int(o.dp.bf16_multiply), long(o.products), o.pieces,
                int(o.row_steps), int(o.tb_rows));
  std::mt19937 rng(unsigned(T * 1000 + N * 100 + C * 10 + K));
  Lstm p = make(T, N, C, K, rng);
  Tangents d = make_tangents(p, o.tb_rows, rng);
  if (o.pieces == 0) std::fill(d.x.begin(), d.x.end(), 0.0), std::fill(d.w.begin(), d.w.end(), 0.0),
                     std::fill(d.r.begin(), d.r.end(), 0.0);
  for (int32_t n = 0; n < N && o.row_steps; ++n) p.last.push_back(int32_t(n == 0 ? T - 1 : n == 1 ? 0 : (n * 5 + 2) % T));
  const int64_t G = 4 * K;
  const DType kd = jb::multiply_dtype(o.dt, o.dp);
  auto rnd = [&](double v) { return kd == DType::bf16 ? double(jb::bf16_to_f32(jb::f32_to_bf16(float(v)))) : v; };
  auto row = [&](int64_t t, int64_t n) { return tm ? t * N + n : n * T + t; };
  // The layer's operands; the problem's values become the stored ones.
  Tensor x(o.dt, T * N * C), w(o.w_dt, C * G), r(o.w_dt, K * G), h0(o.dt, N * K), th0(o.dt, N * K);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t q = 0; q < C; ++q) {
        x.set(row(t, n) * C + q, float(p.x[(t * N + n) * C + q]));
        p.x[(t * N + n) * C + q] = x.get(row(t, n) * C + q);
      }
  for (size_t i = 0; i < p.w.size(); ++i) w.set(i, float(p.w[i])), p.w[i] = rnd(w.get(i));
  for (size_t i = 0; i < p.r.size(); ++i) r.set(i, float(p.r[i])), p.r[i] = rnd(r.get(i));
  for (size_t i = 0; i < p.h0.size(); ++i) h0.set(i, float(p.h0[i])), p.h0[i] = h0.get(i);
  for (size_t i = 0; i < d.h0.size(); ++i) th0.set(i, float(d.h0[i])), d.h0[i] = th0.get(i);
  std::vector<float> b(p.b.begin(), p.b.end()), c0(p.c0.begin(), p.c0.end()), tb(d.b.begin(), d.b.end()),
      tc0(d.c0.begin(), d.c0.end());
  for (size_t i = 0; i < b.size(); ++i) p.b[i] = b[i];
  for (size_t i = 0; i < tb.size(); ++i) d.b[i] = tb[i];
  for (size_t i = 0; i < c0.size(); ++i) p.c0[i] = c0[i], d.c0[i] = tc0[i];
  const Out ref = dual(p, d, rnd);

  TestPool pool;
  const jb::Executor ex = pool.executor(o.threads);
  const lstm::Shape s{T, N, C, K, o.dt, tm, o.products};
  // The training forward: the saves the tangent reads.
  const auto gd = lstm::saved_gate_dims(s, o.dp);
  Tensor y(o.dt, T * N * K), hl(o.dt, N * K), cl(DType::f32, N * K), gates(o.dt, gd[0] * gd[1] * gd[2] * gd[3]),
      xh(o.dt, T * N * lstm::saved_width(s, o.dp));
  std::vector<float> cs(size_t(T * N * K));
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
  fa.saved = {{gates.data(), o.dt}, cs.data(), {xh.data(), o.dt}};
  fa.last_step = o.row_steps ? p.last.data() : nullptr;
  lstm::forward(ex, o.dp, s, fa, o.force);

  // The incoming pieces, from the naive values: tx @ W, then x @ tW + h_{t-1} @ tR.
  Tensor tp0(o.dt, T * N * G), tp1(o.dt, T * N * G);
  Vec h = p.h0, hn(N * K);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < G; ++j) {
        double v0 = 0, v1 = 0;
        for (int64_t q = 0; q < C; ++q)
          v0 += d.x[(t * N + n) * C + q] * p.w[q * G + j], v1 += p.x[(t * N + n) * C + q] * d.w[q * G + j];
        for (int64_t q = 0; q < K; ++q)
          v1 += rnd(t ? ref.y[((t - 1) * N + n) * K + q] : p.h0[n * K + q]) * d.r[q * G + j];
        if (o.pieces == 1) v0 += v1;
        tp0.set(row(t, n) * G + j, float(v0));
        tp1.set(row(t, n) * G + j, float(v1));
      }
  Tensor ty(o.dt, T * N * K), thl(o.dt, N * K), tcl(DType::f32, N * K);
  lstm::TangentArgs ta;
  ta.r = {r.data(), o.w_dt};
  ta.gates = {gates.data(), o.dt};
  ta.cs = cs.data();
  ta.c0 = c0.data();
  if (o.pieces >= 1) ta.tp[0] = {tp0.data(), o.dt};
  if (o.pieces == 2) ta.tp[1] = {tp1.data(), o.dt};
  ta.tb = tb.data();
  ta.tb_rows = o.tb_rows;
  ta.tc0 = tc0.data();
  ta.th0 = {th0.data(), o.dt};
  ta.last_step = o.row_steps ? p.last.data() : nullptr;
  ta.ty = {ty.data(), o.dt};
  ta.tc_last = tcl.f.data();
  ta.th_last = {thl.data(), o.dt};
  lstm::tangent(ex, o.dp, s, ta, o.force);

  const double tol = o.dt == DType::bf16 || o.products == 1 ? 4e-2 : 3e-4;
  Vec ty_ref(size_t(T * N * K));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t q = 0; q < K; ++q) ty_ref[row(t, n) * K + q] = ref.ty[(t * N + n) * K + q];
  near(ty, ty_ref, tol, "ty", ctx);
  near(tcl, ref.tcl, tol, "tc_T", ctx);
  near(thl, ref.thl, tol, "th_T", ctx);
}

}  // namespace

TEST(lstm_tangent_reference_matches_central_differences) {
  // The naive dual LSTM's tangent against (f(p + e d) - f(p - e d)) / 2e of its values.
  for (bool steps : {false, true})
    for (bool per_row : {false, true}) {
      std::mt19937 rng(11);
      Lstm p = make(3, 3, 4, 2, rng);
      if (steps) p.last = {2, 0, 1};
      const Tangents d = make_tangents(p, per_row, rng);
      auto id = [](double v) { return v; };
      const Out got = dual(p, d, id);
      const double e = 1e-6;
      auto moved = [&](double sign) {
        Lstm q = p;
        auto add = [&](Vec& v, const Vec& dv) {
          for (size_t i = 0; i < v.size(); ++i) v[i] += sign * e * dv[i];
        };
        add(q.x, d.x), add(q.w, d.w), add(q.r, d.r), add(q.c0, d.c0), add(q.h0, d.h0);
        Tangents none = d;  // the bias tangent per row is a per-row bias: moved in the pre-activation
        Vec zero_b(d.b.size(), 0.0);
        none.b = zero_b;
        Lstm qb = q;
        if (!per_row) add(qb.b, d.b);
        Out o = dual(qb, none, id);
        if (per_row) {  // the per-row bias: rerun with each row's own bias, one row at a time
          for (int64_t n = 0; n < p.n; ++n) {
            Lstm one = q;
            for (int64_t j = 0; j < 4 * p.k; ++j) one.b[j] += sign * e * d.b[n * 4 * p.k + j];
            const Out on = dual(one, none, id);
            for (int64_t t = 0; t < p.t; ++t)
              for (int64_t j = 0; j < p.k; ++j) o.y[(t * p.n + n) * p.k + j] = on.y[(t * p.n + n) * p.k + j];
            for (int64_t j = 0; j < p.k; ++j) o.cl[n * p.k + j] = on.cl[n * p.k + j], o.hl[n * p.k + j] = on.hl[n * p.k + j];
          }
        }
        return o;
      };
      const Out a = moved(1), b = moved(-1);
      auto check = [&](const Vec& va, const Vec& vb, const Vec& t, const char* what) {
        for (size_t i = 0; i < t.size(); ++i) {
          const double fd = (va[i] - vb[i]) / (2 * e);
          CHECK(std::fabs(fd - t[i]) < 1e-6 * (1 + std::fabs(fd))) << what << "[" << i << "] " << t[i] << " vs " << fd;
        }
      };
      check(a.y, b.y, got.ty, "ty");
      check(a.cl, b.cl, got.tcl, "tc_T");
      check(a.hl, b.hl, got.thl, "th_T");
    }
}

TEST(lstm_tangent_shapes_layouts_and_pieces) {
  const std::array<int64_t, 4> shapes[] = {{1, 1, 1, 1}, {3, 5, 7, 9}, {4, 13, 37, 33}, {2, 30, 64, 70},
                                           {5, 3, 20, 1}, {1, 25, 1, 40}};
  for (const auto& sh : shapes)
    for (bool tm : {false, true}) run_case(sh[0], sh[1], sh[2], sh[3], tm, Opts{});
  for (int pieces : {0, 1}) {
    Opts o;
    o.pieces = pieces;
    run_case(3, 5, 7, 9, pieces == 1, o);
  }
  Opts o;
  o.tb_rows = true;
  run_case(4, 13, 9, 37, false, o);
  o.row_steps = true;
  run_case(5, 3, 20, 33, true, o);
  o.tb_rows = false;
  run_case(4, 13, 9, 37, false, o);
  run_case(1, 2, 3, 5, true, o);
}

TEST(lstm_tangent_bf16_both_multiply_paths) {
  for (const char* mode : {"dot", "fp32"}) {
    Opts o;
    o.dt = DType::bf16;
    o.dp = jb::make_dispatch(jb::best_isa(), mode);
    run_case(4, 13, 37, 33, false, o);
    run_case(2, 7, 64, 20, true, o);
    o.w_dt = DType::bf16;
    o.row_steps = true;
    run_case(3, 12, 16, 32, false, o);
  }
}

TEST(lstm_tangent_forced_blocks_threads_and_wide_k_blocks) {
  for (const jb::Blocking& bl : {jb::Blocking{5, 7, 0}, jb::Blocking{1, 1, 0}, jb::Blocking{12, 16, 0},
                                 jb::Blocking{12, 128, 0}, jb::Blocking{5, 96, 0}})
    for (int64_t threads : {1, 3}) {
      Opts o;
      o.force = &bl;
      o.threads = threads;
      o.row_steps = threads == 3;
      run_case(3, 11, 9, 130, threads == 1, o);
      o.dt = DType::bf16;
      run_case(2, 11, 9, 19, threads != 1, o);
    }
}

TEST(lstm_tangent_every_isa_and_emulated_products) {
  for (jb::Isa isa : {jb::Isa::generic, jb::Isa::avx2, jb::Isa::avx512, jb::Isa::amx}) {
    if (isa > jb::best_isa()) continue;
    for (DType dt : {DType::f32, DType::bf16}) {
      Opts o;
      o.dt = dt;
      o.dp = jb::make_dispatch(isa, "");
      run_case(3, 14, 23, 35, false, o);
    }
    for (const char* mode : {"dot", "fp32"})
      for (int64_t products : {1, 3, 6}) {
        Opts o;
        o.dp = jb::make_dispatch(isa, mode);
        o.products = products;
        o.row_steps = products == 6;
        run_case(3, 13, 37, 33, products == 3, o);
      }
  }
}

TEST(lstm_tangent_empty_sequence_and_bad_last_step) {
  TestPool pool;
  const jb::Executor ex = pool.executor(2);
  std::vector<float> r(5 * 20), c0(15), tb(20), tc0(15, 0.5f), th0(15, -0.25f), tcl(15), thl(15);
  lstm::TangentArgs a;
  a.r = {r.data(), DType::f32};
  a.c0 = c0.data();
  a.tb = tb.data();
  a.tc0 = tc0.data();
  a.th0 = {th0.data(), DType::f32};
  a.tc_last = tcl.data();
  a.th_last = {thl.data(), DType::f32};
  lstm::tangent(ex, jb::dispatch(), {0, 3, 4, 5, DType::f32, false}, a);
  for (int i = 0; i < 15; ++i) CHECK(tcl[i] == 0.5f && thl[i] == -0.25f) << i;
  const std::vector<int32_t> last{0, 2, 1};  // step 2 of 2
  a.last_step = last.data();
  bool threw = false;
  try {
    lstm::tangent(ex, jb::dispatch(), {2, 3, 4, 5, DType::f32, false}, a);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw) << "a last step outside the sequence";
}
