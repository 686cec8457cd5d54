// The attention's row loops, written once over a row policy: Scalar (plain loops: the
// portable path, and the vector path's remainders) or Vector<simd traits> (the same math
// lane by lane). Included by rows.cc (Scalar) and by each ISA's translation unit
// (rows_avx512.cc, rows_avx2.cc, compiled with that ISA's flags), which instantiate
// row_fns<...>() for their policy. Everything has internal linkage (unnamed namespace, no
// standard library templates), so no ISA's code can reach another unit through the linker.
#pragma once

#include <cstdint>

#include "brgemm/activation.h"
#include "layers/attention/attention.h"
#include "layers/attention/rows.h"

namespace jb::attention {
namespace {

#define JB_INLINE __attribute__((always_inline)) inline

// exp with exact zeros below its range (a masked key's weight in a row that is not fully
// masked), where exp_approx would return its smallest value.
JB_INLINE float exp_flush(float x) {
  const float e = exp_approx(x);
  return x < -87.3f ? 0.0f : e;
}

template <class T>
JB_INLINE T store_as(float v) {
  if constexpr (sizeof(T) == 4) return v;
  else return f32_to_bf16(v);
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
  if (t.causal) {
    const int64_t causal = t.limit0 + r;
    limit = causal < 0 ? 0 : causal < limit ? causal : limit;
  }
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

// The logit of key j and whether it is kept (not masked).
template <bool kBias, bool kMask>
JB_INLINE float logit(const float* s, int j, float scale, const RowSetup& rs, bool* keep) {
  float x = s[j] * scale + rs.add;
  if constexpr (kBias) x += rs.bias[j];
  bool k = j < rs.limit;
  if constexpr (kMask) k = k && rs.mask[j] != 0;
  *keep = k;
  return k ? x : kMasked;
}

// The scalar row loops over keys [j0, cols): the portable path, and the vector path's
// remainders.
struct Scalar {
  // x = the logits, written over s; returns max(m, max x).
  template <bool kBias, bool kMask>
  JB_INLINE static float logits(float* s, int j0, int cols, float scale, const RowSetup& rs, float m) {
    for (int j = j0; j < cols; ++j) {
      bool keep;
      const float x = logit<kBias, kMask>(s, j, scale, rs, &keep);
      s[j] = x;
      m = x > m ? x : m;
    }
    return m;
  }
  // p = exp(x - m) written as PT; returns the sum of p.
  template <class PT>
  JB_INLINE static float probs(const float* x, int j0, int cols, float m, PT* p) {
    float sum = 0.0f;
    for (int j = j0; j < cols; ++j) {
      const float e = exp_flush(x[j] - m);
      sum += e;
      p[j] = store_as<PT>(e);
    }
    return sum;
  }
  template <bool kBias, bool kMask, bool kDbias>
  JB_INLINE static void grads(float* s, float* dp, int j0, int cols, float scale, const RowSetup& rs, float m,
                              float inv_l, float d, float* dbias) {
    for (int j = j0; j < cols; ++j) {
      bool keep;
      const float x = logit<kBias, kMask>(s, j, scale, rs, &keep);
      const float p = exp_flush(x - m) * inv_l;
      const float ds = keep ? p * (dp[j] - d) : 0.0f;
      if constexpr (kDbias) dbias[j] = ds;
      s[j] = p;
      dp[j] = ds * scale;
    }
  }
  // y = x * scale in T.
  template <class T>
  JB_INLINE static void store(const float* x, int j0, int cols, float scale, T* y) {
    for (int j = j0; j < cols; ++j) y[j] = store_as<T>(x[j] * scale);
  }
  // sum over j of a[j] * b[j], in fp32.
  template <class T>
  JB_INLINE static float dot(const T* a, const T* b, int j0, int n, float sum) {
    for (int j = j0; j < n; ++j) sum += to_f32(a[j]) * to_f32(b[j]);
    return sum;
  }
};

template <class VT>
struct Vector {
  using V = typename VT::V;

  template <bool kBias, bool kMask>
  JB_INLINE static V logits_at(const float* s, int j, V scale, V add, V masked, const RowSetup& rs,
                               typename VT::M* keep) {
    V x = VT::fma(VT::load(s + j), scale, add);
    if constexpr (kBias) x = VT::add(x, VT::load(rs.bias + j));
    typename VT::M k = VT::first(rs.limit - j);
    if constexpr (kMask) k = VT::both(k, VT::nonzero(rs.mask + j));
    *keep = k;
    return VT::select(k, x, masked);
  }
  template <bool kBias, bool kMask>
  JB_INLINE static float logits(float* s, int, int cols, float scale, const RowSetup& rs, float m) {
    const V vs = VT::set1(scale), va = VT::set1(rs.add), masked = VT::set1(kMasked);
    V vm = VT::set1(m);
    int j = 0;
    for (; j + VT::L <= cols; j += VT::L) {
      typename VT::M keep;
      const V x = logits_at<kBias, kMask>(s, j, vs, va, masked, rs, &keep);
      VT::store(s + j, x);
      vm = VT::max(x, vm);
    }
    return Scalar::logits<kBias, kMask>(s, j, cols, scale, rs, VT::hmax(vm));
  }
  template <class PT>
  JB_INLINE static float probs(const float* x, int, int cols, float m, PT* p) {
    const V vm = VT::set1(m);
    V sum = VT::zero();
    int j = 0;
    for (; j + VT::L <= cols; j += VT::L) {
      const V e = VT::exp(VT::sub(VT::load(x + j), vm));
      sum = VT::add(sum, e);
      if constexpr (sizeof(PT) == 4) VT::store(p + j, e);
      else VT::store_bf16(p + j, e);
    }
    return VT::hsum(sum) + Scalar::probs<PT>(x, j, cols, m, p);
  }
  template <bool kBias, bool kMask, bool kDbias>
  JB_INLINE static void grads(float* s, float* dp, int, int cols, float scale, const RowSetup& rs, float m,
                              float inv_l, float d, float* dbias) {
    const V vs = VT::set1(scale), va = VT::set1(rs.add), masked = VT::set1(kMasked);
    const V vm = VT::set1(m), vl = VT::set1(inv_l), vd = VT::set1(d), zero = VT::zero();
    int j = 0;
    for (; j + VT::L <= cols; j += VT::L) {
      typename VT::M keep;
      const V x = logits_at<kBias, kMask>(s, j, vs, va, masked, rs, &keep);
      const V p = VT::mul(VT::exp(VT::sub(x, vm)), vl);
      const V ds = VT::select(keep, VT::mul(p, VT::sub(VT::load(dp + j), vd)), zero);
      if constexpr (kDbias) VT::store(dbias + j, ds);
      VT::store(s + j, p);
      VT::store(dp + j, VT::mul(ds, vs));
    }
    Scalar::grads<kBias, kMask, kDbias>(s, dp, j, cols, scale, rs, m, inv_l, d, dbias);
  }
  template <class T>
  JB_INLINE static void store(const float* x, int, int cols, float scale, T* y) {
    const V vs = VT::set1(scale);
    int j = 0;
    for (; j + VT::L <= cols; j += VT::L) {
      const V v = VT::mul(VT::load(x + j), vs);
      if constexpr (sizeof(T) == 4) VT::store(y + j, v);
      else VT::store_bf16(y + j, v);
    }
    Scalar::store(x, j, cols, scale, y);
  }
  template <class T>
  JB_INLINE static V load(const T* p) {
    if constexpr (sizeof(T) == 4) return VT::load(p);
    else return VT::load_bf16(p);
  }
  template <class T>
  JB_INLINE static float dot(const T* a, const T* b, int, int n, float) {
    V sum = VT::zero();
    int j = 0;
    for (; j + VT::L <= n; j += VT::L) sum = VT::fma(load(a + j), load(b + j), sum);
    return Scalar::dot(a, b, j, n, VT::hsum(sum));
  }
};

template <class R, bool kBias, bool kMask, class PT>
JB_INLINE void forward_rows(const ScoreTile& t, float* m, float* l, float* alpha, PT* p, int64_t ldp) {
  for (int64_t r = 0; r < t.rows; ++r) {
    const RowSetup rs = setup(t, r);
    float* s = t.s + r * t.ld;
    PT* pr = p + r * ldp;
    const float mn = R::template logits<kBias, kMask>(s, 0, int(t.cols), t.scale, rs, m[r]);
    alpha[r] = exp_flush(m[r] - mn);
    l[r] = l[r] * alpha[r] + R::template probs<PT>(s, 0, int(t.cols), mn, pr);
    for (int64_t j = t.cols; j < t.width; ++j) pr[j] = PT(0);
    m[r] = mn;
  }
}

template <class R, class PT>
JB_INLINE void forward_tile(const ScoreTile& t, float* m, float* l, float* alpha, PT* p, int64_t ldp) {
  const bool bias_row = t.bias && t.bias_cs, mask_row = t.mask && t.mask_cs;
  if (bias_row && mask_row) forward_rows<R, true, true>(t, m, l, alpha, p, ldp);
  else if (bias_row) forward_rows<R, true, false>(t, m, l, alpha, p, ldp);
  else if (mask_row) forward_rows<R, false, true>(t, m, l, alpha, p, ldp);
  else forward_rows<R, false, false>(t, m, l, alpha, p, ldp);
}

template <class R, bool kBias, bool kMask, bool kDbias>
JB_INLINE void backward_rows(const ScoreTile& t, float* dp, int64_t lddp, const float* m, const float* inv_l,
                             const float* d, float* dbias, int64_t lddb) {
  for (int64_t r = 0; r < t.rows; ++r) {
    float* s = t.s + r * t.ld;
    float* dpr = dp + r * lddp;
    R::template grads<kBias, kMask, kDbias>(s, dpr, 0, int(t.cols), t.scale, setup(t, r), m[r], inv_l[r], d[r],
                                            kDbias ? dbias + r * lddb : nullptr);
    for (int64_t j = t.cols; j < t.width; ++j) s[j] = dpr[j] = 0.0f;
  }
}

template <class R>
JB_INLINE void backward_tile(const ScoreTile& t, float* dp, int64_t lddp, const float* m, const float* inv_l,
                             const float* d, float* dbias, int64_t lddb) {
  const int variant = (t.bias && t.bias_cs ? 4 : 0) | (t.mask && t.mask_cs ? 2 : 0) | (dbias ? 1 : 0);
  switch (variant) {
#define JB_CASE(v)                                                                                        \
  case v:                                                                                                 \
    return backward_rows<R, (v & 4) != 0, (v & 2) != 0, (v & 1) != 0>(t, dp, lddp, m, inv_l, d, dbias, lddb);
    JB_CASE(0) JB_CASE(1) JB_CASE(2) JB_CASE(3) JB_CASE(4) JB_CASE(5) JB_CASE(6) JB_CASE(7)
#undef JB_CASE
  }
}

template <class R, class T>
JB_INLINE void store_tile(const float* x, int64_t ldx, const float* scale, int64_t rows, int64_t cols, T* y,
                          int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) R::store(x + r * ldx, 0, int(cols), scale ? scale[r] : 1.0f, y + r * ldy);
}

template <class R, class T>
JB_INLINE void dots_tile(const T* a, const T* b, int64_t ld, int64_t rows, int64_t n, float* d) {
  for (int64_t r = 0; r < rows; ++r) d[r] = R::dot(a + r * ld, b + r * ld, 0, int(n), 0.0f);
}

// The entry points of one policy.
template <class R, class PT>
void forward_entry(const ScoreTile& t, float* m, float* l, float* alpha, void* p, int64_t ldp) {
  forward_tile<R, PT>(t, m, l, alpha, static_cast<PT*>(p), ldp);
}
template <class R>
void backward_entry(const ScoreTile& t, float* dp, int64_t lddp, const float* m, const float* inv_l,
                    const float* d, float* dbias, int64_t lddb) {
  backward_tile<R>(t, dp, lddp, m, inv_l, d, dbias, lddb);
}
template <class R>
void store_entry(const float* x, int64_t ldx, const float* scale, int64_t rows, int64_t cols, void* y, int64_t ldy,
                 DType dt) {
  if (dt == DType::f32) store_tile<R>(x, ldx, scale, rows, cols, static_cast<float*>(y), ldy);
  else store_tile<R>(x, ldx, scale, rows, cols, static_cast<uint16_t*>(y), ldy);
}
template <class R>
void dots_entry(const void* a, const void* b, int64_t ld, int64_t rows, int64_t n, DType dt, float* d) {
  if (dt == DType::f32) dots_tile<R>(static_cast<const float*>(a), static_cast<const float*>(b), ld, rows, n, d);
  else dots_tile<R>(static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), ld, rows, n, d);
}
template <class R>
detail::RowFns row_fns() {
  return {&forward_entry<R, float>, &forward_entry<R, uint16_t>, &backward_entry<R>, &store_entry<R>, &dots_entry<R>};
}

}  // namespace
}  // namespace jb::attention
