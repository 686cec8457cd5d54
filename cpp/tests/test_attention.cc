// The attention layer's forward and backward against plain loops in double precision: fp32
// and bf16, odd and unequal sequence lengths, grouped-query heads, causal masking, bias and
// mask broadcast along any dims, fully masked rows, dropout bits (broadcast over the batch
// and heads, or not), forced small blocks (the online softmax over many chunks, edge
// blocks), split panels, every ISA and both bf16 multiply paths.
#include <algorithm>
#include <array>
#include <cmath>
#include <random>
#include <vector>

#include "check.h"
#include "fixtures.h"
#include "layers/attention/attention.h"
#include "layers/attention/plan.h"

namespace {

using jb::DType;
using jbtest::Tensor;
using jbtest::TestPool;
namespace at = jb::attention;

struct Case {
  int64_t items = 2, t = 5, s = 7, heads = 2, kv = 1, h = 8;
  DType dt = DType::f32;
  bool causal = false;
  std::array<int64_t, 4> bias{};  // dims (B, N, T, S), each 1 or full; all 0: no bias
  std::array<int64_t, 4> mask{};
  bool masked_rows = false;      // some rows of the mask all false
  bool shared_kv = false;        // k and v broadcast over the items
  int64_t threads = 2;
  at::Blocks force{};
  int64_t products = 0;  // fp32 emulated from bf16 products (0: exact)
  std::array<int64_t, 2> keep{};  // dropout bits' (B, N), each 1 or full; {0, 0}: no dropout
  float keep_prob = 0.75f;
};

// |got - want| <= tol * (1 + max |want|), reporting the first few mismatches.
void close(const Tensor& got, const std::vector<double>& want, double tol, const char* what) {
  double scale = 1;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = got.get(i);
    if (!(std::fabs(g - want[i]) <= tol * scale) && bad++ < 3)
      CHECK(false) << what << "[" << i << "] = " << g << ", want " << want[i];
  }
}

// Offsets of a (B, N, T, S)-broadcast operand with dims d, and its element index.
struct Bcast {
  std::array<int64_t, 4> d;
  int64_t index(int64_t b, int64_t n, int64_t i, int64_t j) const {
    auto c = [](int64_t x, int64_t dim) { return dim == 1 ? 0 : x; };
    return ((c(b, d[0]) * d[1] + c(n, d[1])) * d[2] + c(i, d[2])) * d[3] + c(j, d[3]);
  }
  int64_t size() const { return d[0] * d[1] * d[2] * d[3]; }
};

void run(const Case& c, const jb::Dispatch& dp = jb::dispatch()) {
  std::mt19937 rng(unsigned(c.t * 1009 + c.s * 31 + c.h + c.heads));
  TestPool pool;
  const jb::Executor ex = pool.executor(c.threads);
  const int64_t kv_items = c.shared_kv ? 1 : c.items;
  const int64_t qn = c.t * c.heads * c.h, kn = c.s * c.kv * c.h;
  Tensor q(c.dt, c.items * qn), k(c.dt, kv_items * kn), v(c.dt, kv_items * kn), dout(c.dt, c.items * qn);
  q.fill(rng), k.fill(rng), v.fill(rng), dout.fill(rng);
  Tensor tq(c.dt, c.items * qn), tk(c.dt, kv_items * kn), tv(c.dt, kv_items * kn);  // forward-mode tangents
  tq.fill(rng), tk.fill(rng), tv.fill(rng);
  const bool has_bias = c.bias[0] > 0, has_mask = c.mask[0] > 0;
  const Bcast bb{has_bias ? c.bias : std::array<int64_t, 4>{1, 1, 1, 1}};
  const Bcast mb{has_mask ? c.mask : std::array<int64_t, 4>{1, 1, 1, 1}};
  std::vector<float> bias(size_t(bb.size())), tbias(size_t(bb.size()));
  for (auto& x : bias) x = std::uniform_real_distribution<float>(-1, 1)(rng);
  for (auto& x : tbias) x = std::uniform_real_distribution<float>(-1, 1)(rng);
  std::vector<uint8_t> mask(size_t(mb.size()));
  for (auto& x : mask) x = rng() % 4 != 0;
  if (c.masked_rows && has_mask)  // every row index divisible by 3 fully masked
    for (int64_t b = 0; b < c.mask[0]; ++b)
      for (int64_t n = 0; n < c.mask[1]; ++n)
        for (int64_t i = 0; i < c.mask[2]; i += 3)
          for (int64_t j = 0; j < c.mask[3]; ++j) mask[size_t(mb.index(b, n, i, j))] = 0;

  // The dropout's bits, (kb, kn, T, ceil(S / 8)) bytes, and its factor per element.
  const bool has_keep = c.keep[0] > 0;
  const int64_t row_bytes = (c.s + 7) / 8;
  const std::array<int64_t, 4> kd{has_keep ? c.keep[0] : 1, has_keep ? c.keep[1] : 1, c.t, row_bytes};
  std::vector<uint8_t> keep_bits(size_t(kd[0] * kd[1] * kd[2] * kd[3]));
  for (auto& x : keep_bits) x = uint8_t(rng());
  auto factor = [&](int64_t b, int64_t n, int64_t i, int64_t j) {
    if (!has_keep) return 1.0;
    const int64_t at = ((Bcast{kd}.index(b, n, i, 0)) + j / 8);
    return (keep_bits[size_t(at)] >> (j % 8)) & 1 ? double(1.0f / c.keep_prob) : 0.0;
  };

  at::Shape s;
  s.items = c.items, s.t = c.t, s.s = c.s, s.heads = c.heads, s.kv_heads = c.kv, s.h = c.h, s.dt = c.dt;
  s.scale = 1.0f / std::sqrt(float(c.h)), s.causal = c.causal, s.products = c.products;
  const size_t ni = size_t(c.items);
  std::vector<int64_t> q_offs(ni), k_offs(ni), b_offs(ni), m_offs(ni), keep_offs(ni);
  for (int64_t i = 0; i < c.items; ++i) {
    q_offs[size_t(i)] = i * qn;
    k_offs[size_t(i)] = c.shared_kv ? 0 : i * kn;
    b_offs[size_t(i)] = bb.index(i, 0, 0, 0);
    m_offs[size_t(i)] = mb.index(i, 0, 0, 0);
    keep_offs[size_t(i)] = Bcast{kd}.index(i, 0, 0, 0);
  }
  at::Inputs in;
  in.q = q.data(), in.k = k.data(), in.v = v.data();
  in.q_offs = q_offs.data(), in.k_offs = k_offs.data(), in.v_offs = k_offs.data();
  auto strides = [](at::Broadcast& b, const Bcast& d) {
    b.sn = d.index(0, 1, 0, 0), b.st = d.index(0, 0, 1, 0), b.ss = d.index(0, 0, 0, 1);
  };
  if (has_bias) in.bias.data = bias.data(), in.bias.offs = b_offs.data(), strides(in.bias, bb);
  if (has_mask) in.mask.data = mask.data(), in.mask.offs = m_offs.data(), strides(in.mask, mb);
  if (has_keep) {
    in.keep.data = keep_bits.data(), in.keep.offs = keep_offs.data(), strides(in.keep, Bcast{kd});
    in.keep_scale = 1.0f / c.keep_prob;
  }

  // The reference, in double, from the stored (bf16-rounded) values.
  const int64_t g = c.heads / c.kv;
  std::vector<double> o_ref(size_t(c.items * qn)), dq_ref(size_t(c.items * qn), 0.0);
  std::vector<double> dk_ref(size_t(c.items * kn), 0.0), dv_ref(size_t(c.items * kn), 0.0);
  std::vector<double> db_ref(size_t(c.items * c.heads * c.t * c.s), 0.0), to_ref(size_t(c.items * qn), 0.0);
  std::vector<double> x(size_t(c.s)), p(size_t(c.s)), dpv(size_t(c.s));
  for (int64_t b = 0; b < c.items; ++b)
    for (int64_t n = 0; n < c.heads; ++n)
      for (int64_t i = 0; i < c.t; ++i) {
        const int64_t kh = n / g, kb = (c.shared_kv ? 0 : b) * kn;
        auto qv = [&](int64_t e) { return double(q.f[size_t(b * qn + i * c.heads * c.h + n * c.h + e)]); };
        auto kval = [&](const Tensor& t, int64_t j, int64_t e) {
          return double(t.f[size_t(kb + (j * c.kv + kh) * c.h + e)]);
        };
        double mx = -INFINITY;
        for (int64_t j = 0; j < c.s; ++j) {
          double dot = 0;
          for (int64_t e = 0; e < c.h; ++e) dot += qv(e) * kval(k, j, e);
          double xv = double(float(dot) * s.scale) + (has_bias ? bias[size_t(bb.index(b, n, i, j))] : 0.0);
          const bool keep = (!c.causal || j <= i) && (!has_mask || mask[size_t(mb.index(b, n, i, j))]);
          x[size_t(j)] = keep ? xv : double(at::kMasked);
          mx = std::max(mx, x[size_t(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j < c.s; ++j) sum += p[size_t(j)] = std::exp(x[size_t(j)] - mx);
        double d = 0;
        for (int64_t e = 0; e < c.h; ++e) {
          double o = 0;
          for (int64_t j = 0; j < c.s; ++j) o += p[size_t(j)] / sum * factor(b, n, i, j) * kval(v, j, e);
          o_ref[size_t(b * qn + i * c.heads * c.h + n * c.h + e)] = o;
        }
        const int64_t qi = b * qn + i * c.heads * c.h + n * c.h;
        for (int64_t j = 0; j < c.s; ++j) {
          p[size_t(j)] /= sum;
          double dpj = 0;
          for (int64_t e = 0; e < c.h; ++e) dpj += double(dout.f[size_t(qi + e)]) * kval(v, j, e);
          dpv[size_t(j)] = dpj * factor(b, n, i, j);  // the gradient of P, through the dropout
          d += p[size_t(j)] * dpv[size_t(j)];
        }
        // the tangent: tS = scale (tq k + q tk) + tbias; to = sum Z (tv + tS v) - (sum P tS) O
        double csum = 0;
        std::vector<double> ts(size_t(c.s), 0.0);
        for (int64_t j = 0; j < c.s; ++j) {
          double t = 0;
          for (int64_t e = 0; e < c.h; ++e)
            t += double(tq.f[size_t(qi + e)]) * kval(k, j, e) + qv(e) * kval(tk, j, e);
          const bool keep = (!c.causal || j <= i) && (!has_mask || mask[size_t(mb.index(b, n, i, j))]);
          ts[size_t(j)] = keep ? s.scale * t + (has_bias ? tbias[size_t(bb.index(b, n, i, j))] : 0.0) : 0.0;
          csum += p[size_t(j)] * ts[size_t(j)];
        }
        for (int64_t e = 0; e < c.h; ++e) {
          double t = -csum * o_ref[size_t(qi + e)];
          for (int64_t j = 0; j < c.s; ++j)
            t += p[size_t(j)] * factor(b, n, i, j) * (kval(tv, j, e) + ts[size_t(j)] * kval(v, j, e));
          to_ref[size_t(qi + e)] = t;
        }
        for (int64_t j = 0; j < c.s; ++j) {
          const bool keep = (!c.causal || j <= i) && (!has_mask || mask[size_t(mb.index(b, n, i, j))]);
          const double ds = keep ? p[size_t(j)] * (dpv[size_t(j)] - d) : 0.0;
          db_ref[size_t(((b * c.heads + n) * c.t + i) * c.s + j)] = ds;
          const int64_t kj = b * kn + (j * c.kv + kh) * c.h;
          for (int64_t e = 0; e < c.h; ++e) {
            dq_ref[size_t(qi + e)] += s.scale * ds * kval(k, j, e);
            dk_ref[size_t(kj + e)] += s.scale * ds * qv(e);
            dv_ref[size_t(kj + e)] += p[size_t(j)] * factor(b, n, i, j) * double(dout.f[size_t(qi + e)]);
          }
        }
      }

  const at::Blocks* force = c.force.rows || c.force.keys ? &c.force : nullptr;
  Tensor o(c.dt, c.items * qn);
  std::vector<float> stats(size_t(c.items * c.heads * c.t * 2));
  at::forward(ex, dp, s, in, o.data(), stats.data(), force);
  // One bf16 product is bf16's accuracy, three about 2^-16 of a product, six fp32's.
  const bool bf16 = c.dt == DType::bf16 || c.products == 1;
  const double three = c.products == 3 ? 4 : 1;
  close(o, o_ref, bf16 ? 2e-2 : 2e-5 * three, "o");

  std::vector<int64_t> dense(size_t(c.items)), st_offs(size_t(c.items));
  for (int64_t i = 0; i < c.items; ++i) dense[size_t(i)] = i * qn, st_offs[size_t(i)] = i * c.heads * c.t * 2;
  at::Saved sv;
  sv.o = o.data(), sv.dout = dout.data(), sv.stats = stats.data();
  sv.o_offs = dense.data(), sv.dout_offs = dense.data(), sv.stats_offs = st_offs.data();
  Tensor dq(c.dt, c.items * qn), dk(c.dt, c.items * kn), dv(c.dt, c.items * kn);
  Tensor db(DType::f32, c.items * c.heads * c.t * c.s);
  at::backward(ex, dp, s, in, sv, dq.data(), dk.data(), dv.data(), has_bias ? db.f.data() : nullptr, force);
  const double gt = bf16 ? 4e-2 : 5e-5 * three;
  close(dq, dq_ref, gt, "dq");
  close(dk, dk_ref, gt, "dk");
  close(dv, dv_ref, gt, "dv");
  if (has_bias) close(db, db_ref, gt, "dbias");

  if (c.products) return;  // the tangent pass multiplies exactly only
  at::Tangents tin;
  tin.q = tq.data(), tin.k = tk.data(), tin.v = tv.data();
  tin.q_offs = q_offs.data(), tin.k_offs = k_offs.data(), tin.v_offs = k_offs.data();
  if (has_bias) tin.bias = in.bias, tin.bias.data = tbias.data();
  Tensor to(c.dt, c.items * qn);
  at::tangent(ex, dp, s, in, sv, tin, to.data(), force);
  close(to, to_ref, bf16 ? 6e-2 : 1e-4, "to");
}

}  // namespace

TEST(attention_shapes) {
  for (DType dt : {DType::f32, DType::bf16})
    for (bool causal : {false, true}) {
      for (auto [t, s, h] : {std::array<int64_t, 3>{5, 7, 8}, {1, 1, 1}, {33, 17, 20}, {17, 33, 64},
                             {70, 70, 33}, {130, 129, 16}})
        run({2, t, s, 2, 1, h, dt, causal});
      run({3, 64, 64, 4, 4, 32, dt, causal});
      run({1, 40, 600, 2, 2, 8, dt, causal});  // two chunks of keys
      run({2, 19, 23, 6, 2, 24, dt, causal, {}, {}, false, true});  // k and v shared by the items
    }
}

TEST(attention_forced_blocks) {
  // Many query blocks and key chunks: the forward's rescaling, edge blocks, the causal skip.
  for (DType dt : {DType::f32, DType::bf16})
    for (bool causal : {false, true})
      for (at::Blocks b : {at::Blocks{7, 16}, at::Blocks{16, 32}, at::Blocks{1, 1}, at::Blocks{64, 48}}) {
        Case c{2, 45, 77, 3, 1, 12, dt, causal};
        c.force = b;
        run(c);
      }
}

TEST(attention_bias_and_mask) {
  const std::array<int64_t, 4> full{2, 4, 9, 13};
  const std::array<int64_t, 4> kinds[] = {full, {1, 1, 9, 13}, {2, 1, 1, 13}, {1, 4, 9, 1}, {1, 1, 1, 1}};
  for (DType dt : {DType::f32, DType::bf16})
    for (const auto& kind : kinds)
      for (bool causal : {false, true}) {
        run({2, 9, 13, 4, 2, 16, dt, causal, kind, {}});
        run({2, 9, 13, 4, 2, 16, dt, causal, {}, kind});
        run({2, 9, 13, 4, 2, 16, dt, causal, kind, kind, true});  // fully masked rows
      }
  Case c{2, 9, 13, 4, 2, 16, DType::f32, false, full, full, true};
  c.force = {4, 1};
  run(c);
}

// Dropout's bits on P: broadcast over the batch and heads (flax's default) or not, with a
// mask, a causal limit, a bias gradient, over several chunks and query blocks, on every ISA.
TEST(attention_dropout) {
  for (jb::Isa isa : {jb::Isa::generic, jb::Isa::avx2, jb::Isa::avx512, jb::Isa::amx}) {
    if (isa > jb::best_isa()) continue;
    const jb::Dispatch dp = jb::make_dispatch(isa, "dot");
    for (DType dt : {DType::f32, DType::bf16})
      for (std::array<int64_t, 2> keep : {std::array<int64_t, 2>{1, 1}, {2, 4}, {1, 4}}) {
        Case c{2, 21, 45, 4, 2, 16, dt, false, {2, 4, 21, 45}, {}};
        c.keep = keep;
        run(c, dp);
        c.causal = true, c.bias = {}, c.mask = {1, 4, 21, 45}, c.force = {8, 16}, c.keep_prob = 0.5f;
        run(c, dp);
        Case e{1, 70, 600, 2, 1, 33, dt, true};  // two chunks of keys, S not a multiple of 8
        e.keep = keep, e.keep_prob = 0.9f;
        run(e, dp);
      }
    Case f{2, 37, 70, 4, 2, 20, DType::f32, true, {2, 1, 37, 70}, {}};  // emulated products
    f.force = {16, 32}, f.products = 3, f.keep = {2, 1};
    run(f, dp);
  }
}

TEST(attention_split_panels) {
  // One (item, kv head) panel and more threads than blocks can share: the backward's dK and
  // dV come from per-item parts, summed.
  for (DType dt : {DType::f32, DType::bf16}) {
    Case c{1, 50, 31, 2, 1, 16, dt, true};
    c.threads = 4;
    c.force = {8, 16};
    run(c);
    c.causal = false, c.threads = 3;
    run(c);
  }
}

TEST(attention_every_isa_and_bf16_path) {
  for (jb::Isa isa : {jb::Isa::generic, jb::Isa::avx2, jb::Isa::avx512, jb::Isa::amx}) {
    if (isa > jb::best_isa()) continue;
    for (const char* mode : {"dot", "fp32"}) {
      const jb::Dispatch dp = jb::make_dispatch(isa, mode);
      for (DType dt : {DType::f32, DType::bf16}) {
        run({2, 33, 40, 4, 2, 20, dt, true, {2, 1, 33, 40}, {}}, dp);
        Case c{2, 33, 40, 4, 2, 64, dt, false, {}, {1, 4, 33, 40}, true};
        c.force = {16, 16};
        run(c, dp);
      }
    }
  }
}

// fp32 from 1, 3 and 6 bf16 products: P and dS split where they are made, over several
// key chunks and query blocks (the online softmax's rescaling), a causal mask and a bias.
TEST(attention_emulated_products) {
  for (jb::Isa isa : {jb::Isa::generic, jb::Isa::avx2, jb::Isa::avx512, jb::Isa::amx}) {
    if (isa > jb::best_isa()) continue;
    for (const char* mode : {"dot", "fp32"}) {
      const jb::Dispatch dp = jb::make_dispatch(isa, mode);
      for (int64_t products : {1, 3, 6}) {
        Case c{2, 37, 70, 4, 2, 20, DType::f32, true, {2, 1, 37, 70}, {}};
        c.force = {16, 32}, c.products = products;
        run(c, dp);
        Case d{1, 9, 5, 2, 1, 33, DType::f32, false, {}, {1, 2, 9, 5}, true};
        d.products = products;
        run(d, dp);
      }
    }
  }
}

TEST(attention_nan_propagates) {
  TestPool pool;
  const jb::Executor ex = pool.executor(2);
  at::Shape s;
  s.items = 1, s.t = 3, s.s = 4, s.heads = 1, s.kv_heads = 1, s.h = 2, s.scale = 1.0f;
  std::vector<float> q(6, 0.5f), k(8, 0.25f), v(8, 1.0f), o(6), stats(6);
  q[2] = NAN;  // query row 1
  const int64_t zero = 0;
  at::Inputs in;
  in.q = q.data(), in.k = k.data(), in.v = v.data(), in.q_offs = in.k_offs = in.v_offs = &zero;
  at::forward(ex, jb::dispatch(), s, in, o.data(), stats.data());
  for (int j = 0; j < 2; ++j) {
    CHECK(std::isnan(o[2 + j])) << "row 1";
    CHECK(o[j] == 1.0f && o[4 + j] == 1.0f) << o[j] << " " << o[4 + j];
  }
}

TEST(attention_rejects_bad_sizes) {
  TestPool pool;
  at::Shape s;
  s.items = 1, s.t = 2, s.s = 2, s.heads = 3, s.kv_heads = 2, s.h = 4;
  bool threw = false;
  try {
    at::forward(pool.executor(1), jb::dispatch(), s, at::Inputs{}, nullptr, nullptr);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  s.heads = 2, s.dt = DType::bf16, s.products = 3;  // emulation takes fp32 operands
  threw = false;
  try {
    at::forward(pool.executor(1), jb::dispatch(), s, at::Inputs{}, nullptr, nullptr);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
}
