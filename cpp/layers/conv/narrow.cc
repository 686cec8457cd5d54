// Narrow feature groups with the pixels in the vector lanes (narrow.h). A work item is a band
// of output rows of one image. It keeps the input rows its current output row reads in a
// ring (L2), each transposed to [column phase][channel (pair)][column] (zeros in the
// padding columns, bf16 pairs kept as 32-bit words: the VNNI layout). For every output row
// and group one BRGEMM call (A: the group's packed weights [r][s][out][in]; B: the ring's
// rows, tap (r, s) at its row and column offset; batch: the taps of the rows inside the
// input) writes an fp32 tile [channel][pixel], and the row goes back transposed, with bias
// and activation. The ring is one transposed row per filter row: all groups' rows of a
// ResNeXt stage stay in L2 together (a copy per filter column, for longer batch elements,
// tripled it and ran out of Zen 3's 512 KiB). fp32 groups of exactly 8 output channels on
// AVX2 fill a register with the channels instead (EightLanes below).
#include "layers/conv/narrow.h"

#include <memory>
#include <optional>
#include <vector>

#if JB_X86
#include <immintrin.h>
#endif

#include "layers/common/eltwise.h"
#include "layers/common/lanes.h"
#include "layers/common/operand.h"
#include "layers/common/plan_cache.h"
#include "layers/common/scratch.h"
#include "layers/common/target.h"
#include "layers/common/work.h"
#include "layers/conv/depthwise.h"
#include "layers/conv/direct.h"
#include "layers/conv/transpose.h"

namespace jb::conv {

namespace {

constexpr int64_t kNarrow = 8;             // groups at most this wide (output channels) go here
constexpr int64_t kMaxTaps = 256;          // filter taps (the batch's offset tables are on the stack)

// The convolution the engine runs: the forward, or the backward by data as a forward of dz.
struct Geo {
  int64_t n, hin, win, cin, ci;  // input; ci, co: channels of one group
  int64_t hout, wout, cout, co;
  int64_t groups, r, s, sh, sw, dh, dw, pt, pl;  // pads of either sign
};

struct NarrowPlan : MultiplyPath {
  NarrowPlan(const Geo& g0, DType dt, const Dispatch& dp, int64_t threads) : MultiplyPath(dt, dp), g(g0) {
    eight = dt == DType::f32 && isa == Isa::avx2 && g.co == 8;
    epw = vnni ? 2 : 1;
    words = g.cin / epw;
    wpad = (g.wout - 1) * g.sw + (g.s - 1) * g.dw + 1;  // the padded columns the row reads
    wq = ceil_div(wpad, g.sw);
    ldw = round_up(wq, 16) + 4;  // + 4: rows not a multiple of 64 bytes apart
    phase_words = words * ldw;
    slot_words = g.sw * phase_words;
    er = (g.r - 1) * g.dh + 1;
    ldq = round_up(g.wout, 16);
    // Bands of rows: as long as possible (the ring's rows are transposed once), as many as
    // keep every thread busy.
    bands = std::min(g.hout, ceil_div(4 * threads, g.n));
    band = ceil_div(g.hout, bands);
    bands = ceil_div(g.hout, band);
    items = g.n * bands;
    lease_bytes = Scratch::aligned(size_t(er * slot_words + 64) * 4) +
                  Scratch::aligned(size_t(g.cout * ldq) * sizeof(float));
    eight_slot = g.groups * wpad * g.ci;
    if (eight) lease_bytes = Scratch::aligned(size_t(er * eight_slot) * sizeof(float));
    w_bytes = size_t(g.groups * g.r * g.s * g.co * g.ci) * mul_bytes;
    // A: the group's [r][s][out][in]; B: a ring row's [in][pixel] at the tap's column.
    BrgemmDesc d = desc(g.ci, g.ci, g.wout, ldq);
    d.m = g.co;
    d.n = g.wout;
    d.ldb = ldw * epw;
    kern.emplace(d, isa);
  }

  Geo g;
  bool eight = false;  // fp32 groups of 8 output channels on AVX2: EightLanes
  int64_t wpad = 0, eight_slot = 0;  // padded columns a row reads; EightLanes ring floats a row
  int64_t epw = 1, words = 0, wq = 0, ldw = 0, phase_words = 0, slot_words = 0, er = 1, ldq = 0;
  int64_t band = 1, bands = 1, items = 0;
  size_t lease_bytes = 0, w_bytes = 0;
  std::optional<Brgemm> kern;
};

PlanCache<26, NarrowPlan> forward_plans, backward_plans;

// The output tile (fp32 [channel][pixel], ldq) into an NHWC row of T with the bias added.
template <class T>
void out_scalar(const float* yt, int64_t ldq, int64_t q0, int64_t q1, int64_t c0, int64_t c1,
                const float* bias, T* orow, int64_t cout) {
  for (int64_t q = q0; q < q1; ++q)
    for (int64_t c = c0; c < c1; ++c)
      orow[q * cout + c] = from_f32<T>(yt[c * ldq + q] + (bias ? bias[c] : 0.0f));
}

#if JB_X86
template <class T>
JB_TARGET_AVX2 void out_avx2(const float* yt, int64_t ldq, int64_t wout, int64_t cout, const float* bias,
                             T* orow) {
  const int64_t q8 = wout / 8 * 8, c8 = cout / 8 * 8;
  for (int64_t c = 0; c < c8; c += 8) {
    const __m256 b = bias ? _mm256_loadu_ps(bias + c) : _mm256_setzero_ps();
    for (int64_t q = 0; q < q8; q += 8) {
      __m256 v[8];
      for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(yt + (c + i) * ldq + q);
      transpose8(v);
      for (int i = 0; i < 8; ++i) {
        const __m256 o = _mm256_add_ps(v[i], b);
        if constexpr (sizeof(T) == 4) {
          _mm256_storeu_ps(reinterpret_cast<float*>(orow + (q + i) * cout + c), o);
        } else {  // round to nearest even as f32_to_bf16 (NaN: quiet)
          const __m256i u = _mm256_castps_si256(o);
          const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
          __m256i h = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
          const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                                 _mm256_set1_epi32(0x7f800000));
          h = _mm256_blendv_epi8(h, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
          const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(orow + (q + i) * cout + c), packed);
        }
      }
    }
  }
  out_scalar(yt, ldq, q8, wout, 0, c8, bias, orow, cout);
  out_scalar(yt, ldq, 0, wout, c8, cout, bias, orow, cout);
}
#endif

#if JB_X86
// Groups of exactly 8 output channels, fp32, AVX2: the channels of a group fill the lanes
// (a BRGEMM tile would too, but K = C / G = 8 a call), the weights are one vector per
// (tap, input channel), and the input pixels are broadcast from a ring of input rows
// regrouped to [group][padded column][channel]: a group's pixels contiguous (in NHWC with
// 2^k channels they sit 2^k floats apart, on a few L1 sets) and zeros in the padding.
// Per output row and group, tiles of up to 12 pixels (12 accumulators, 13 loads for 12
// FMAs) sum every tap, then add the bias and store into the NHWC row. Weights packed
// [group][r][s][in][out].
struct EightLanes {
  using V = Lanes<8>::f;

  // Pixels [q0, q0 + PB) of output row o, group f; ring: the padded rows' slots.
  template <int PB>
  static JB_INLINE void tile(const NarrowPlan& p, const float* ring, const float* wt, const float* bias, int64_t o,
                             int64_t f, int64_t q0, float* orow) {
    const Geo& g = p.g;
    V acc[PB] = {};
    for (int64_t r = 0; r < g.r; ++r) {
      const int64_t hr = o * g.sh + r * g.dh;
      if (hr < g.pt || hr >= g.pt + g.hin) continue;  // a padding row
      const float* xr = ring + hr % p.er * p.eight_slot + (f * p.wpad + q0 * g.sw) * g.ci;
      for (int64_t t = 0; t < g.s; ++t) {
        const float* w = wt + (r * g.s + t) * g.ci * 8;
        const float* xt = xr + t * g.dw * g.ci;
        for (int64_t c = 0; c < g.ci; ++c) {
          const V wv = load<8>(w + c * 8);
#pragma GCC unroll 12
          for (int i = 0; i < PB; ++i) acc[i] += xt[i * g.sw * g.ci + c] * wv;
        }
      }
    }
    const V b = bias ? load<8>(bias + f * 8) : V{};
#pragma GCC unroll 12
    for (int i = 0; i < PB; ++i) store<8>(orow + (q0 + i) * g.cout + f * 8, acc[i] + b);
  }

  // Output row o into orow (NHWC, bias added), in tiles of 12 pixels.
  static JB_INLINE void run(const NarrowPlan& p, const float* ring, const float* wt, const float* bias, int64_t o,
                            float* orow) {
    const Geo& g = p.g;
    for (int64_t f = 0; f < g.groups; ++f) {
      const float* wf = wt + f * g.r * g.s * g.ci * 8;
      int64_t q0 = 0;
      for (; q0 + 12 <= g.wout; q0 += 12) tile<12>(p, ring, wf, bias, o, f, q0, orow);
      switch (g.wout - q0) {
        case 11: tile<11>(p, ring, wf, bias, o, f, q0, orow); break;
        case 10: tile<10>(p, ring, wf, bias, o, f, q0, orow); break;
        case 9: tile<9>(p, ring, wf, bias, o, f, q0, orow); break;
        case 8: tile<8>(p, ring, wf, bias, o, f, q0, orow); break;
        case 7: tile<7>(p, ring, wf, bias, o, f, q0, orow); break;
        case 6: tile<6>(p, ring, wf, bias, o, f, q0, orow); break;
        case 5: tile<5>(p, ring, wf, bias, o, f, q0, orow); break;
        case 4: tile<4>(p, ring, wf, bias, o, f, q0, orow); break;
        case 3: tile<3>(p, ring, wf, bias, o, f, q0, orow); break;
        case 2: tile<2>(p, ring, wf, bias, o, f, q0, orow); break;
        case 1: tile<1>(p, ring, wf, bias, o, f, q0, orow); break;
        default: break;
      }
    }
  }
};
#endif

// One input row into the transposed row: per column phase, words x wq (rows ldw apart),
// zeros in the padding columns.
template <class S, class D>
void transpose_row(const S* src, D* dst, const NarrowPlan& p) {
  const Geo& g = p.g;
  for (int64_t ph = 0; ph < g.sw; ++ph, dst += p.phase_words) {
    const int64_t j_lo = std::min(p.wq, std::max<int64_t>(0, ceil_div(g.pl - ph, g.sw)));
    const int64_t j_hi = std::max(j_lo, std::min(p.wq, ceil_div(g.win + g.pl - ph, g.sw)));
    for (int64_t c = 0; c < p.words; ++c) {
      std::fill(dst + c * p.ldw, dst + c * p.ldw + j_lo, D(0));
      std::fill(dst + c * p.ldw + j_hi, dst + c * p.ldw + p.wq, D(0));
    }
    if (j_hi == j_lo) continue;
    words(p.isa, src + (j_lo * g.sw + ph - g.pl) * p.words, g.sw * p.words, j_hi - j_lo, p.words, dst + j_lo, p.ldw);
  }
}

// Padded input row hr of image xi into its ring slot as [group][padded column][channel],
// zeros in the padding (EightLanes; rows of padding are never read).
inline void regroup_row(const NarrowPlan& p, const float* xi, int64_t hr, float* ring) {
  const Geo& g = p.g;
  const int64_t ih = hr - g.pt;
  if (ih < 0 || ih >= g.hin) return;
  float* slot = ring + hr % p.er * p.eight_slot;
  const float* src = xi + ih * g.win * g.cin;
  for (int64_t f = 0; f < g.groups; ++f)
    for (int64_t j = 0; j < p.wpad; ++j) {
      const int64_t iw = j - g.pl;
      float* d = slot + (f * p.wpad + j) * g.ci;
      if (iw < 0 || iw >= g.win) std::fill(d, d + g.ci, 0.0f);
      else copy_floats(src + iw * g.cin + f * g.ci, g.ci, d);
    }
}

// Runs the engine: x (n, hin, win, cin) in dtype dt; pack(wt) writes the packed weights; y
// (and z for gelu) (n, hout, wout, cout).
// Phases of `job`: the weights packed, then the items. The job keeps the plan alive.
template <class Pack>
void add(Job& job, int64_t threads, std::shared_ptr<const NarrowPlan> plan, DType dt, Activation act, const void* x,
         Pack pack, const float* bias, void* y, void* z) {
  const NarrowPlan* pp = plan.get();
  job.keep.push_back(std::move(plan));
  const int64_t conc = std::max<int64_t>(1, std::min(threads, pp->items));
  const auto buf = job_scratch<2>(job, {pp->w_bytes, pp->lease_bytes * size_t(conc)});
  char* wt = buf[0];
  job.add(1, [pack, wt](int64_t) { pack(wt); });
  auto leases = std::make_shared<PanelPool>(buf[1], pp->lease_bytes, conc);
  PanelPool* pool = leases.get();
  job.keep.push_back(std::move(leases));
  job.add(pp->items, [pp, dt, act, x, wt, pool, bias, y, z](int64_t item) {
    const NarrowPlan& p = *pp;
    const Geo& g = p.g;
    const bool gelu = act == Activation::gelu;
    void* out = gelu ? z : y;
    const size_t mb = p.mul_bytes;
    const int64_t ciw = g.ci / p.epw;
#if JB_X86
    if (p.eight) {
      const PanelPool::Lease l(*pool);
      float* ring = reinterpret_cast<float*>(l.data);
      const int64_t img = item / p.bands, p0 = item % p.bands * p.band, p1 = std::min(g.hout, p0 + p.band);
      const float* xi = static_cast<const float*>(x) + img * g.hin * g.win * g.cin;
      int64_t next = p0 * g.sh;  // the next padded row to regroup
      for (int64_t o = p0; o < p1; ++o) {
        for (int64_t hr = std::max(next, o * g.sh); hr < o * g.sh + p.er; ++hr) regroup_row(p, xi, hr, ring);
        next = o * g.sh + p.er;
        float* orow = static_cast<float*>(out) + (img * g.hout + o) * g.wout * g.cout;
        target::Variants<EightLanes>::avx2(p, ring, reinterpret_cast<const float*>(wt), bias, o, orow);
        if (act != Activation::none)
          eltwise::activate(act, dt, orow, static_cast<float*>(y) + (img * g.hout + o) * g.wout * g.cout,
                            g.wout * g.cout, p.isa);
      }
      return;
    }
#endif
    const PanelPool::Lease l(*pool);
    uint32_t* ring = reinterpret_cast<uint32_t*>(l.data);  // er rows, [phase][in][column]
    float* yt = reinterpret_cast<float*>(l.data + Scratch::aligned(size_t(p.er * p.slot_words + 64) * 4));
    const int64_t img = item / p.bands, p0 = item % p.bands * p.band, p1 = std::min(g.hout, p0 + p.band);
    with_type(dt, [&](auto ts) {
      using T = decltype(ts);
      // Padded input row hr, transposed, into its ring slot (rows of padding are never read).
      auto load = [&](int64_t hr) {
        const int64_t ih = hr - g.pt;
        if (ih < 0 || ih >= g.hin) return;
        const T* src = static_cast<const T*>(x) + (img * g.hin + ih) * g.win * g.cin;
        uint32_t* slot = ring + hr % p.er * p.slot_words;
        if (p.vnni) transpose_row(reinterpret_cast<const uint32_t*>(src), slot, p);
        else transpose_row(src, reinterpret_cast<float*>(slot), p);
      };
      int64_t next = p0 * g.sh;  // the next padded row to load
      int64_t offs_a[kMaxTaps], offs_b[kMaxTaps];
      for (int64_t o = p0; o < p1; ++o) {
        for (int64_t hr = std::max(next, o * g.sh); hr < o * g.sh + p.er; ++hr) load(hr);
        next = o * g.sh + p.er;
        int64_t taps = 0;  // of the filter rows inside the input
        for (int64_t r = 0; r < g.r; ++r) {
          const int64_t hr = o * g.sh + r * g.dh;
          if (hr < g.pt || hr >= g.pt + g.hin) continue;
          for (int64_t t = 0; t < g.s; ++t, ++taps) {
            offs_a[taps] = (r * g.s + t) * g.co * g.ci;
            offs_b[taps] = (hr % p.er * p.slot_words + t * g.dw % g.sw * p.phase_words + t * g.dw / g.sw) * p.epw;
          }
        }
        for (int64_t f = 0; f < g.groups; ++f)
          p.kern->offsets(wt + size_t(f * g.r * g.s * g.co * g.ci) * mb, offs_a, ring + f * ciw * p.ldw, offs_b,
                          taps, yt + f * g.co * p.ldq);
        // The tile back into the NHWC row: bias, then the activation on the row.
        T* orow = static_cast<T*>(out) + (img * g.hout + o) * g.wout * g.cout;
#if JB_X86
        if (p.isa >= Isa::avx2) out_avx2<T>(yt, p.ldq, g.wout, g.cout, bias, orow);
        else
#endif
          out_scalar<T>(yt, p.ldq, 0, g.wout, 0, g.cout, bias, orow, g.cout);
        if (act != Activation::none)
          eltwise::activate(act, dt, orow, static_cast<T*>(y) + (img * g.hout + o) * g.wout * g.cout,
                            g.wout * g.cout, p.isa);
      }
    });
  });
}

// The group's weights as A operands, [group][r][s][out][in] in the multiply dtype; flip: the
// backward's (taps reversed, in and out swapped).
void pack_weights(const Shape& s, const void* w, DType w_dt, const NarrowPlan& p, bool flip, char* dst) {
  const Geo& g = p.g;
  with_type(w_dt, [&](auto ws) {
    using W = decltype(ws);
    const W* src = static_cast<const W*>(w);
    for (int64_t f = 0; f < g.groups; ++f)
      for (int64_t r = 0; r < g.r; ++r)
        for (int64_t t = 0; t < g.s; ++t)
          for (int64_t m = 0; m < g.co; ++m)
            for (int64_t i = 0; i < g.ci; ++i) {
              // [out][in] for the ring's tiles, [in][out] for EightLanes
              const int64_t at = (((f * g.r + r) * g.s + t) * g.co * g.ci) + (p.eight ? i * g.co + m : m * g.ci + i);
              // HWIO: w[r][t][c in the group][k]
              const int64_t idx = flip ? (((g.r - 1 - r) * s.s + g.s - 1 - t) * s.cg() + m) * s.k + f * s.kg() + i
                                       : ((r * s.s + t) * s.cg() + i) * s.k + f * s.kg() + m;
              const float v = to_f32(src[idx]);
              if (p.vnni) reinterpret_cast<uint16_t*>(dst)[at] = f32_to_bf16(v);
              else reinterpret_cast<float*>(dst)[at] = v;
            }
  });
}

bool lanes_fill(int64_t pixels, int64_t in_channels, const Shape& s, const Dispatch& dp) {
  // bf16 pairs of input channels must not straddle two groups
  return pixels >= 8 && s.r * s.s <= kMaxTaps && (multiply_dtype(s.dt, dp) == DType::f32 || in_channels % 2 == 0);
}

}  // namespace

bool narrow_forward_fits(const Shape& s, const Dispatch& dp) {
  return s.groups > 1 && !depthwise(s) && s.kg() <= kNarrow && lanes_fill(s.q(), s.cg(), s, dp);
}

bool narrow_backward_fits(const Shape& s, const Dispatch& dp) {
  return s.groups > 1 && !depthwise(s) && s.cg() <= kNarrow && s.sh == 1 && s.sw == 1 &&
         lanes_fill(s.w, s.kg(), s, dp);
}

void narrow_forward(Job& job, int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* w,
                    DType w_dt, const float* bias, void* y, void* z) {
  auto plan = forward_plans.get(key_of(s, 0, threads, dp, nullptr), [&] {
    const Geo g{s.n, s.h, s.w, s.c, s.cg(), s.p(), s.q(), s.k, s.kg(),
                s.groups, s.r, s.s, s.sh, s.sw, s.dil_h, s.dil_w, s.pt, s.pl};
    return NarrowPlan(g, s.dt, dp, threads);
  });
  const NarrowPlan* p = plan.get();
  add(job, threads, std::move(plan), s.dt, s.act, x,
      [s, w, w_dt, p](char* wt) { pack_weights(s, w, w_dt, *p, false, wt); }, bias, y, z);
}

void narrow_backward(Job& job, int64_t threads, const Dispatch& dp, const Shape& s, const void* dz, const void* w,
                     DType w_dt, void* dx) {
  // dx[h][w] = sum over taps of dz[h + pt - r dh][w + pl - t dw] w[r][t]: a forward of dz
  // with the taps reversed, pads (R - 1) dh - pt and (S - 1) dw - pl.
  auto plan = backward_plans.get(key_of(s, 0, threads, dp, nullptr), [&] {
    const Geo g{s.n, s.p(), s.q(), s.k, s.kg(), s.h, s.w, s.c, s.cg(),
                s.groups, s.r, s.s, 1, 1, s.dil_h, s.dil_w, (s.r - 1) * s.dil_h - s.pt, (s.s - 1) * s.dil_w - s.pl};
    return NarrowPlan(g, s.dt, dp, threads);
  });
  const NarrowPlan* p = plan.get();
  add(job, threads, std::move(plan), s.dt, Activation::none, dz,
      [s, w, w_dt, p](char* wt) { pack_weights(s, w, w_dt, *p, true, wt); }, nullptr, dx, nullptr);
}

}  // namespace jb::conv
