// One templated loop per operation, instantiated for the baseline ISA, AVX2 and AVX-512
// (layers/common/target.h) and taken by the kernel ISA in use. The row loops are
// branch-free; reductions keep kLanes partial results (one vector's worth on AVX-512),
// combined in a fixed order, so the compiler vectorizes them without reassociating.
#include "layers/attention/rows.h"

#include <algorithm>
#include <limits>

#include "brgemm/activation.h"
#include "layers/attention/attention.h"
#include "layers/common/target.h"

namespace jb::attention {

namespace {

#define JB_INLINE __attribute__((always_inline)) inline

constexpr int kLanes = 16;

// exp with exact zeros below its range (a masked key's weight in a row that is not fully
// masked), where exp_approx would return its smallest value.
JB_INLINE float exp_flush(float x) {
  const float e = exp_approx(x);
  return x < -87.3f ? 0.0f : e;
}

// f32_to_bf16 without a branch.
JB_INLINE uint16_t bf16_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet = (u >> 16) | 0x40u;
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

template <class T>
JB_INLINE T store_as(float v) {
  if constexpr (sizeof(T) == 4) return v;
  else return bf16_bits(v);
}

// Row r of a tile: its constant bias and key limit, and its bias and mask rows when they
// vary along the keys.
struct RowSetup {
  float add = 0.0f;
  int limit = 0;
  const float* bias = nullptr;
  const uint8_t* mask = nullptr;
};

JB_INLINE RowSetup setup(const ScoreTile& t, int64_t r) {
  RowSetup rs;
  int64_t limit = t.cols;
  if (t.causal) limit = std::max<int64_t>(0, std::min(limit, t.limit0 + r));
  if (t.bias) {
    if (t.bias_cs) rs.bias = t.bias + r * t.bias_rs;
    else rs.add = t.bias[r * t.bias_rs];
  }
  if (t.mask) {
    if (t.mask_cs) rs.mask = t.mask + r * t.mask_rs;
    else if (!t.mask[r * t.mask_rs]) limit = 0;
  }
  rs.limit = int(limit);
  return rs;
}

template <bool kBias, bool kMask>
JB_INLINE float logit(const float* s, int j, float scale, const RowSetup& rs, bool* keep) {
  float x = s[j] * scale + rs.add;
  if constexpr (kBias) x += rs.bias[j];
  bool k = j < rs.limit;
  if constexpr (kMask) k = k && rs.mask[j] != 0;
  *keep = k;
  return k ? x : kMasked;
}

// x = the logits, written over s; returns max(m, max x).
template <bool kBias, bool kMask>
JB_INLINE float logits_row(float* s, int cols, float scale, const RowSetup& rs, float m) {
  float mx[kLanes];
  for (int l = 0; l < kLanes; ++l) mx[l] = m;
  int j = 0;
  for (; j + kLanes <= cols; j += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      bool keep;
      const float x = logit<kBias, kMask>(s, j + l, scale, rs, &keep);
      s[j + l] = x;
      mx[l] = x > mx[l] ? x : mx[l];
    }
  for (; j < cols; ++j) {
    bool keep;
    const float x = logit<kBias, kMask>(s, j, scale, rs, &keep);
    s[j] = x;
    mx[0] = x > mx[0] ? x : mx[0];
  }
  float r = mx[0];
  for (int l = 1; l < kLanes; ++l) r = mx[l] > r ? mx[l] : r;
  return r;
}

// p = exp(x - m) for j < cols, 0 up to width; returns the sum of p.
template <class PT>
JB_INLINE float probs_row(const float* x, int cols, int width, float m, PT* p) {
  float sum[kLanes] = {};
  int j = 0;
  for (; j + kLanes <= cols; j += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float e = exp_flush(x[j + l] - m);
      sum[l] += e;
      p[j + l] = store_as<PT>(e);
    }
  for (; j < cols; ++j) {
    const float e = exp_flush(x[j] - m);
    sum[0] += e;
    p[j] = store_as<PT>(e);
  }
  for (; j < width; ++j) p[j] = PT(0);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) sum[l] += sum[l + w];
  return sum[0];
}

template <bool kBias, bool kMask, class PT>
JB_INLINE void forward_rows(const ScoreTile& t, float* m, float* l, float* alpha, PT* p, int64_t ldp) {
  for (int64_t r = 0; r < t.rows; ++r) {
    const RowSetup rs = setup(t, r);
    float* s = t.s + r * t.ld;
    const float mn = logits_row<kBias, kMask>(s, int(t.cols), t.scale, rs, m[r]);
    alpha[r] = exp_flush(m[r] - mn);
    l[r] = l[r] * alpha[r] + probs_row<PT>(s, int(t.cols), int(t.width), mn, p + r * ldp);
    m[r] = mn;
  }
}

template <class PT>
JB_INLINE void forward_tile(const ScoreTile& t, float* m, float* l, float* alpha, PT* p, int64_t ldp) {
  const bool bias_row = t.bias && t.bias_cs, mask_row = t.mask && t.mask_cs;
  if (bias_row && mask_row) forward_rows<true, true>(t, m, l, alpha, p, ldp);
  else if (bias_row) forward_rows<true, false>(t, m, l, alpha, p, ldp);
  else if (mask_row) forward_rows<false, true>(t, m, l, alpha, p, ldp);
  else forward_rows<false, false>(t, m, l, alpha, p, ldp);
}

template <bool kBias, bool kMask, bool kDbias>
JB_INLINE void backward_row(float* s, float* dp, int cols, int width, float scale, const RowSetup& rs,
                            float m, float inv_l, float d, float* dbias) {
  for (int j = 0; j < cols; ++j) {
    bool keep;
    const float x = logit<kBias, kMask>(s, j, scale, rs, &keep);
    const float p = exp_flush(x - m) * inv_l;
    const float ds = keep ? p * (dp[j] - d) : 0.0f;
    if constexpr (kDbias) dbias[j] = ds;
    s[j] = p;
    dp[j] = ds * scale;
  }
  for (int j = cols; j < width; ++j) s[j] = dp[j] = 0.0f;
}

template <bool kBias, bool kMask, bool kDbias>
JB_INLINE void backward_rows(const ScoreTile& t, float* dp, int64_t lddp, const float* m,
                             const float* inv_l, const float* d, float* dbias, int64_t lddb) {
  for (int64_t r = 0; r < t.rows; ++r)
    backward_row<kBias, kMask, kDbias>(t.s + r * t.ld, dp + r * lddp, int(t.cols), int(t.width), t.scale,
                                       setup(t, r), m[r], inv_l[r], d[r], kDbias ? dbias + r * lddb : nullptr);
}

JB_INLINE void backward_tile(const ScoreTile& t, float* dp, int64_t lddp, const float* m, const float* inv_l,
                             const float* d, float* dbias, int64_t lddb) {
  const int variant = (t.bias && t.bias_cs ? 4 : 0) | (t.mask && t.mask_cs ? 2 : 0) | (dbias ? 1 : 0);
  switch (variant) {
#define JB_CASE(v) \
  case v: return backward_rows<(v & 4) != 0, (v & 2) != 0, (v & 1) != 0>(t, dp, lddp, m, inv_l, d, dbias, lddb);
    JB_CASE(0) JB_CASE(1) JB_CASE(2) JB_CASE(3) JB_CASE(4) JB_CASE(5) JB_CASE(6) JB_CASE(7)
#undef JB_CASE
  }
}

JB_INLINE void bf16_tile(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint16_t* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) y[r * ldy + j] = bf16_bits(x[r * ldx + j]);
}

// Each operation under each target attribute, from the loops above.
#define JB_ROWS_VARIANTS(target, isa)                                                              \
  template <class PT>                                                                              \
  target void forward_##isa(const ScoreTile& t, float* m, float* l, float* alpha, void* p, int64_t ldp) { \
    forward_tile<PT>(t, m, l, alpha, static_cast<PT*>(p), ldp);                                    \
  }                                                                                                \
  target void backward_##isa(const ScoreTile& t, float* dp, int64_t lddp, const float* m,           \
                             const float* inv_l, const float* d, float* dbias, int64_t lddb) {     \
    backward_tile(t, dp, lddp, m, inv_l, d, dbias, lddb);                                          \
  }                                                                                                \
  target void bf16_##isa(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint16_t* y,      \
                         int64_t ldy) {                                                            \
    bf16_tile(x, ldx, rows, cols, y, ldy);                                                         \
  }
#define JB_NO_TARGET
JB_ROWS_VARIANTS(JB_NO_TARGET, base)
#if defined(JB_X86)
JB_ROWS_VARIANTS(JB_TARGET_AVX2, avx2)
JB_ROWS_VARIANTS(JB_TARGET_AVX512, avx512)
#endif
#undef JB_ROWS_VARIANTS
#undef JB_NO_TARGET

}  // namespace

void softmax_forward(const ScoreTile& t, float* m, float* l, float* alpha, void* p, int64_t ldp,
                     DType pt, Isa isa) {
  const bool f32 = pt == DType::f32;
#if defined(JB_X86)
  if (isa >= Isa::avx512)
    return f32 ? forward_avx512<float>(t, m, l, alpha, p, ldp) : forward_avx512<uint16_t>(t, m, l, alpha, p, ldp);
  if (isa == Isa::avx2)
    return f32 ? forward_avx2<float>(t, m, l, alpha, p, ldp) : forward_avx2<uint16_t>(t, m, l, alpha, p, ldp);
#endif
  (void)isa;
  f32 ? forward_base<float>(t, m, l, alpha, p, ldp) : forward_base<uint16_t>(t, m, l, alpha, p, ldp);
}

void softmax_backward(const ScoreTile& t, float* dp, int64_t lddp, const float* m,
                      const float* inv_l, const float* d, float* dbias, int64_t lddb, Isa isa) {
#if defined(JB_X86)
  if (isa >= Isa::avx512) return backward_avx512(t, dp, lddp, m, inv_l, d, dbias, lddb);
  if (isa == Isa::avx2) return backward_avx2(t, dp, lddp, m, inv_l, d, dbias, lddb);
#endif
  (void)isa;
  backward_base(t, dp, lddp, m, inv_l, d, dbias, lddb);
}

void to_bf16(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint16_t* y, int64_t ldy,
             Isa isa) {
#if defined(JB_X86)
  if (isa >= Isa::avx512) return bf16_avx512(x, ldx, rows, cols, y, ldy);
  if (isa == Isa::avx2) return bf16_avx2(x, ldx, rows, cols, y, ldy);
#endif
  (void)isa;
  bf16_base(x, ldx, rows, cols, y, ldy);
}

}  // namespace jb::attention
