// Depthwise convolutions (feature groups == C == K): every channel reduces over its own taps
// only, so there is no GEMM to batch-reduce (a BRGEMM per channel is 1 wide). Here the
// channels go in the vector lanes (GCC vector types) and each register sums its pixel's valid
// taps in fp32; the passes are memory-bound. Each inner loop is built per ISA (target
// attributes on row functions, chosen by the dispatch), so JAX_BRGEMM_ISA still applies.
#include "layers/conv/depthwise.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "layers/common/eltwise.h"
#include "layers/common/lanes.h"
#include "layers/common/operand.h"
#include "layers/common/scratch.h"

namespace jb::conv {

namespace {

struct Geo {  // one pass's view of the shape; wf: the weights in fp32, [tap][c]
  Shape s;  // a copy: jobs run after the caller's frame is gone
  int64_t P, Q;
  const float* wf;
};

// Registers summed at once: independent FMA chains, enough to hide the FMA's latency.
constexpr int64_t kChains = 4;

struct Tap {  // one valid tap of a pixel: its activation and weight offsets
  int64_t a, w;
};

// The valid taps of forward output pixel (n, p, q): the inputs it reads.
int64_t fwd_taps(const Geo& g, int64_t n, int64_t p, int64_t q, Tap* taps) {
  const Shape& s = g.s;
  int64_t nt = 0;
  for (int64_t r = 0; r < s.r; ++r) {
    const int64_t ih = p * s.sh + r * s.dil_h - s.pt;
    if (ih < 0 || ih >= s.h) continue;
    for (int64_t t = 0; t < s.s; ++t) {
      const int64_t iw = q * s.sw + t * s.dil_w - s.pl;
      if (iw >= 0 && iw < s.w) taps[nt++] = {((n * s.h + ih) * s.w + iw) * s.c, (r * s.s + t) * s.c};
    }
  }
  return nt;
}

// The valid taps of input pixel (n, h, w) in the backward: the outputs that read it.
int64_t bwd_taps(const Geo& g, int64_t n, int64_t h, int64_t w, Tap* taps) {
  const Shape& s = g.s;
  int64_t nt = 0;
  for (int64_t r = 0; r < s.r; ++r) {
    const int64_t u = h + s.pt - r * s.dil_h;
    if (u < 0 || u % s.sh || u / s.sh >= g.P) continue;
    for (int64_t t = 0; t < s.s; ++t) {
      const int64_t v = w + s.pl - t * s.dil_w;
      if (v >= 0 && v % s.sw == 0 && v / s.sw < g.Q)
        taps[nt++] = {((n * g.P + u / s.sh) * g.Q + v / s.sw) * s.c, (r * s.s + t) * s.c};
    }
  }
  return nt;
}

// out[c] = init[c] + sum_taps in[tap.a + c] * wf[tap.w + c] for one pixel: U registers of W
// channels summed over the pixel's taps at once (U chains hide the FMA latency), then single
// registers, then the last channels one by one.
template <int W, class T>
[[gnu::always_inline]] inline void pixel(const Tap* taps, int64_t nt, const T* in, const float* wf,
                                         const float* init, int64_t C, T* out) {
  using V = typename Lanes<W>::f;
  constexpr int64_t U = kChains;
  int64_t c = 0;
  for (; c + U * W <= C; c += U * W) {
    V acc[U] = {};
#pragma GCC unroll 4
    for (int64_t u = 0; u < U; ++u)
      if (init) acc[u] = load<W>(init + c + u * W);
    for (int64_t i = 0; i < nt; ++i) {
      const T* a = in + taps[i].a + c;
      const float* b = wf + taps[i].w + c;
#pragma GCC unroll 4
      for (int64_t u = 0; u < U; ++u) acc[u] += load<W>(a + u * W) * load<W>(b + u * W);
    }
#pragma GCC unroll 4
    for (int64_t u = 0; u < U; ++u) store<W>(out + c + u * W, acc[u]);
  }
  for (; c + W <= C; c += W) {
    V acc = init ? load<W>(init + c) : V{};
    for (int64_t i = 0; i < nt; ++i) acc += load<W>(in + taps[i].a + c) * load<W>(wf + taps[i].w + c);
    store<W>(out + c, acc);
  }
  for (; c < C; ++c) {
    float acc = init ? init[c] : 0.0f;
    for (int64_t i = 0; i < nt; ++i) acc += to_f32(in[taps[i].a + c]) * wf[taps[i].w + c];
    out[c] = from_f32<T>(acc);
  }
}

// kBlock neighbouring pixels of a unit-stride, undilated row whose every filter column is
// inside it (the interior): out[b][c] = init[c] + sum over the valid filter rows i and every
// column t of rows[i][(q + b + col(t)) * C + c] * wf[wrows[i] + t * C + c], col(t) = t, or
// S - 1 - t for the backward's flipped taps: each weight register loaded once for kBlock
// pixels instead of once per pixel, and no per-pixel tap list. Same order of sums as
// pixel(), so the same bits.
constexpr int64_t kBlock = 8;

template <int W, class T>
[[gnu::always_inline]] inline void interior(const std::vector<const T*>& rows, const std::vector<int64_t>& wrows,
                                            int64_t S, bool flip, const float* wf, const float* init, int64_t C,
                                            int64_t q, T* out) {
  using V = typename Lanes<W>::f;
  for (int64_t c = 0; c < C; c += W) {
    V acc[kBlock];
#pragma GCC unroll 8
    for (int64_t b = 0; b < kBlock; ++b) acc[b] = init ? load<W>(init + c) : V{};
    for (size_t i = 0; i < rows.size(); ++i)
      for (int64_t t = 0; t < S; ++t) {
        const V wv = load<W>(wf + wrows[i] + t * C + c);
        const T* a = rows[i] + (q + (flip ? S - 1 - t : t)) * C + c;
#pragma GCC unroll 8
        for (int64_t b = 0; b < kBlock; ++b) acc[b] += load<W>(a + b * C) * wv;
      }
#pragma GCC unroll 8
    for (int64_t b = 0; b < kBlock; ++b) store<W>(out + (q + b) * C + c, acc[b]);
  }
}

// Whether a row's interior pixels take interior(): unit column stride, undilated columns,
// whole registers of channels, and filters at least 5 wide (Zen 4: 7x7 forward 2x; 3x3 ones,
// memory-bound, ran 0.7x: a register's pass over 8 pixels' lines is worse for the prefetch
// than a pixel's 64 channels at once).
template <int W>
bool blocked(const Shape& s) {
  return s.sw == 1 && s.dil_w == 1 && s.c % W == 0 && s.s >= 5;
}

// The `count` pixels of one row (forward: output row i = p of image n; backward: input row
// i = h): blocks of kBlock inside the interior [lo, hi) through interior(), the others one
// by one through their tap lists.
template <int W, class T>
[[gnu::always_inline]] inline void row_pixels(const Geo& g, bool backward, const T* in, const float* init,
                                              int64_t n, int64_t i, int64_t count, int64_t lo, int64_t hi,
                                              const std::vector<const T*>& rows, const std::vector<int64_t>& wrows,
                                              T* out) {
  std::vector<Tap> taps(size_t(g.s.r * g.s.s));
  for (int64_t q = 0; q < count;) {
    if (q >= lo && q + kBlock <= hi) {
      interior<W>(rows, wrows, g.s.s, backward, g.wf, init, g.s.c, q, out);
      q += kBlock;
      continue;
    }
    const int64_t nt = backward ? bwd_taps(g, n, i, q, taps.data()) : fwd_taps(g, n, i, q, taps.data());
    pixel<W>(taps.data(), nt, in, g.wf, init, g.s.c, out + q * g.s.c);
    ++q;
  }
}

// Forward, one output row (n, p): y[q][c] = bias[c] + sum_taps x[ih][iw][c] * w[tap][c].
template <int W, class T>
[[gnu::always_inline]] inline void fwd_row_body(const Geo& g, const T* x, const float* bias, T* y, int64_t row) {
  const Shape& s = g.s;
  const int64_t n = row / g.P, p = row % g.P;
  std::vector<const T*> rows;  // the valid filter rows' input rows, from padded column 0
  std::vector<int64_t> wrows;
  int64_t lo = 0, hi = 0;      // the interior [lo, hi): columns q with q - pl .. q - pl + S - 1 inside
  if (blocked<W>(s)) {
    lo = std::min(g.Q, s.pl);
    hi = std::max(lo, std::min(g.Q, s.w - s.s + 1 + s.pl));
    for (int64_t r = 0; r < s.r; ++r) {
      const int64_t ih = p * s.sh + r * s.dil_h - s.pt;
      if (ih >= 0 && ih < s.h) rows.push_back(x + ((n * s.h + ih) * s.w - s.pl) * s.c), wrows.push_back(r * s.s * s.c);
    }
  }
  row_pixels<W>(g, false, x, bias, n, p, g.Q, lo, hi, rows, wrows, y + row * g.Q * s.c);
}

// Backward by data, one input row (n, h): dx[w][c] = sum over the taps that read (h, w) of
// dz[p][q][c] * w[tap][c] (a gather: every dx element is written once, by its row's item).
template <int W, class T>
[[gnu::always_inline]] inline void bwd_row_body(const Geo& g, const T* dz, T* dx, int64_t row) {
  const Shape& s = g.s;
  const int64_t n = row / s.h, h = row % s.h;
  std::vector<const T*> rows;  // the valid filter rows' dz rows, from column pl - (S - 1)
  std::vector<int64_t> wrows;
  int64_t lo = 0, hi = 0;      // the interior: columns w with w + pl - (S - 1) .. w + pl inside dz
  if (blocked<W>(s)) {
    lo = std::min(s.w, std::max<int64_t>(0, s.s - 1 - s.pl));
    hi = std::max(lo, std::min(s.w, g.Q - s.pl));
    for (int64_t r = 0; r < s.r; ++r) {
      const int64_t u = h + s.pt - r * s.dil_h;
      if (u >= 0 && u % s.sh == 0 && u / s.sh < g.P)
        rows.push_back(dz + ((n * g.P + u / s.sh) * g.Q + s.pl - (s.s - 1)) * s.c), wrows.push_back(r * s.s * s.c);
    }
  }
  row_pixels<W>(g, true, dz, nullptr, n, h, s.w, lo, hi, rows, wrows, dx + row * s.w * s.c);
}

// out[c] += sum_{i < count} a[i * sa + c] * b[i * sb + c] for c < cw: one tap's sum over a
// row's pixels, U registers at once (cw <= U * W), then single registers, then one by one.
template <int W, class T>
[[gnu::always_inline]] inline void dot_rows(const T* a, int64_t sa, const T* b, int64_t sb, int64_t count,
                                            int64_t cw, float* out) {
  using V = typename Lanes<W>::f;
  constexpr int64_t U = kChains;
  int64_t c = 0;
  if (cw == U * W) {
    V acc[U] = {};
    for (int64_t i = 0; i < count; ++i)
#pragma GCC unroll 4
      for (int64_t u = 0; u < U; ++u) acc[u] += load<W>(a + i * sa + u * W) * load<W>(b + i * sb + u * W);
#pragma GCC unroll 4
    for (int64_t u = 0; u < U; ++u) store<W>(out + u * W, load<W>(out + u * W) + acc[u]);
    return;
  }
  for (; c + W <= cw; c += W) {
    V acc = {};
    for (int64_t i = 0; i < count; ++i) acc += load<W>(a + i * sa + c) * load<W>(b + i * sb + c);
    store<W>(out + c, load<W>(out + c) + acc);
  }
  for (; c < cw; ++c)
    for (int64_t i = 0; i < count; ++i) out[c] += to_f32(a[i * sa + c]) * to_f32(b[i * sb + c]);
}

// Update, one output row (n, p) into fp32 partials part[tap][c] and pdb[c]: per block of U * W
// channels (its x and dz rows stay in L1), every tap summed over the pixels that read it.
template <int W, class T>
[[gnu::always_inline]] inline void upd_row_body(const Geo& g, const T* x, const T* dz, float* part, float* pdb,
                                                int64_t row) {
  const Shape& s = g.s;
  const int64_t n = row / g.P, p = row % g.P, C = s.c;
  const T* zrow = dz + row * g.Q * C;
  if (pdb)
    for (int64_t q = 0; q < g.Q; ++q)
      for (int64_t c = 0; c < C; ++c) pdb[c] += to_f32(zrow[q * C + c]);
  for (int64_t c0 = 0; c0 < C; c0 += kChains * W)
    for (int64_t r = 0; r < s.r; ++r) {
      const int64_t ih = p * s.sh + r * s.dil_h - s.pt;
      if (ih < 0 || ih >= s.h) continue;
      for (int64_t t = 0; t < s.s; ++t) {  // pixels q whose input column q * sw + t * dw - pl is inside
        const int64_t off = t * s.dil_w - s.pl;
        const int64_t q0 = std::max<int64_t>(0, ceil_div(-off, s.sw));
        const int64_t q1 = std::min(g.Q, off >= s.w ? 0 : ceil_div(s.w - off, s.sw));
        if (q1 <= q0) continue;
        dot_rows<W>(x + ((n * s.h + ih) * s.w + q0 * s.sw + off) * C + c0, s.sw * C, zrow + q0 * C + c0, C,
                    q1 - q0, std::min(kChains * W, C - c0), part + (r * s.s + t) * C + c0);
      }
    }
}

// The row functions per ISA (W channels a register): the bodies inlined into functions built
// for each target.
#define JB_DW_ROWS(SUFFIX, W, ATTR)                                                                      \
  template <class T>                                                                                     \
  ATTR void fwd_row_##SUFFIX(const Geo& g, const T* x, const float* b, T* y, int64_t row) {              \
    fwd_row_body<W, T>(g, x, b, y, row);                                                                 \
  }                                                                                                      \
  template <class T>                                                                                     \
  ATTR void bwd_row_##SUFFIX(const Geo& g, const T* dz, T* dx, int64_t row) {                            \
    bwd_row_body<W, T>(g, dz, dx, row);                                                                  \
  }                                                                                                      \
  template <class T>                                                                                     \
  ATTR void upd_row_##SUFFIX(const Geo& g, const T* x, const T* dz, float* part, float* pdb, int64_t row) { \
    upd_row_body<W, T>(g, x, dz, part, pdb, row);                                                        \
  }

JB_DW_ROWS(generic, 4, )
#if JB_X86
JB_DW_ROWS(avx2, 8, [[gnu::target("avx2,fma,f16c")]])
JB_DW_ROWS(avx512, 16, [[gnu::target("avx512f,avx512bw,avx512vl,avx512dq,fma")]])
#endif
#undef JB_DW_ROWS

// The ISA level of the row functions for the dispatch: 0 generic, 1 AVX2, 2 AVX-512.
int level(const Dispatch& dp) {
#if JB_X86
  if (dp.isa >= Isa::avx512) return 2;
  if (dp.isa >= Isa::avx2) return 1;
#endif
  (void)dp;
  return 0;
}

// The row function of a pass (NAME##_<isa><T>) for level lv.
#if JB_X86
#define JB_DW_PICK(NAME, T) (lv == 2 ? &NAME##_avx512<T> : lv == 1 ? &NAME##_avx2<T> : &NAME##_generic<T>)
#else
#define JB_DW_PICK(NAME, T) ((void)lv, &NAME##_generic<T>)
#endif

// The weights in fp32, kept alive by the job.
const float* weights_f32(Job& job, const void* w, DType w_dt, int64_t n) {
  auto wf = std::make_shared<std::vector<float>>(static_cast<size_t>(n));
  with_type(w_dt, [&](auto ts) {
    using T = decltype(ts);
    for (int64_t i = 0; i < n; ++i) (*wf)[size_t(i)] = to_f32(static_cast<const T*>(w)[i]);
  });
  const float* data = wf->data();
  job.keep.push_back(std::move(wf));
  return data;
}

// pass(g, lv, T{}): the weights in fp32, the pass's view of the shape, the ISA level and the
// compute dtype.
template <class Pass>
void with_weights(Job& job, const Dispatch& dp, const Shape& s, const void* w, DType w_dt, Pass&& pass) {
  const Geo g{s, s.p(), s.q(), weights_f32(job, w, w_dt, s.r * s.s * s.c)};
  with_type(s.dt, [&](auto ts) { pass(g, level(dp), ts); });
}

}  // namespace

bool depthwise(const Shape& s) { return s.groups > 1 && s.groups == s.c && s.groups == s.k; }

void depthwise_forward(Job& job, int64_t, const Dispatch& dp, const Shape& s, const void* x, const void* w,
                       DType w_dt, const float* bias, void* y, void* z) {
  void* out = s.act == Activation::gelu ? z : y;  // the pre-activation, then the activation over the row
  const Isa isa = dp.isa;
  with_weights(job, dp, s, w, w_dt, [&](const Geo& g, int lv, auto ts) {
    using T = decltype(ts);
    const auto fn = JB_DW_PICK(fwd_row, T);
    T* ot = static_cast<T*>(out);
    job.add(s.n * g.P, [g, fn, x, bias, ot, y, isa](int64_t row) {
      const Shape& s = g.s;
      fn(g, static_cast<const T*>(x), bias, ot, row);
      if (s.act != Activation::none)
        eltwise::activate(s.act, s.dt, ot + row * g.Q * s.c, static_cast<T*>(y) + row * g.Q * s.c, g.Q * s.c, isa);
    });
  });
}

void depthwise_backward(Job& job, int64_t, const Dispatch& dp, const Shape& s, const void* dz, const void* w,
                        DType w_dt, void* dx) {
  with_weights(job, dp, s, w, w_dt, [&](const Geo& g, int lv, auto ts) {
    using T = decltype(ts);
    const auto fn = JB_DW_PICK(bwd_row, T);
    job.add(s.n * s.h, [g, fn, dz, dx](int64_t row) { fn(g, static_cast<const T*>(dz), static_cast<T*>(dx), row); });
  });
}

void depthwise_update(Job& job, int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
                      void* dw, DType dw_dt, float* db) {
  const Geo g{s, s.p(), s.q(), nullptr};
  const int64_t rows = s.n * g.P, welems = s.r * s.s * s.c;
  // Splits of the rows, each with its own fp32 partials (dw then db), summed at the end.
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(rows, 4 * threads));
  const int64_t per = welems + (db ? s.c : 0);
  float* part = reinterpret_cast<float*>(job_scratch<1>(job, {size_t(splits * per) * sizeof(float)})[0]);
  const int lv = level(dp);
  with_type(s.dt, [&](auto ts) {
    using T = decltype(ts);
    const T* xt = static_cast<const T*>(x);
    const T* zt = static_cast<const T*>(dz);
    const auto fn = JB_DW_PICK(upd_row, T);
    job.add(splits, [g, fn, xt, zt, part, per, welems, rows, splits, db](int64_t sp) {
      float* pw = part + sp * per;
      float* pdb = db ? pw + welems : nullptr;
      std::memset(pw, 0, size_t(per) * sizeof(float));
      for (int64_t row = rows * sp / splits; row < rows * (sp + 1) / splits; ++row) fn(g, xt, zt, pw, pdb, row);
    });
  });
  job.add(ceil_div(per, 1024), [part, per, splits, welems, db, dw, dw_dt](int64_t i) {
    for (int64_t e = i * 1024; e < std::min(per, (i + 1) * 1024); ++e) {
      float acc = 0;
      for (int64_t sp = 0; sp < splits; ++sp) acc += part[sp * per + e];
      if (e >= welems) db[e - welems] = acc;
      else if (dw_dt == DType::f32) static_cast<float*>(dw)[e] = acc;
      else static_cast<uint16_t*>(dw)[e] = f32_to_bf16(acc);
    }
  });
}

}  // namespace jb::conv
