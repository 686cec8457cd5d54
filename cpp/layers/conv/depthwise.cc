// Depthwise convolutions (feature groups == C == K): every channel reduces over its own taps
// only, so there is no GEMM to batch-reduce (a BRGEMM per channel is 1 wide). Here the
// channels go in the vector lanes and the taps accumulate in fp32 over a chunk of channels
// of one pixel; the passes are memory-bound. Each inner loop is built per ISA (target
// attributes on row functions, chosen by the dispatch), so JAX_BRGEMM_ISA still applies.
#include "layers/conv/depthwise.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "layers/common/eltwise.h"
#include "layers/common/operand.h"
#include "layers/common/scratch.h"

#if JB_X86
#include <immintrin.h>
#endif

namespace jb::conv {

namespace {

constexpr int64_t kChunk = 256;  // channels accumulated at once (fp32 on the stack)

struct Geo {  // one pass's view of the shape; wf: the weights in fp32, [tap][c]
  Shape s;  // a copy: jobs run after the caller's frame is gone
  int64_t P, Q;
  const float* wf;
};

// Forward, one output row (n, p): y[q][c] = bias[c] + sum_taps x[ih][iw][c] * w[tap][c].
template <class T>
[[gnu::always_inline]] inline void fwd_row_body(const Geo& g, const T* x, const float* bias, T* y, int64_t row) {
  const Shape& s = g.s;
  const int64_t n = row / g.P, p = row % g.P, C = s.c;
  for (int64_t q = 0; q < g.Q; ++q)
    for (int64_t c0 = 0; c0 < C; c0 += kChunk) {
      const int64_t cw = std::min(kChunk, C - c0);
      float acc[kChunk];
      for (int64_t j = 0; j < cw; ++j) acc[j] = bias ? bias[c0 + j] : 0.0f;
      for (int64_t r = 0; r < s.r; ++r) {
        const int64_t ih = p * s.sh + r * s.dil_h - s.pt;
        if (ih < 0 || ih >= s.h) continue;
        for (int64_t t = 0; t < s.s; ++t) {
          const int64_t iw = q * s.sw + t * s.dil_w - s.pl;
          if (iw < 0 || iw >= s.w) continue;
          const T* xp = x + ((n * s.h + ih) * s.w + iw) * C + c0;
          const float* wp = g.wf + (r * s.s + t) * C + c0;
          for (int64_t j = 0; j < cw; ++j) acc[j] += to_f32(xp[j]) * wp[j];
        }
      }
      T* yp = y + (row * g.Q + q) * C + c0;
      for (int64_t j = 0; j < cw; ++j) yp[j] = from_f32<T>(acc[j]);
    }
}

// Backward by data, one input row (n, h): dx[w][c] = sum over the taps that read (h, w) of
// dz[p][q][c] * w[tap][c] (a gather: every dx element is written once, by its row's item).
template <class T>
[[gnu::always_inline]] inline void bwd_row_body(const Geo& g, const T* dz, T* dx, int64_t row) {
  const Shape& s = g.s;
  const int64_t n = row / s.h, h = row % s.h, C = s.c;
  for (int64_t w = 0; w < s.w; ++w)
    for (int64_t c0 = 0; c0 < C; c0 += kChunk) {
      const int64_t cw = std::min(kChunk, C - c0);
      float acc[kChunk] = {};
      for (int64_t r = 0; r < s.r; ++r) {
        const int64_t u = h + s.pt - r * s.dil_h;
        if (u < 0 || u % s.sh || u / s.sh >= g.P) continue;
        for (int64_t t = 0; t < s.s; ++t) {
          const int64_t v = w + s.pl - t * s.dil_w;
          if (v < 0 || v % s.sw || v / s.sw >= g.Q) continue;
          const T* zp = dz + ((n * g.P + u / s.sh) * g.Q + v / s.sw) * C + c0;
          const float* wp = g.wf + (r * s.s + t) * C + c0;
          for (int64_t j = 0; j < cw; ++j) acc[j] += to_f32(zp[j]) * wp[j];
        }
      }
      T* xp = dx + ((n * s.h + h) * s.w + w) * C + c0;
      for (int64_t j = 0; j < cw; ++j) xp[j] = from_f32<T>(acc[j]);
    }
}

// Update, one output row (n, p) into fp32 partials part[tap][c] and pdb[c].
template <class T>
[[gnu::always_inline]] inline void upd_row_body(const Geo& g, const T* x, const T* dz, float* part, float* pdb,
                                                int64_t row) {
  const Shape& s = g.s;
  const int64_t n = row / g.P, p = row % g.P, C = s.c;
  for (int64_t q = 0; q < g.Q; ++q) {
    const T* zp = dz + (row * g.Q + q) * C;
    if (pdb)
      for (int64_t c = 0; c < C; ++c) pdb[c] += to_f32(zp[c]);
    for (int64_t r = 0; r < s.r; ++r) {
      const int64_t ih = p * s.sh + r * s.dil_h - s.pt;
      if (ih < 0 || ih >= s.h) continue;
      for (int64_t t = 0; t < s.s; ++t) {
        const int64_t iw = q * s.sw + t * s.dil_w - s.pl;
        if (iw < 0 || iw >= s.w) continue;
        const T* xp = x + ((n * s.h + ih) * s.w + iw) * C;
        float* dp = part + (r * s.s + t) * C;
        for (int64_t c = 0; c < C; ++c) dp[c] += to_f32(xp[c]) * to_f32(zp[c]);
      }
    }
  }
}

// The row functions per ISA: the bodies inlined into functions built for each target.
#define JB_DW_ROWS(SUFFIX, ATTR)                                                                         \
  template <class T>                                                                                     \
  ATTR void fwd_row_##SUFFIX(const Geo& g, const T* x, const float* b, T* y, int64_t row) {              \
    fwd_row_body<T>(g, x, b, y, row);                                                                    \
  }                                                                                                      \
  template <class T>                                                                                     \
  ATTR void bwd_row_##SUFFIX(const Geo& g, const T* dz, T* dx, int64_t row) {                            \
    bwd_row_body<T>(g, dz, dx, row);                                                                     \
  }                                                                                                      \
  template <class T>                                                                                     \
  ATTR void upd_row_##SUFFIX(const Geo& g, const T* x, const T* dz, float* part, float* pdb, int64_t row) { \
    upd_row_body<T>(g, x, dz, part, pdb, row);                                                           \
  }

JB_DW_ROWS(generic, )
#if JB_X86
JB_DW_ROWS(avx2, [[gnu::target("avx2,fma,f16c")]])
JB_DW_ROWS(avx512, [[gnu::target("avx512f,avx512bw,avx512vl,avx512dq,fma")]])
#endif
#undef JB_DW_ROWS

#if JB_X86
// AVX-512 rows for channels in whole blocks of 16: one register per (pixel, block) summed over
// the pixel's valid taps, found once per pixel (at most kTaps). The loops above keep their sums
// on the stack, a load and a store per FMA.
constexpr int64_t kTaps = 64;
#define JB_AVX512 [[gnu::target("avx512f,avx512bw,avx512vl,avx512dq,fma")]]

template <class T>
JB_AVX512 inline __m512 load16(const T* p) {
  if constexpr (sizeof(T) == 4) return _mm512_loadu_ps(p);
  else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

template <class T>
JB_AVX512 inline void store16(T* p, __m512 v) {
  if constexpr (sizeof(T) == 4) {
    _mm512_storeu_ps(p, v);
  } else {  // round to nearest even, NaN quiet: f32_to_bf16's bits
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i h = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    h = _mm512_mask_mov_epi32(h, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(h));
  }
}

// Per pixel, its valid taps as (activation offset, weight offset) pairs, then every block.
template <class T>
JB_AVX512 void fwd_row_v16(const Geo& g, const T* x, const float* bias, T* y, int64_t row) {
  const Shape& s = g.s;
  const int64_t n = row / g.P, p = row % g.P, C = s.c;
  int64_t xo[kTaps], wo[kTaps];
  for (int64_t q = 0; q < g.Q; ++q) {
    int64_t nt = 0;
    for (int64_t r = 0; r < s.r; ++r) {
      const int64_t ih = p * s.sh + r * s.dil_h - s.pt;
      if (ih < 0 || ih >= s.h) continue;
      for (int64_t t = 0; t < s.s; ++t) {
        const int64_t iw = q * s.sw + t * s.dil_w - s.pl;
        if (iw < 0 || iw >= s.w) continue;
        xo[nt] = ((n * s.h + ih) * s.w + iw) * C, wo[nt++] = (r * s.s + t) * C;
      }
    }
    T* yp = y + (row * g.Q + q) * C;
    for (int64_t c0 = 0; c0 < C; c0 += 16) {
      __m512 acc = bias ? _mm512_loadu_ps(bias + c0) : _mm512_setzero_ps();
      for (int64_t i = 0; i < nt; ++i)
        acc = _mm512_fmadd_ps(load16(x + xo[i] + c0), _mm512_loadu_ps(g.wf + wo[i] + c0), acc);
      store16(yp + c0, acc);
    }
  }
}

template <class T>
JB_AVX512 void bwd_row_v16(const Geo& g, const T* dz, T* dx, int64_t row) {
  const Shape& s = g.s;
  const int64_t n = row / s.h, h = row % s.h, C = s.c;
  int64_t zo[kTaps], wo[kTaps];
  for (int64_t w = 0; w < s.w; ++w) {
    int64_t nt = 0;
    for (int64_t r = 0; r < s.r; ++r) {
      const int64_t u = h + s.pt - r * s.dil_h;
      if (u < 0 || u % s.sh || u / s.sh >= g.P) continue;
      for (int64_t t = 0; t < s.s; ++t) {
        const int64_t v = w + s.pl - t * s.dil_w;
        if (v < 0 || v % s.sw || v / s.sw >= g.Q) continue;
        zo[nt] = ((n * g.P + u / s.sh) * g.Q + v / s.sw) * C, wo[nt++] = (r * s.s + t) * C;
      }
    }
    T* xp = dx + ((n * s.h + h) * s.w + w) * C;
    for (int64_t c0 = 0; c0 < C; c0 += 16) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < nt; ++i)
        acc = _mm512_fmadd_ps(load16(dz + zo[i] + c0), _mm512_loadu_ps(g.wf + wo[i] + c0), acc);
      store16(xp + c0, acc);
    }
  }
}
#undef JB_AVX512
#endif

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

// The forward's and backward's row function: the AVX-512 register rows when the channels
// come in whole blocks of 16.
#if JB_X86
bool vector_rows(const Shape& s, int lv) { return lv == 2 && s.c % 16 == 0 && s.r * s.s <= kTaps; }
#define JB_DW_ROW(NAME, T) (vector_rows(s, lv) ? &NAME##_v16<T> : JB_DW_PICK(NAME, T))
#else
#define JB_DW_ROW(NAME, T) JB_DW_PICK(NAME, T)
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
    const auto fn = JB_DW_ROW(fwd_row, T);
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
    const auto fn = JB_DW_ROW(bwd_row, T);
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
