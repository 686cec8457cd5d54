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

// Row r of a tile: its constant bias and key limit, its bias and mask rows when they vary
// along the keys, and its dropout bits.
struct RowSetup {
  float add = 0.0f;
  int limit = 0;
  const float* bias = nullptr;
  const uint8_t* mask = nullptr;
  const uint8_t* keep = nullptr;
};

// Whether the dropout keeps key j of a row (bit j % 8 of byte j / 8).
JB_INLINE bool kept(const uint8_t* keep, int j) { return (keep[j >> 3] >> (j & 7)) & 1; }

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
  if (t.keep) rs.keep = t.keep + r * t.keep_rs;
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
  // p = exp(x - m) written as PT (times the dropout's factor: 0 or ks); returns the sum of p.
  template <class PT, bool kDrop>
  JB_INLINE static float probs(const float* x, int j0, int cols, float m, PT* p, const uint8_t* keep, float ks) {
    float sum = 0.0f;
    for (int j = j0; j < cols; ++j) {
      const float e = exp_flush(x[j] - m);
      sum += e;
      p[j] = store_as<PT>(kDrop ? (kept(keep, j) ? e * ks : 0.0f) : e);
    }
    return sum;
  }
  template <bool kBias, bool kMask, bool kDbias, bool kDrop>
  JB_INLINE static void grads(float* s, float* dp, int j0, int cols, float scale, const RowSetup& rs, float m,
                              float inv_l, float d, float* dbias, float ks) {
    for (int j = j0; j < cols; ++j) {
      bool keep;
      const float x = logit<kBias, kMask>(s, j, scale, rs, &keep);
      const float p = exp_flush(x - m) * inv_l;
      const float f = kDrop ? (kept(rs.keep, j) ? ks : 0.0f) : 1.0f;  // the dropout's factor
      const float ds = keep ? p * (dp[j] * f - d) : 0.0f;
      if constexpr (kDbias) dbias[j] = ds;
      s[j] = kDrop ? p * f : p;
      dp[j] = ds * scale;
    }
  }
  // Z = P * D and W = Z * tS as PT; returns the row's sum of P * tS.
  template <bool kBias, bool kMask, bool kDrop, bool kTbias, class PT>
  JB_INLINE static float tangents(const float* s, const float* ta, const float* tb, const float* tbias, float tadd,
                                  int j0, int cols, float scale, const RowSetup& rs, float m, float inv_l, float ks,
                                  PT* z, PT* w, float sum) {
    for (int j = j0; j < cols; ++j) {
      bool keep;
      const float x = logit<kBias, kMask>(s, j, scale, rs, &keep);
      // a masked logit is a constant (no tangent), its weight nonzero in a fully masked row
      const float p = exp_flush(x - m) * inv_l;
      float tsj = (ta[j] + tb[j]) * scale + tadd;
      if constexpr (kTbias) tsj += tbias[j];
      tsj = keep ? tsj : 0.0f;
      const float zj = kDrop ? (kept(rs.keep, j) ? p * ks : 0.0f) : p;
      sum += p * tsj;
      z[j] = store_as<PT>(zj);
      w[j] = store_as<PT>(zj * tsj);
    }
    return sum;
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
  template <class PT, bool kDrop>
  JB_INLINE static float probs(const float* x, int, int cols, float m, PT* p, const uint8_t* keep, float ks) {
    const V vm = VT::set1(m), vks = VT::set1(ks), zero = VT::zero();
    V sum = VT::zero();
    int j = 0;
    for (; j + VT::L <= cols; j += VT::L) {
      const V e = VT::exp(VT::sub(VT::load(x + j), vm));
      sum = VT::add(sum, e);
      const V z = kDrop ? VT::select(VT::bits(keep, j), VT::mul(e, vks), zero) : e;
      if constexpr (sizeof(PT) == 4) VT::store(p + j, z);
      else VT::store_bf16(p + j, z);
    }
    return VT::hsum(sum) + Scalar::probs<PT, kDrop>(x, j, cols, m, p, keep, ks);
  }
  template <bool kBias, bool kMask, bool kDbias, bool kDrop>
  JB_INLINE static void grads(float* s, float* dp, int, int cols, float scale, const RowSetup& rs, float m,
                              float inv_l, float d, float* dbias, float ks) {
    const V vs = VT::set1(scale), va = VT::set1(rs.add), masked = VT::set1(kMasked);
    const V vm = VT::set1(m), vl = VT::set1(inv_l), vd = VT::set1(d), zero = VT::zero(), vks = VT::set1(ks);
    int j = 0;
    for (; j + VT::L <= cols; j += VT::L) {
      typename VT::M keep;
      const V x = logits_at<kBias, kMask>(s, j, vs, va, masked, rs, &keep);
      const V p = VT::mul(VT::exp(VT::sub(x, vm)), vl);
      V dz = VT::load(dp + j), z = p;
      if constexpr (kDrop) {  // the dropout's factor on dZ and on P
        const typename VT::M kept_j = VT::bits(rs.keep, j);
        dz = VT::select(kept_j, VT::mul(dz, vks), zero);
        z = VT::select(kept_j, VT::mul(p, vks), zero);
      }
      const V ds = VT::select(keep, VT::mul(p, VT::sub(dz, vd)), zero);
      if constexpr (kDbias) VT::store(dbias + j, ds);
      VT::store(s + j, z);
      VT::store(dp + j, VT::mul(ds, vs));
    }
    Scalar::grads<kBias, kMask, kDbias, kDrop>(s, dp, j, cols, scale, rs, m, inv_l, d, dbias, ks);
  }
  template <bool kBias, bool kMask, bool kDrop, bool kTbias, class PT>
  JB_INLINE static float tangents(const float* s, const float* ta, const float* tb, const float* tbias, float tadd,
                                  int, int cols, float scale, const RowSetup& rs, float m, float inv_l, float ks,
                                  PT* z, PT* w, float) {
    const V vs = VT::set1(scale), va = VT::set1(rs.add), masked = VT::set1(kMasked), vt = VT::set1(tadd);
    const V vm = VT::set1(m), vl = VT::set1(inv_l), vks = VT::set1(ks), zero = VT::zero();
    V sum = VT::zero();
    int j = 0;
    for (; j + VT::L <= cols; j += VT::L) {
      typename VT::M keep;
      const V x = logits_at<kBias, kMask>(s, j, vs, va, masked, rs, &keep);
      const V p = VT::mul(VT::exp(VT::sub(x, vm)), vl);
      V tsj = VT::fma(VT::add(VT::load(ta + j), VT::load(tb + j)), vs, vt);
      if constexpr (kTbias) tsj = VT::add(tsj, VT::load(tbias + j));
      tsj = VT::select(keep, tsj, zero);
      const V zj = kDrop ? VT::select(VT::bits(rs.keep, j), VT::mul(p, vks), zero) : p;
      sum = VT::fma(p, tsj, sum);
      const V wj = VT::mul(zj, tsj);
      if constexpr (sizeof(PT) == 4) VT::store(z + j, zj), VT::store(w + j, wj);
      else VT::store_bf16(z + j, zj), VT::store_bf16(w + j, wj);
    }
    return Scalar::tangents<kBias, kMask, kDrop, kTbias, PT>(s, ta, tb, tbias, tadd, j, cols, scale, rs, m, inv_l, ks,
                                                             z, w, VT::hsum(sum));
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

template <class R, bool kBias, bool kMask, bool kDrop, class PT>
JB_INLINE void forward_rows(const ScoreTile& t, float* m, float* l, float* alpha, PT* p, int64_t ldp) {
  for (int64_t r = 0; r < t.rows; ++r) {
    const RowSetup rs = setup(t, r);
    float* s = t.s + r * t.ld;
    PT* pr = p + r * ldp;
    const float mn = R::template logits<kBias, kMask>(s, 0, int(t.cols), t.scale, rs, m[r]);
    alpha[r] = exp_flush(m[r] - mn);
    l[r] = l[r] * alpha[r] + R::template probs<PT, kDrop>(s, 0, int(t.cols), mn, pr, rs.keep, t.keep_scale);
    for (int64_t j = t.cols; j < t.width; ++j) pr[j] = PT(0);
    m[r] = mn;
  }
}

template <class R, class PT>
JB_INLINE void forward_tile(const ScoreTile& t, float* m, float* l, float* alpha, PT* p, int64_t ldp) {
  const int variant = (t.bias && t.bias_cs ? 4 : 0) | (t.mask && t.mask_cs ? 2 : 0) | (t.keep ? 1 : 0);
  switch (variant) {
#define JB_CASE(v) \
  case v: return forward_rows<R, (v & 4) != 0, (v & 2) != 0, (v & 1) != 0>(t, m, l, alpha, p, ldp);
    JB_CASE(0) JB_CASE(1) JB_CASE(2) JB_CASE(3) JB_CASE(4) JB_CASE(5) JB_CASE(6) JB_CASE(7)
#undef JB_CASE
  }
}

template <class R, bool kBias, bool kMask, bool kDbias, bool kDrop>
JB_INLINE void backward_rows(const ScoreTile& t, float* dp, int64_t lddp, const float* m, const float* inv_l,
                             const float* d, float* dbias, int64_t lddb) {
  for (int64_t r = 0; r < t.rows; ++r) {
    float* s = t.s + r * t.ld;
    float* dpr = dp + r * lddp;
    R::template grads<kBias, kMask, kDbias, kDrop>(s, dpr, 0, int(t.cols), t.scale, setup(t, r), m[r], inv_l[r],
                                                   d[r], kDbias ? dbias + r * lddb : nullptr, t.keep_scale);
    for (int64_t j = t.cols; j < t.width; ++j) s[j] = dpr[j] = 0.0f;
  }
}

template <class R>
JB_INLINE void backward_tile(const ScoreTile& t, float* dp, int64_t lddp, const float* m, const float* inv_l,
                             const float* d, float* dbias, int64_t lddb) {
  const int variant =
      (t.keep ? 8 : 0) | (t.bias && t.bias_cs ? 4 : 0) | (t.mask && t.mask_cs ? 2 : 0) | (dbias ? 1 : 0);
  switch (variant) {
#define JB_CASE(v)                                                                                              \
  case v:                                                                                                       \
    return backward_rows<R, (v & 4) != 0, (v & 2) != 0, (v & 1) != 0, (v & 8) != 0>(t, dp, lddp, m, inv_l, d, \
                                                                                    dbias, lddb);
    JB_CASE(0) JB_CASE(1) JB_CASE(2) JB_CASE(3) JB_CASE(4) JB_CASE(5) JB_CASE(6) JB_CASE(7)
    JB_CASE(8) JB_CASE(9) JB_CASE(10) JB_CASE(11) JB_CASE(12) JB_CASE(13) JB_CASE(14) JB_CASE(15)
#undef JB_CASE
  }
}

template <class R, bool kBias, bool kMask, bool kDrop, bool kTbias, class PT>
JB_INLINE void tangent_rows(const ScoreTile& t, const float* ts_a, const float* ts_b, int64_t ldts,
                            const float* tbias, const float* m, const float* inv_l, float* c, PT* z, PT* w,
                            int64_t ldz) {
  for (int64_t r = 0; r < t.rows; ++r) {
    const RowSetup rs = setup(t, r);
    PT *zr = z + r * ldz, *wr = w + r * ldz;
    // tbias has the bias's strides: a row of it (kTbias), or one value per row (column stride 0)
    const float* tb_row = tbias ? tbias + r * t.bias_rs : nullptr;
    const float tadd = tbias && !kTbias ? *tb_row : 0.0f;
    c[r] += R::template tangents<kBias, kMask, kDrop, kTbias, PT>(t.s + r * t.ld, ts_a + r * ldts, ts_b + r * ldts,
                                                                 tb_row, tadd, 0, int(t.cols), t.scale, rs, m[r],
                                                                 inv_l[r], t.keep_scale, zr, wr, 0.0f);
    for (int64_t j = t.cols; j < t.width; ++j) zr[j] = wr[j] = PT(0);
  }
}

template <class R, class PT>
JB_INLINE void tangent_tile(const ScoreTile& t, const float* ts_a, const float* ts_b, int64_t ldts,
                            const float* tbias, const float* m, const float* inv_l, float* c, PT* z, PT* w,
                            int64_t ldz) {
  const int variant = (t.keep ? 8 : 0) | (t.bias && t.bias_cs ? 4 : 0) | (t.mask && t.mask_cs ? 2 : 0) |
                      (tbias && t.bias_cs ? 1 : 0);
  switch (variant) {
#define JB_CASE(v)                                                                                     \
  case v:                                                                                              \
    return tangent_rows<R, (v & 4) != 0, (v & 2) != 0, (v & 8) != 0, (v & 1) != 0>(t, ts_a, ts_b, ldts, \
                                                                                 tbias, m, inv_l, c, z, w, ldz);
    JB_CASE(0) JB_CASE(1) JB_CASE(2) JB_CASE(3) JB_CASE(4) JB_CASE(5) JB_CASE(6) JB_CASE(7)
    JB_CASE(8) JB_CASE(9) JB_CASE(10) JB_CASE(11) JB_CASE(12) JB_CASE(13) JB_CASE(14) JB_CASE(15)
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
template <class R, class PT>
void tangent_entry(const ScoreTile& t, const float* ts_a, const float* ts_b, int64_t ldts, const float* tbias,
                   const float* m, const float* inv_l, float* c, void* z, void* w, int64_t ldz) {
  tangent_tile<R, PT>(t, ts_a, ts_b, ldts, tbias, m, inv_l, c, static_cast<PT*>(z), static_cast<PT*>(w), ldz);
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
  return {&forward_entry<R, float>, &forward_entry<R, uint16_t>, &backward_entry<R>, &tangent_entry<R, float>,
          &tangent_entry<R, uint16_t>, &store_entry<R>, &dots_entry<R>};
}

}  // namespace
}  // namespace jb::attention
