// The convolution layer's passes against naive loops in double precision: every padding
// form (none, symmetric, asymmetric, larger than the filter), strides 1, 2, 3 and mixed,
// 1x1 (the collapsed pointwise path and strided), 3x3, 5x5, 7x7 and non-square filters,
// C = 1 and 3 and channel counts that are multiples of no block, small images (the padded
// copy) and larger ones (border blocks in place), fp32 and bf16 (both multiply paths),
// forced small blockings, one thread and several, every ISA up to the best.
#include <cmath>
#include <cstdint>
#include <functional>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "fixtures.h"
#include "layers/conv/conv.h"

namespace {

using jbtest::act_ref, jbtest::close, jbtest::Tensor, jbtest::TestPool;
using jb::Activation, jb::DType;
namespace conv = jb::conv;

struct Case {
  int64_t n, h, w, c, k, r, s, sh, sw, pt, pb, pl, pr;
  int64_t dh = 1, dw = 1;  // kernel dilation
  int64_t g = 1;           // feature groups
};

std::string name(const Case& c, DType dt) {
  return "n" + std::to_string(c.n) + " " + std::to_string(c.h) + "x" + std::to_string(c.w) + "x" +
         std::to_string(c.c) + " -> " + std::to_string(c.k) + " f" + std::to_string(c.r) + "x" +
         std::to_string(c.s) + " st" + std::to_string(c.sh) + "," + std::to_string(c.sw) + " pad" +
         std::to_string(c.pt) + "," + std::to_string(c.pb) + "," + std::to_string(c.pl) + "," +
         std::to_string(c.pr) + " dil" + std::to_string(c.dh) + "," + std::to_string(c.dw) +
         " g" + std::to_string(c.g) + (dt == DType::bf16 ? " bf16" : " f32");
}

// products: fp32 operands multiplied as that many bf16 products of their parts, held to
// fp32's rounding of the exact sum of those part products (one bf16 product is ~1e-3 from
// the exact result, so a pass that skipped the split, or a term, would fail by far).
void run_case(const Case& cs, DType dt, DType w_dt, Activation act, bool bias, int64_t threads,
              const jb::Blocking* force = nullptr, const jb::Dispatch& dp = jb::dispatch(), int64_t products = 0) {
  const std::string tag = name(cs, dt) + (products ? " products " + std::to_string(products) : "");
  conv::Shape s{cs.n, cs.h, cs.w, cs.c, cs.k, cs.r, cs.s, cs.sh, cs.sw, cs.pt, cs.pb, cs.pl, cs.pr, dt, act};
  s.dil_h = cs.dh, s.dil_w = cs.dw, s.groups = cs.g, s.products = products;
  const int64_t cg = s.cg(), kg = s.kg();  // a group's channels
  const int64_t P = s.p(), Q = s.q();
  std::mt19937 rng(unsigned(cs.n * 7 + cs.h * 131 + cs.c * 17 + cs.k + cs.r * 1000));
  TestPool pool;
  const jb::Executor ex = pool.executor(threads);
  Tensor x(dt, s.n * s.h * s.w * s.c), w(w_dt, s.r * s.s * cg * s.k), dy(dt, s.n * P * Q * s.k);
  x.fill(rng);
  w.fill(rng, 1.0f / std::sqrt(float(s.r * s.s * cg)));
  dy.fill(rng);
  std::vector<float> b(size_t(s.k));
  for (auto& v : b) v = std::uniform_real_distribution<float>(-0.5f, 0.5f)(rng);
  // a x b as the pass multiplies them: a's and b's parts with emulated products
  const auto terms = jbtest::terms_of(products);
  auto mul = [&](float a, float b) -> double {
    if (!products) return double(a) * b;
    double acc = 0;
    for (auto [ta, tb] : terms) acc += jbtest::part(a, ta) * jbtest::part(b, tb);
    return acc;
  };
  auto wv = [&](int64_t i) { return dt == DType::bf16 ? jb::bf16_to_f32(jb::f32_to_bf16(w.f[size_t(i)])) : w.f[size_t(i)]; };
  auto xi = [&](int64_t n, int64_t h, int64_t ww, int64_t c) { return ((n * s.h + h) * s.w + ww) * s.c + c; };
  auto yi = [&](int64_t n, int64_t p, int64_t q, int64_t k) { return ((n * P + p) * Q + q) * s.k + k; };
  // w's row of input channel c (of the group of output channel k)
  auto wi = [&](int64_t r, int64_t t, int64_t c, int64_t k) { return ((r * s.s + t) * cg + c % cg) * s.k + k; };
  // Visits every (output pixel, tap, input pixel) triple with a valid input pixel.
  auto taps = [&](auto&& f) {
    for (int64_t n = 0; n < s.n; ++n)
      for (int64_t p = 0; p < P; ++p)
        for (int64_t q = 0; q < Q; ++q)
          for (int64_t r = 0; r < s.r; ++r)
            for (int64_t t = 0; t < s.s; ++t) {
              const int64_t ih = p * s.sh + r * s.dil_h - s.pt, iw = q * s.sw + t * s.dil_w - s.pl;
              if (ih >= 0 && ih < s.h && iw >= 0 && iw < s.w) f(n, p, q, r, t, ih, iw);
            }
  };

  // forward
  std::vector<double> z_ref(size_t(s.n * P * Q * s.k), 0.0), y_ref(z_ref.size());
  if (bias)
    for (size_t i = 0; i < z_ref.size(); ++i) z_ref[i] = b[i % size_t(s.k)];
  taps([&](int64_t n, int64_t p, int64_t q, int64_t r, int64_t t, int64_t ih, int64_t iw) {
    for (int64_t k = 0; k < s.k; ++k) {
      double acc = 0;
      for (int64_t c = k / kg * cg; c < (k / kg + 1) * cg; ++c)
        acc += mul(x.f[size_t(xi(n, ih, iw, c))], wv(wi(r, t, c, k)));
      z_ref[size_t(yi(n, p, q, k))] += acc;
    }
  });
  for (size_t i = 0; i < z_ref.size(); ++i) y_ref[i] = act_ref(act, z_ref[i]);
  Tensor y(dt, s.n * P * Q * s.k), z(dt, s.n * P * Q * s.k);
  conv::forward(ex, dp, s, x.data(), w.data(), w_dt, bias ? b.data() : nullptr, y.data(),
                act == Activation::gelu ? z.data() : nullptr, force);
  const double tol = dt == DType::bf16 ? 2e-2 : products ? 1e-5 : 1e-4;
  close(y, y_ref, tol, tag + " y");

  // backward by data, from dz = dy (the layer's own act_grad is element-wise, tested by fc)
  std::vector<double> dx_ref(size_t(s.n * s.h * s.w * s.c), 0.0);
  taps([&](int64_t n, int64_t p, int64_t q, int64_t r, int64_t t, int64_t ih, int64_t iw) {
    for (int64_t c = 0; c < s.c; ++c) {
      double acc = 0;
      for (int64_t k = c / cg * kg; k < (c / cg + 1) * kg; ++k)
        acc += mul(dy.f[size_t(yi(n, p, q, k))], wv(wi(r, t, c, k)));
      dx_ref[size_t(xi(n, ih, iw, c))] += acc;
    }
  });
  Tensor dx(dt, s.n * s.h * s.w * s.c);
  for (size_t i = 0; i < dx.f.size(); ++i) dx.set(i, 12345.0f);  // every element must be written
  conv::backward(ex, dp, s, dy.data(), w.data(), w_dt, dx.data(), force);
  close(dx, dx_ref, tol, tag + " dx");

  // weight update
  std::vector<double> dw_ref(size_t(s.r * s.s * cg * s.k), 0.0), db_ref(size_t(s.k), 0.0);
  taps([&](int64_t n, int64_t p, int64_t q, int64_t r, int64_t t, int64_t ih, int64_t iw) {
    for (int64_t c = 0; c < s.c; ++c)
      for (int64_t k = c / cg * kg; k < (c / cg + 1) * kg; ++k)
        dw_ref[size_t(wi(r, t, c, k))] += mul(x.f[size_t(xi(n, ih, iw, c))], dy.f[size_t(yi(n, p, q, k))]);
  });
  for (size_t i = 0; i < dy.f.size(); ++i) db_ref[i % size_t(s.k)] += dy.f[i];
  Tensor dw(w_dt, s.r * s.s * cg * s.k);
  for (size_t i = 0; i < dw.f.size(); ++i) dw.set(i, 12345.0f);
  std::vector<float> db(size_t(s.k), -1.0f);
  conv::update(ex, dp, s, x.data(), dy.data(), dw.data(), w_dt, bias ? db.data() : nullptr, force);
  // dw sums N * P * Q products: scale the tolerance with the reduction length.
  const double red = std::sqrt(double(s.n * P * Q));
  close(dw, dw_ref, (w_dt == DType::bf16 || dt == DType::bf16 ? 2e-2 : tol) * std::max(1.0, red / 4), tag + " dw");
  if (bias) {
    Tensor dbt(DType::f32, s.k);
    dbt.f = db;
    close(dbt, db_ref, 1e-4 * std::max(1.0, red / 4), tag + " db");
  }
}

// n, h, w, c, k, r, s, sh, sw, pt, pb, pl, pr
const Case kCases[] = {
    {2, 7, 9, 3, 5, 3, 3, 1, 1, 1, 1, 1, 1},      // SAME 3x3, C = 3, odd sizes
    {1, 11, 10, 1, 7, 7, 7, 2, 2, 3, 3, 3, 3},    // a 7x7 stride-2 stem, C = 1
    {2, 9, 8, 13, 70, 1, 1, 1, 1, 0, 0, 0, 0},    // pointwise: one collapsed pixel row
    {2, 9, 7, 16, 33, 1, 1, 2, 2, 0, 0, 0, 0},    // 1x1 stride 2 (a projection shortcut)
    {1, 8, 13, 5, 9, 3, 2, 2, 1, 0, 1, 2, 0},     // non-square filter, mixed strides, asymmetric pads
    {2, 6, 6, 70, 40, 3, 3, 2, 2, 0, 1, 0, 1},    // SAME for stride 2 on an even input
    {1, 5, 6, 3, 8, 5, 5, 1, 1, 6, 4, 5, 6},      // padding larger than the filter: rows of zeros
    {1, 7, 8, 2, 3, 1, 1, 3, 3, 0, 0, 0, 0},      // stride > filter: dx pixels no tap reaches
    {1, 3, 3, 4, 6, 3, 3, 1, 1, 0, 0, 0, 0},      // VALID to a single pixel
    {2, 14, 14, 40, 72, 3, 3, 1, 1, 1, 1, 1, 1},  // a small image: the padded copy
    {1, 30, 31, 24, 20, 3, 3, 1, 1, 1, 1, 1, 1},  // a larger one: border blocks in place
    {1, 13, 12, 6, 10, 2, 4, 3, 2, 1, 0, 0, 2},   // 2x4 filter, strides 3 / 2
    {2, 1, 11, 3, 3, 1, 3, 1, 1, 0, 0, 3, 1},     // a left pad beyond the filter's reach (the dual's is < 0)
};

}  // namespace

TEST(conv_all_passes_fp32) {
  for (const Case& c : kCases) run_case(c, DType::f32, DType::f32, Activation::none, true, 2);
}

TEST(conv_all_passes_bf16) {
  for (const Case& c : kCases) run_case(c, DType::bf16, DType::bf16, Activation::relu, true, 2);
  run_case(kCases[0], DType::bf16, DType::f32, Activation::none, false, 2);  // fp32 weights
}

// Kernel dilation: dilated taps in every pass, with strides, borders in place and copied,
// dilations larger than the filter and the input's rows no tap reaches.
const Case kDilated[] = {
    {2, 9, 11, 3, 5, 3, 3, 1, 1, 2, 2, 2, 2, 2, 2},      // SAME-like 3x3 dilation 2
    {1, 12, 13, 6, 7, 3, 3, 2, 2, 3, 3, 3, 3, 3, 3},     // dilation 3 with stride 2
    {1, 8, 16, 5, 4, 2, 3, 1, 1, 0, 1, 0, 0, 3, 2},      // mixed, VALID-ish, asymmetric
    {1, 30, 31, 16, 20, 3, 3, 1, 1, 2, 2, 2, 2, 2, 2},   // a larger image: borders in place
    {2, 5, 7, 4, 3, 3, 2, 1, 2, 0, 0, 0, 0, 2, 5},       // dilation > filter, to one column
    {1, 20, 20, 8, 9, 3, 3, 1, 1, 0, 0, 0, 0, 4, 4},     // VALID dilation 4
};

TEST(conv_kernel_dilation) {
  for (const Case& c : kDilated)
    for (DType dt : {DType::f32, DType::bf16}) run_case(c, dt, dt, Activation::none, true, 2);
  const jb::Blocking bl{5, 16, 4};
  run_case(kDilated[1], DType::f32, DType::f32, Activation::relu, true, 3, &bl);
  run_case(kDilated[3], DType::bf16, DType::bf16, Activation::none, false, 1, &bl);
}

// Feature groups: group widths 1 (depthwise, with and without a channel multiplier), 2, odd
// and wider than a block, with strides, dilation, pointwise, forced blockings.
const Case kGrouped[] = {
    {2, 9, 11, 6, 6, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 6},       // depthwise 3x3
    {1, 12, 13, 8, 16, 5, 5, 2, 2, 2, 2, 2, 2, 1, 1, 8},     // depthwise x2, stride 2
    {2, 7, 9, 12, 18, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 6},      // groups of 2 -> 3
    {1, 10, 10, 15, 10, 3, 3, 1, 2, 2, 2, 2, 2, 2, 2, 5},    // odd widths 3 -> 2, dilated
    {2, 8, 8, 96, 64, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 2},      // pointwise, wide groups
    {1, 30, 31, 32, 32, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 4},    // borders in place
    {1, 14, 14, 160, 80, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 2},   // groups wider than a block
    {2, 9, 10, 300, 300, 3, 3, 2, 1, 2, 0, 1, 3, 2, 1, 300}, // depthwise path: chunk tail, strided, dilated
    {1, 11, 12, 5, 5, 7, 7, 1, 1, 3, 3, 3, 3, 1, 1, 5},      // depthwise 7x7, pads reach every border
    // narrow groups (narrow.cc, pixels in the lanes): ResNeXt's 8 channels, strided (the
    // backward by data stays direct), dilated with a pad beyond the filter's reach (negative
    // pads in the backward's view), odd widths (bf16 stays direct), one row per band
    {2, 12, 20, 64, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 8},
    {1, 11, 40, 16, 24, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, 4},
    {1, 9, 17, 12, 12, 3, 3, 1, 1, 3, 0, 6, 1, 2, 2, 3},
    {1, 8, 16, 9, 15, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 3},
    {3, 2, 9, 16, 16, 1, 3, 1, 1, 0, 0, 1, 1, 1, 1, 2},
    {2, 9, 10, 32, 32, 5, 5, 2, 1, 2, 2, 3, 1, 1, 2, 32},  // depthwise, whole 16-channel blocks
    // depthwise, 8-pixel blocks of the rows' interiors (with pixels left over) and their borders
    {2, 9, 27, 48, 48, 7, 7, 2, 1, 3, 3, 3, 2, 1, 1, 48},
    {1, 6, 21, 32, 32, 5, 5, 1, 1, 2, 2, 1, 3, 1, 1, 32},
    // groups of 8 output channels (fp32 on AVX2: x and dz straight from NHWC in the update):
    // 5 input channels a group (a tile of 4, then 1), 3 + 2 taps a row, strided, dilated
    {1, 10, 19, 10, 16, 3, 5, 2, 1, 2, 0, 4, 1, 1, 2, 2},
};

TEST(conv_feature_groups) {
  for (const Case& c : kGrouped)
    for (DType dt : {DType::f32, DType::bf16}) run_case(c, dt, dt, Activation::none, true, 2);
  const jb::Blocking bl{5, 16, 4};
  run_case(kGrouped[6], DType::f32, DType::f32, Activation::relu, true, 3, &bl);
  run_case(kGrouped[2], DType::bf16, DType::bf16, Activation::none, false, 1, &bl);
  run_case(kGrouped[1], DType::bf16, DType::f32, Activation::gelu, true, 3);
  // the depthwise passes (groups == C == K): every activation, fp32 weights, every ISA
  for (Activation act : {Activation::relu, Activation::gelu, Activation::sigmoid, Activation::tanh})
    run_case(kGrouped[8], DType::f32, DType::f32, act, act != Activation::tanh, 2);
  run_case(kGrouped[7], DType::bf16, DType::f32, Activation::gelu, true, 3);
  // the narrow groups: activations in the epilogue, fp32 weights, both bf16 multiply paths
  run_case(kGrouped[9], DType::f32, DType::f32, Activation::gelu, true, 3);
  run_case(kGrouped[9], DType::bf16, DType::f32, Activation::relu, false, 2);
  for (const char* mode : {"dot", "fp32"})
    run_case(kGrouped[11], DType::bf16, DType::bf16, Activation::sigmoid, true, 2, nullptr,
             jb::make_dispatch(jb::best_isa(), mode));
  for (jb::Isa isa : {jb::Isa::generic, jb::Isa::avx2, jb::Isa::avx512}) {
    if (isa > jb::best_isa()) continue;
    const jb::Dispatch dp = jb::make_dispatch(isa, "");
    for (DType dt : {DType::f32, DType::bf16})
      for (int i : {7, 9, 14, 15, 16, 17}) run_case(kGrouped[i], dt, dt, Activation::relu, true, 2, nullptr, dp);
  }
}

TEST(conv_activations_and_no_bias) {
  for (Activation act : {Activation::relu, Activation::gelu, Activation::sigmoid, Activation::tanh})
    run_case(kCases[4], DType::f32, DType::f32, act, act != Activation::tanh, 1);
  run_case(kCases[2], DType::f32, DType::f32, Activation::relu, false, 3);
}

TEST(conv_forced_small_blocks) {
  // Many pixel blocks (and short edge ones), channel blocks with tails, several reduced
  // blocks per tap, odd bf16 reduction blocks (VNNI pads per block), update blocks of dw
  // with edges; more items than threads.
  const jb::Blocking blockings[] = {{5, 16, 4}, {1, 1, 1}, {12, 32, 5}};
  const Case cases[] = {{2, 7, 9, 20, 35, 3, 3, 1, 1, 1, 1, 1, 1}, {1, 9, 10, 15, 17, 3, 3, 2, 2, 1, 1, 1, 1},
                        {1, 5, 6, 10, 9, 1, 1, 1, 1, 0, 0, 0, 0}};
  for (const auto& bl : blockings)
    for (const Case& c : cases)
      for (DType dt : {DType::f32, DType::bf16}) run_case(c, dt, dt, Activation::none, true, 3, &bl);
}

// fp32 dz rows 1 KiB apart, 64 to a row: the update packs them (they would alias in L1).
TEST(conv_update_packs_aliasing_rows) {
  const Case c{1, 2, 64, 8, 256, 3, 3, 1, 1, 2, 2, 2, 2, 2, 2};  // DeepLab's dilated row, narrowed
  run_case(c, DType::f32, DType::f32, Activation::none, true, 2);
}

TEST(conv_bf16_both_multiply_paths) {
  for (const char* mode : {"dot", "fp32"}) {
    const jb::Dispatch dp = jb::make_dispatch(jb::best_isa(), mode);
    for (int i : {0, 2, 5, 9}) run_case(kCases[i], DType::bf16, DType::f32, Activation::relu, true, 2, nullptr, dp);
  }
}

TEST(conv_every_isa) {
  for (jb::Isa isa : {jb::Isa::generic, jb::Isa::avx2, jb::Isa::avx512, jb::Isa::amx}) {
    if (isa > jb::best_isa()) continue;
    const jb::Dispatch dp = jb::make_dispatch(isa, "");
    for (DType dt : {DType::f32, DType::bf16})
      for (int i : {0, 3, 5, 11}) run_case(kCases[i], dt, dt, Activation::relu, true, 2, nullptr, dp);
  }
}

// fp32 from bf16 products, split by the passes: the direct skeleton and the general update
// for every kind (depthwise, grouped, pointwise, dilated, strided, small images copied with
// their pads), every ISA and both multiply paths, 1, 3 and 6 products, gelu's two outputs,
// forced small blocks (a term's C-blocks, edge tiles, blocks across the terms stacked in a
// narrow group's channels) and the update's batch splits.
TEST(conv_emulated_products) {
  const Case depthwise{2, 9, 10, 6, 6, 3, 3, 1, 2, 1, 1, 1, 1, 1, 1, 6};
  const Case kinds[] = {kCases[0], kCases[2], kCases[3], kCases[9], kCases[11], kDilated[1], kGrouped[17], depthwise};
  int i = 0;
  for (jb::Isa isa : {jb::Isa::generic, jb::Isa::avx2, jb::Isa::avx512, jb::Isa::amx}) {
    if (isa > jb::best_isa()) continue;
    for (const char* mode : {"dot", "fp32"})
      for (int64_t products : {1, 3, 6})
        for (int j = 0; j < 2; ++j, ++i) {
          const Activation act = i % 3 ? Activation::relu : Activation::gelu;
          run_case(kinds[i % 8], DType::f32, DType::f32, act, true, 2, nullptr, jb::make_dispatch(isa, mode), products);
        }
  }
  const jb::Blocking small{5, 16, 4};
  run_case(kCases[5], DType::f32, DType::f32, Activation::none, true, 3, &small, jb::dispatch(), 3);
  run_case(kDilated[3], DType::f32, DType::f32, Activation::none, false, 1, &small, jb::dispatch(), 6);
  const jb::Blocking straddle{5, 16, 9};  // 6 channels x 3 terms stacked: blocks across terms
  run_case(kCases[11], DType::f32, DType::f32, Activation::none, true, 2, &straddle, jb::dispatch(), 3);
}

TEST(conv_empty_batch_and_bad_shapes) {
  TestPool pool;
  const jb::Executor ex = pool.executor(2);
  conv::Shape s{0, 5, 5, 3, 4, 3, 3, 1, 1, 1, 1, 1, 1, DType::f32, Activation::none};
  std::vector<float> dw(3 * 3 * 3 * 4, 7.0f), db(4, 7.0f);
  conv::forward(ex, jb::dispatch(), s, nullptr, dw.data(), DType::f32, nullptr, nullptr, nullptr);
  conv::update(ex, jb::dispatch(), s, nullptr, nullptr, dw.data(), DType::f32, db.data());
  for (float v : dw) CHECK(v == 0.0f);
  for (float v : db) CHECK(v == 0.0f);
  auto throws = [](conv::Shape t) {
    try {
      conv::validate(t);
    } catch (const std::invalid_argument&) {
      return true;
    }
    return false;
  };
  conv::Shape ok{1, 5, 5, 3, 4, 3, 3, 1, 1, 0, 0, 0, 0, DType::f32, Activation::none};
  CHECK(!throws(ok));
  auto t = ok;
  t.sh = 0;
  CHECK(throws(t));
  t = ok;
  t.pl = -1;
  CHECK(throws(t));
  t = ok;
  t.r = 6;
  CHECK(throws(t));
  t = ok;
  t.c = 0;
  CHECK(throws(t));
  t = ok;
  t.dil_w = 0;
  CHECK(throws(t));
  t = ok;
  t.dil_h = 3;  // a dilated 3-row filter spans 7 rows of 5
  CHECK(throws(t));
  t = ok;
  t.groups = 2;  // does not divide C = 3
  CHECK(throws(t));
  t = ok;
  t.groups = 0;
  CHECK(throws(t));
}

TEST(conv_nan_propagates) {
  TestPool pool;
  const jb::Executor ex = pool.executor(2);
  conv::Shape s{1, 4, 4, 2, 3, 3, 3, 1, 1, 1, 1, 1, 1, DType::f32, Activation::none};
  std::vector<float> x(4 * 4 * 2, 1.0f), w(3 * 3 * 2 * 3, 1.0f), y(4 * 4 * 3);
  x[(0 * 4 + 0) * 2 + 1] = NAN;  // pixel (0, 0): reaches outputs (0..1, 0..1) only
  conv::forward(ex, jb::dispatch(), s, x.data(), w.data(), DType::f32, nullptr, y.data(), nullptr);
  for (int p = 0; p < 4; ++p)
    for (int q = 0; q < 4; ++q)
      for (int k = 0; k < 3; ++k) {
        const float v = y[size_t((p * 4 + q) * 3 + k)];
        CHECK((p <= 1 && q <= 1) == std::isnan(v)) << p << "," << q << " = " << v;
      }
}
