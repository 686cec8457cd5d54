// Every ISA variant and batch kind of the BRGEMM kernel against a naive triple loop.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <vector>

#include "brgemm/brgemm.h"
#include "amx_model.h"
#include "check.h"
#include "fixtures.h"
#include "layers/batch_reduce.h"

namespace {

using namespace jb;

std::vector<Isa> isas() {
  std::vector<Isa> out{Isa::generic};
  for (Isa isa : {Isa::avx2, Isa::avx512, Isa::amx})
    if (isa <= best_isa()) out.push_back(isa);
  return out;
}

// A kernel under test: an ISA's own, or the AMX driver on the tile model (any host), which
// takes the cases the AMX ISA sends to its tiles: bf16 operands, even k.
struct Target {
  Isa isa;
  BrgemmFn model = nullptr;
  const char* name() const { return model ? "amx-model" : isa_name(isa); }
  bool takes(DType ab, int64_t k) const { return !model || (ab == DType::bf16 && k % 2 == 0); }
  Brgemm kernel(const BrgemmDesc& d) const { return model ? Brgemm(d, isa, model) : Brgemm(d, isa); }
};

std::vector<Target> targets() {
  std::vector<Target> out;
  for (Isa isa : isas()) out.push_back({isa});
  out.push_back({Isa::amx, jbtest::amx_model_kernel()});
  return out;
}

double ref_act(Activation act, double x) {
  switch (act) {
    case Activation::relu: return x < 0 ? 0 : x;
    case Activation::sigmoid: return 1 / (1 + std::exp(-x));
    case Activation::tanh: return std::tanh(x);
    case Activation::gelu: return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
    default: return x;
  }
}

enum class Kind { address, stride, offset, static_offset };

struct Case {
  int64_t batch, m, n, k;
  DType ab, c;
  bool accumulate, bias;
  Activation act;
  Kind kind;
};

// Operands live in one buffer per side, B_i / A_i spaced with a gap so that strides,
// offsets and addresses all differ from the packed case; leading dims exceed the sizes.
void run_case(const Target& target, const Case& t, std::mt19937& rng) {
  if (!target.takes(t.ab, t.k)) return;
  const char* isa = target.name();
  std::normal_distribution<float> dist(0.f, 1.f);
  const bool bf16 = t.ab == DType::bf16;
  const int64_t lda = t.k + 3, ldc = t.n + 5;
  const int64_t ldb = bf16 ? 2 * t.n + 4 : t.n + 2;
  const int64_t a_size = t.m * lda + 7, b_rows = bf16 ? (t.k + 1) / 2 : t.k, b_size = b_rows * ldb + 9;
  std::vector<float> a(t.batch * a_size), b(t.batch * t.k * t.n), bias(t.n), c0(t.m * ldc);
  for (auto* v : {&a, &b, &bias, &c0})
    for (float& x : *v) x = bf16 ? bf16_to_f32(f32_to_bf16(dist(rng))) : dist(rng);

  // Operands in the kernel's dtype and layout.
  std::vector<float> a32(a), b32(t.batch * b_size, 0.f);
  std::vector<uint16_t> a16(a.size()), b16(t.batch * b_size, 0);
  for (size_t i = 0; i < a.size(); ++i) a16[i] = f32_to_bf16(a[i]);
  for (int64_t i = 0; i < t.batch; ++i) {
    const float* bi = &b[i * t.k * t.n];
    if (bf16) {
      std::vector<uint16_t> src(t.k * t.n), packed((t.k + 1) / 2 * 2 * t.n);
      for (int64_t j = 0; j < t.k * t.n; ++j) src[j] = f32_to_bf16(bi[j]);
      pack_vnni2(src.data(), t.k, t.n, t.n, packed.data());
      for (int64_t p = 0; p < (t.k + 1) / 2; ++p)
        for (int64_t j = 0; j < 2 * t.n; ++j) b16[i * b_size + p * ldb + j] = packed[p * 2 * t.n + j];
    } else {
      for (int64_t r = 0; r < t.k; ++r)
        for (int64_t j = 0; j < t.n; ++j) b32[i * b_size + r * ldb + j] = bi[r * t.n + j];
    }
  }
  const void* a_base = bf16 ? static_cast<const void*>(a16.data()) : a32.data();
  const void* b_base = bf16 ? static_cast<const void*>(b16.data()) : b32.data();
  const size_t es = dtype_size(t.ab);

  std::vector<double> want(t.m * t.n), mag(t.m * t.n);
  for (int64_t i = 0; i < t.m; ++i)
    for (int64_t j = 0; j < t.n; ++j) {
      double s = t.accumulate ? c0[i * ldc + j] : 0, s_abs = std::fabs(s);
      if (t.accumulate && t.c == DType::bf16) s = bf16_to_f32(f32_to_bf16(float(s)));
      for (int64_t bi = 0; bi < t.batch; ++bi)
        for (int64_t r = 0; r < t.k; ++r) {
          const double p = double(a[bi * a_size + i * lda + r]) * b[bi * t.k * t.n + r * t.n + j];
          s += p;
          s_abs += std::fabs(p);
        }
      if (t.bias) s += bias[j], s_abs += std::fabs(bias[j]);
      want[i * t.n + j] = ref_act(t.act, s);
      mag[i * t.n + j] = s_abs;
    }

  std::vector<float> c32(t.m * ldc, -7.f);
  std::vector<uint16_t> c16(t.m * ldc, f32_to_bf16(-7.f));
  for (int64_t i = 0; i < t.m * ldc; ++i) {
    c32[i] = c0[i];
    c16[i] = f32_to_bf16(c0[i]);
  }
  // Elements beyond n in each row must survive untouched.
  const float sentinel = 1234.5f;
  for (int64_t i = 0; i < t.m; ++i)
    for (int64_t j = t.n; j < ldc; ++j) c32[i * ldc + j] = sentinel, c16[i * ldc + j] = f32_to_bf16(sentinel);
  void* c = t.c == DType::f32 ? static_cast<void*>(c32.data()) : c16.data();

  BrgemmDesc d;
  d.m = t.m, d.n = t.n, d.k = t.k, d.lda = lda, d.ldb = ldb, d.ldc = ldc;
  d.ab = t.ab, d.c = t.c, d.accumulate = t.accumulate, d.bias = t.bias, d.act = t.act;
  std::vector<int64_t> soa(t.batch), sob(t.batch);  // static tables, rotated by one
  for (int64_t i = 0; i < t.batch; ++i) {
    const int64_t j = (i + 1) % t.batch;
    soa[i] = j * a_size, sob[i] = j * b_size;
  }
  if (t.kind == Kind::static_offset) {
    d.static_offs_a = soa.data();
    d.static_offs_b = sob.data();
    d.static_batch = t.batch;
  }
  const Brgemm kernel = target.kernel(d);
  const float* bias_ptr = t.bias ? bias.data() : nullptr;
  const int64_t stride_a = a_size, stride_b = b_size;
  switch (t.kind) {
    case Kind::stride:
      kernel.strided(a_base, stride_a, b_base, stride_b, t.batch, c, bias_ptr);
      break;
    case Kind::offset: {  // reversed order: offsets need not increase
      std::vector<int64_t> oa(t.batch), ob(t.batch);
      for (int64_t i = 0; i < t.batch; ++i) oa[i] = i * stride_a, ob[i] = i * stride_b;
      std::reverse(oa.begin(), oa.end());
      std::reverse(ob.begin(), ob.end());
      kernel.offsets(a_base, oa.data(), b_base, ob.data(), t.batch, c, bias_ptr);
      break;
    }
    case Kind::address: {
      std::vector<const void*> pa(t.batch), pb(t.batch);
      for (int64_t i = 0; i < t.batch; ++i) {
        pa[i] = static_cast<const char*>(a_base) + i * stride_a * es;
        pb[i] = static_cast<const char*>(b_base) + i * stride_b * es;
      }
      kernel.addresses(pa.data(), pb.data(), t.batch, c, bias_ptr);
      break;
    }
    case Kind::static_offset:
      kernel.static_offsets(a_base, b_base, c, bias_ptr);
      break;
  }

  const double rel = (t.c == DType::bf16 ? 1.0 / 128 : 1e-5);
  const double untouched = t.c == DType::f32 ? sentinel : bf16_to_f32(f32_to_bf16(sentinel));
  int errors = 0;
  for (int64_t i = 0; i < t.m; ++i) {
    for (int64_t j = 0; j < ldc; ++j) {
      const double got = t.c == DType::f32 ? c32[i * ldc + j] : bf16_to_f32(c16[i * ldc + j]);
      if (j >= t.n) {
        if (got != untouched && errors++ < 3)
          CHECK(false) << isa << " m=" << t.m << " n=" << t.n << " k=" << t.k
                       << " c=" << int(t.c) << " act=" << int(t.act) << ": wrote past n at ("
                       << i << ", " << j << ")";
        continue;
      }
      const double w = want[i * t.n + j], tol = rel * (mag[i * t.n + j] + 1e-3) + 1e-6;
      if (!(std::fabs(got - w) <= tol) && errors++ < 3)
        CHECK(false) << isa << " batch=" << t.batch << " m=" << t.m << " n=" << t.n
                     << " k=" << t.k << " bf16=" << bf16 << " acc=" << t.accumulate
                     << " kind=" << int(t.kind) << " act=" << int(t.act) << " at (" << i << ", "
                     << j << "): got " << got << " want " << w;
    }
  }
}

TEST(every_isa_kind_dtype_and_shape) {
  std::mt19937 rng(42);
  const int64_t sizes[] = {1, 2, 3, 7, 16, 17, 31, 33, 64, 65};
  int cases = 0;
  for (const Target& isa : targets())
    for (DType ab : {DType::f32, DType::bf16})
      for (int64_t m : sizes)
        for (int64_t n : sizes) {
          // Cycle the remaining parameters over the grid rather than taking their product.
          const int64_t k = sizes[(m * 7 + n * 3 + cases) % 10];
          const Case t{1 + (cases % 4) * 3, m, n, k, ab,
                       (cases % 5 == 4 && ab == DType::bf16) ? DType::bf16 : DType::f32,
                       cases % 3 == 1, cases % 2 == 0, Activation(cases % 5), Kind(cases % 4)};
          run_case(isa, t, rng);
          ++cases;
        }
  CHECK(cases > 0);
}

TEST(large_k_and_batch_keep_accumulating) {
  std::mt19937 rng(7);
  for (const Target& isa : targets())
    for (DType ab : {DType::f32, DType::bf16})
      for (Kind kind : {Kind::address, Kind::stride, Kind::offset, Kind::static_offset})
        run_case(isa, {300, 13, 40, 129, ab, DType::f32, true, true, Activation::none, kind}, rng);
}

TEST(reductions_longer_than_a_chunk) {
  // k above the chunk length (split into k ranges; odd k ends on a bf16 pad pair) and many
  // short batch items (grouped), with every epilogue: chunk sums must add up exactly once.
  std::mt19937 rng(5);
  int i = 0;
  for (const Target& isa : targets())
    for (DType ab : {DType::f32, DType::bf16})
      for (int64_t k : {1025, 2051, 3000}) {
        ++i;
        run_case(isa, {1 + i % 3, 13, 21, k, ab, i % 4 == 0 ? DType::bf16 : DType::f32, i % 2 == 0, i % 3 == 0,
                       Activation(i % 5), Kind(i % 4)}, rng);
      }
}

TEST(long_fp32_reductions_stay_accurate) {
  // 1M products of a nonzero mean into each output: summed in one register chain the
  // rounding error grows with the length (~1e-4 relative here); in chunks it stays ~1e-6.
  const int64_t batch = 256, k = 4096, m = 3, n = 5;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(0.f, 1.f);
  std::vector<float> a(batch * m * k), b(batch * k * n);
  for (float& x : a) x = dist(rng);
  for (float& x : b) x = dist(rng);
  std::vector<double> want(m * n, 0.0);
  for (int64_t l = 0; l < batch; ++l)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t p = 0; p < k; ++p)
        for (int64_t j = 0; j < n; ++j) want[i * n + j] += double(a[(l * m + i) * k + p]) * b[(l * k + p) * n + j];
  for (Isa isa : isas()) {
    BrgemmDesc d;
    d.m = m, d.n = n, d.k = k, d.lda = k, d.ldb = n, d.ldc = n;
    std::vector<float> c(m * n);
    Brgemm(d, isa).strided(a.data(), m * k, b.data(), k * n, batch, c.data());
    for (int64_t e = 0; e < m * n; ++e)
      CHECK(std::abs(c[e] - want[e]) < 1e-5 * want[e]) << isa_name(isa) << " element " << e << ": got " << c[e]
                                                         << " want " << want[e];
  }
}

TEST(tile_edges_and_k_remainders) {
  // Macro-tile edges (16 / 32 row and column boundaries) and k = 32 q + r, where the AMX
  // variant hands the remainder to the vector kernel.
  std::mt19937 rng(11);
  int i = 0;
  for (const Target& isa : targets())
    for (int64_t k : {32, 34, 48, 62, 96, 100})
      for (int64_t m : {1, 15, 16, 17, 32, 33, 50})
        for (int64_t n : {1, 16, 17, 31, 32, 47}) {
          ++i;
          run_case(isa, {1 + i % 3, m, n, k, DType::bf16, i % 4 == 0 ? DType::bf16 : DType::f32,
                         i % 2 == 0, i % 3 == 0, Activation(i % 5), Kind(i % 3)}, rng);
        }
}

// The tile model behind the "amx-model" target refuses what the hardware faults on, so a
// driver change that would fault on an AMX host fails here on any host.
TEST(amx_model_refuses_what_the_tiles_fault_on) {
  using jbtest::AmxModel;
  auto refused = [](auto&& step) {
    try {
      step();
    } catch (const std::logic_error&) {
      return true;
    }
    return false;
  };
  alignas(64) uint16_t buf[16 * 32] = {};
  CHECK(refused([&] { AmxModel::release(), AmxModel::load<4>(buf, 64); })) << "tile used unconfigured";
  TileConfig big = config_for(16, 0, 16, 0);
  big.colsb[6] = 68;
  CHECK(refused([&] { AmxModel::configure(big); })) << "68-byte rows";
  TileConfig odd = config_for(16, 0, 16, 0);
  odd.rows[4] = 15;  // A's rows no longer C's
  AmxModel::configure(odd);
  CHECK(refused([] { AmxModel::dot<0, 4, 6>(); })) << "A rows != C rows";
  AmxModel::configure(config_for(16, 16, 16, 16));
  CHECK(!refused([] { AmxModel::dot<3, 5, 7>(); }));
  AmxModel::release();
}

TEST(nan_propagates) {
  for (Isa isa : isas()) {
    BrgemmDesc d;
    d.m = 2, d.n = 3, d.k = 4, d.lda = 4, d.ldb = 3, d.ldc = 3;
    for (Activation act : {Activation::none, Activation::relu, Activation::sigmoid,
                           Activation::tanh, Activation::gelu}) {
      d.act = act;
      std::vector<float> a(8, 1.f), b(12, 1.f), c(6, 0.f);
      a[1] = NAN;  // row 0 only
      Brgemm(d, isa).strided(a.data(), 0, b.data(), 0, 1, c.data());
      for (int j = 0; j < 3; ++j) {
        CHECK(std::isnan(c[j])) << isa_name(isa) << " act " << int(act);
        CHECK(!std::isnan(c[3 + j])) << isa_name(isa) << " act " << int(act);
      }
    }
  }
}

TEST(activation_extremes_are_finite_and_saturate) {
  for (Isa isa : isas()) {
    BrgemmDesc d;
    d.m = 1, d.n = 4, d.k = 1, d.lda = 1, d.ldb = 4, d.ldc = 4;
    const float b[4] = {-1e30f, -100.f, 100.f, 1e30f};
    const float one = 1.f;
    for (Activation act : {Activation::sigmoid, Activation::tanh, Activation::gelu}) {
      d.act = act;
      float c[4];
      Brgemm(d, isa).strided(&one, 0, b, 0, 1, c);
      for (int j = 0; j < 4; ++j) {
        const double w = ref_act(act, b[j]);
        CHECK(std::fabs(c[j] - w) <= 1e-6 * (1 + std::fabs(w)))
            << isa_name(isa) << " act " << int(act) << " x=" << b[j] << " got " << c[j] << " want " << w;
      }
    }
  }
}

TEST(bad_descriptors_throw) {
  BrgemmDesc d;
  d.m = 4, d.n = 4, d.k = 4, d.lda = 3, d.ldb = 4, d.ldc = 4;
  bool threw = false;
  try {
    Brgemm k(d);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw) << "lda < k accepted";
  d.lda = 4, d.ab = DType::bf16;  // bf16 B needs ldb >= 2n
  threw = false;
  try {
    Brgemm k(d);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw) << "bf16 ldb < 2n accepted";
}

TEST(pack_vnni2_interleaves_pairs_and_pads_odd_k) {
  for (int64_t k : {1, 2, 3, 8, 33})
    for (int64_t n : {1, 15, 16, 17, 32, 33, 70}) {
      const int64_t ld = n + 3;
      std::vector<uint16_t> src(k * ld), dst((k + 1) / 2 * 2 * n + 5, 0xdead);
      for (size_t i = 0; i < src.size(); ++i) src[i] = uint16_t(i * 7 + 1);
      pack_vnni2(src.data(), k, n, ld, dst.data());
      for (int64_t r = 0; r < (k + 1) / 2 * 2; ++r)
        for (int64_t j = 0; j < n; ++j) {
          const uint16_t want = r < k ? src[r * ld + j] : 0;
          CHECK(dst[(r / 2) * 2 * n + 2 * j + r % 2] == want) << "k=" << k << " n=" << n << " r=" << r << " j=" << j;
        }
      for (int i = 0; i < 5; ++i) CHECK(dst[(k + 1) / 2 * 2 * n + i] == 0xdead) << "wrote past the end";
    }
}

TEST(bf16_rounding_is_nearest_even) {
  CHECK(f32_to_bf16(1.0f) == 0x3f80);
  CHECK(f32_to_bf16(bf16_to_f32(0x3f80) + 0x1p-8f) == 0x3f80);  // tie -> even
  CHECK(f32_to_bf16(bf16_to_f32(0x3f81) + 0x1p-8f) == 0x3f82);  // tie -> even (up)
  CHECK(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  CHECK(std::isinf(bf16_to_f32(f32_to_bf16(INFINITY))));
}

// jb.brgemm's op with fp32 from bf16 products: a and every distinct B split by the call,
// each block's batch over the (term, i) pairs; two items sharing one B (broadcast), odd k
// (VNNI padding), edge blocks; held to fp32's rounding of the exact sum of part products.
TEST(batch_reduce_emulated_products) {
  for (Isa isa : {Isa::generic, Isa::avx2, Isa::avx512, Isa::amx}) {
    if (isa > best_isa()) continue;
    for (const char* mode : {"dot", "fp32"})
      for (int64_t products : {1, 3, 6}) {
        const Dispatch dp = make_dispatch(isa, mode);
        const int64_t items = 2, batch = 3, m = 37, k = 19, n = 21;
        std::mt19937 rng(unsigned(products * 5 + int(isa)));
        jbtest::Tensor a(DType::f32, items * batch * m * k), b(DType::f32, batch * k * n);
        a.fill(rng);
        b.fill(rng);
        batch_reduce::Shape s;
        s.items = items, s.batch = batch, s.m = m, s.k = k, s.n = n;
        s.b_matrices = batch, s.products = products, s.a_elements = items * batch * m * k;
        const std::vector<int64_t> oa = {0, batch * m * k}, ob = {0, 0}, oc = {0, 0};
        jbtest::Tensor out(DType::f32, items * m * n);
        jbtest::TestPool pool;
        batch_reduce::run(pool.executor(2), dp, s, a.data(), b.data(), nullptr, out.data(),
                          {oa.data(), ob.data(), oc.data()});
        std::vector<double> want(size_t(items * m * n), 0.0);
        for (int64_t l = 0; l < items; ++l)
          for (int64_t i = 0; i < batch; ++i) {
            const auto part = jbtest::part_products(products, a.f.data() + (l * batch + i) * m * k, k, 1,
                                                    b.f.data() + i * k * n, n, 1, m, k, n);
            for (int64_t e = 0; e < m * n; ++e) want[size_t(l * m * n + e)] += part[size_t(e)];
          }
        jbtest::close(out, want, 1e-5, "emulated brgemm");
      }
  }
}

}  // namespace
