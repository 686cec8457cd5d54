// The weight update of narrow feature groups (narrow.h) with the pixels in the vector lanes.
// For one group, dw[r][s][c][k] = sum over the output pixels of x at the tap's input pixel
// times dz: a dot product along the output rows. An item transposes the padded input rows
// and the dz rows of its images (or band of rows) to [channel][pixel] in fp32 (bf16 widened:
// exact products; or bf16 pairs of pixels for vdpbf16ps where the dispatch multiplies bf16
// that way), a few groups at a time so that they stay in L2, and a register tile of
// CB input x KB output channels sums one tap's products over all those rows, W pixels a
// register, before its lanes are added up. In a row's last register the lanes past Q are
// masked off in x: the input columns there are real pixels the tap never multiplies (an Inf
// there must not turn dz's zero padding into NaN). Each item keeps fp32 partials of dw; a
// last loop sums them in item order, so the result does not depend on the scheduling.
// fp32 groups of exactly 8 output channels on AVX2 put the channels in the lanes instead
// (EightLanes below).
#include <algorithm>
#include <cstring>
#include <memory>

#if JB_X86
#include <immintrin.h>
#endif

#include "layers/common/lanes.h"
#include "layers/common/operand.h"
#include "layers/common/plan_cache.h"
#include "layers/common/scratch.h"
#include "layers/common/target.h"
#include "layers/common/work.h"
#include "layers/conv/depthwise.h"
#include "layers/conv/direct.h"
#include "layers/conv/narrow.h"
#include "layers/conv/transpose.h"

namespace jb::conv {

namespace {

constexpr int64_t kBudget = 384 << 10;  // transposed rows an item keeps at once (bytes, L2)

struct UpdatePlan;
using TilesFn = void (*)(const UpdatePlan&, const void*, const void*, int64_t, int64_t, int64_t, int64_t, float*);

struct UpdatePlan {
  UpdatePlan(const Shape& s0, const Dispatch& dp, int64_t threads);

  Shape s;
  Isa isa;
  bool dot = false;    // bf16 pairs of pixels multiplied by vdpbf16ps (else fp32 lanes)
  bool eight = false;  // fp32 groups of 8 output channels on AVX2: EightLanes, no transposes
  int64_t P, Q, cg, kg, lanes, nv, ldz, wq, ldx;      // lanes: pixels a register holds
  int64_t band = 1, bands = 1, units = 1, items = 1;  // a unit: the rows [band * b, ...) of one image
  int64_t ub = 1, gchunk = 1;                         // units and groups transposed at once
  int64_t rb = 1;                                     // EightLanes: output rows of a block
  int64_t xunit = 0, zunit = 0, tmp = 0;              // elements of a unit's x and dz rows; fp32 staging
  size_t lease_bytes = 0;
  TilesFn tiles = nullptr;

  int64_t rows_of(int64_t unit) const { return std::min(band, P - unit % bands * band); }
};

// The products of one register of pixels: fp32 lanes (W pixels; bf16 data widened).
template <int W>
struct LaneOps {
  using E = float;  // the transposed rows' element
  using V = typename Lanes<W>::f;
  using M = typename Lanes<W>::u;
  static constexpr int kPixels = W;
  static JB_INLINE V load_x(const E* p, const M* mask) {
    const V v = load<W>(p);
    return mask ? (V)((M)v & *mask) : v;
  }
  static JB_INLINE V load_z(const E* p) { return load<W>(p); }
  static JB_INLINE void madd(V& acc, V x, V z) { acc += x * z; }
  static JB_INLINE float sum(V acc) {
    float t = 0;
    for (int l = 0; l < W; ++l) t += acc[l];
    return t;
  }
  static JB_INLINE M mask(int64_t first, int64_t q) {  // pixels first + l < q
    M m;
    for (int l = 0; l < W; ++l) m[l] = first + l < q ? ~0u : 0u;
    return m;
  }
};

#if JB_X86
#define JB_TARGET_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
// bf16 pairs of neighbouring pixels: vdpbf16ps sums both products of a pair into one fp32 lane.
struct DotOps {
  using E = uint16_t;
  using V = __m512;
  using M = __m512i;
  static constexpr int kPixels = 32;
  static JB_TARGET_DOT JB_INLINE __m512i load_x(const E* p, const M* mask) {
    const __m512i v = _mm512_loadu_si512(p);
    return mask ? _mm512_and_si512(v, *mask) : v;
  }
  static JB_TARGET_DOT JB_INLINE __m512i load_z(const E* p) { return _mm512_loadu_si512(p); }
  static JB_TARGET_DOT JB_INLINE void madd(V& acc, __m512i x, __m512i z) {
    acc = _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)z);
  }
  static JB_TARGET_DOT JB_INLINE float sum(V acc) { return _mm512_reduce_add_ps(acc); }
  static JB_TARGET_DOT JB_INLINE M mask(int64_t first, int64_t q) {
    alignas(64) uint16_t m[32];
    for (int l = 0; l < 32; ++l) m[l] = first + l < q ? 0xffff : 0;
    return _mm512_load_si512(m);
  }
};
#endif

// One group chunk's products: xb, zb hold units [u0, u0 + nb) of groups [g0, g0 + gn),
// x as [unit][padded row][phase][gi * cg + c][ldx], dz as [unit][row][gi * kg + k][ldz]. A tile
// of CB x KB accumulators (CB + KB operands in registers) per tap and channel block. Defined
// under a target attribute (ATTR): the bf16 tiles' intrinsics may only inline into it.
#define JB_TILES_BODY(NAME, ATTR)                                                                           \
  template <class Ops, int CB, int KB>                                                                      \
  ATTR JB_INLINE void NAME##_step(const typename Ops::E* x, int64_t ldx, const typename Ops::E* z,           \
                                  int64_t ldz, const typename Ops::M* mask, typename Ops::V (&acc)[CB][KB]) {  \
    decltype(Ops::load_z(z)) a[CB], b[KB];                                                                  \
    _Pragma("GCC unroll 4") for (int i = 0; i < CB; ++i) a[i] = Ops::load_x(x + i * ldx, mask);             \
    _Pragma("GCC unroll 4") for (int j = 0; j < KB; ++j) b[j] = Ops::load_z(z + j * ldz);                   \
    _Pragma("GCC unroll 4") for (int i = 0; i < CB; ++i)                                                    \
      _Pragma("GCC unroll 4") for (int j = 0; j < KB; ++j) Ops::madd(acc[i][j], a[i], b[j]);                \
  }                                                                                                         \
  template <class Ops, int CB, int KB>                                                                      \
  ATTR JB_INLINE void NAME(const UpdatePlan& p, const void* xv, const void* zv, int64_t g0, int64_t gn,     \
                           int64_t u0, int64_t nb, float* part) {                                           \
    using E = typename Ops::E;                                                                              \
    const E* xb = static_cast<const E*>(xv);                                                                \
    const E* zb = static_cast<const E*>(zv);                                                                \
    const Shape& s = p.s;                                                                                   \
    constexpr int W = Ops::kPixels;                                                                         \
    const typename Ops::M tail = Ops::mask((p.nv - 1) * W, p.Q);                                            \
    const int64_t xrow = p.gchunk * p.cg * p.ldx, zrow = p.gchunk * p.kg * p.ldz; /* a row's stride */      \
    for (int64_t gi = 0; gi < gn; ++gi)                                                                     \
      for (int64_t r = 0; r < s.r; ++r)                                                                     \
        for (int64_t t = 0; t < s.s; ++t) {                                                                 \
          const int64_t ph = t * s.dil_w % s.sw, js = t * s.dil_w / s.sw;                                   \
          for (int64_t c0 = 0; c0 < p.cg; c0 += CB)                                                         \
            for (int64_t k0 = 0; k0 < p.kg; k0 += KB) {                                                     \
              typename Ops::V acc[CB][KB] = {};                                                             \
              for (int64_t ui = 0; ui < nb; ++ui) {                                                         \
                const E* xu = xb + ui * p.xunit + (r * s.dil_h * s.sw + ph) * xrow + (gi * p.cg + c0) * p.ldx + js; \
                const E* zu = zb + ui * p.zunit + (gi * p.kg + k0) * p.ldz;                                 \
                for (int64_t o = 0, rows = p.rows_of(u0 + ui); o < rows; ++o) {                             \
                  const E* xr = xu + o * s.sh * s.sw * xrow;                                                \
                  const E* zr = zu + o * zrow;                                                              \
                  int64_t v = 0;                                                                            \
                  for (; v + 1 < p.nv; ++v) NAME##_step<Ops>(xr + v * W, p.ldx, zr + v * W, p.ldz, nullptr, acc); \
                  NAME##_step<Ops>(xr + v * W, p.ldx, zr + v * W, p.ldz, &tail, acc);                       \
                }                                                                                           \
              }                                                                                             \
              for (int64_t i = 0; i < std::min<int64_t>(CB, p.cg - c0); ++i)                                \
                for (int64_t j = 0; j < std::min<int64_t>(KB, p.kg - k0); ++j)                              \
                  part[((r * s.s + t) * p.cg + c0 + i) * s.k + (g0 + gi) * p.kg + k0 + j] +=                \
                      Ops::sum(acc[i][j]);                                                                  \
            }                                                                                               \
        }                                                                                                   \
  }

JB_TILES_BODY(tiles_body, )
#if JB_X86
JB_TILES_BODY(tiles_dot_body, JB_TARGET_DOT)
#endif
#undef JB_TILES_BODY

template <int W, int CB, int KB>
struct Tiles {
  static JB_INLINE void run(const UpdatePlan& p, const void* xb, const void* zb, int64_t g0, int64_t gn,
                            int64_t u0, int64_t nb, float* part) {
    tiles_body<LaneOps<W>, CB, KB>(p, xb, zb, g0, gn, u0, nb, part);
  }
};

#if JB_X86
JB_TARGET_DOT void tiles_dot(const UpdatePlan& p, const void* xb, const void* zb, int64_t g0, int64_t gn,
                             int64_t u0, int64_t nb, float* part) {
  tiles_dot_body<DotOps, 4, 4>(p, xb, zb, g0, gn, u0, nb, part);
}
#endif

// Groups of exactly 8 output channels (ResNeXt's), fp32, AVX2: the group's output channels
// fill the lanes, dz's pixel is one load, x's channels are broadcast, both straight from
// NHWC (no transposes; regrouping a block of rows first was slower, docs/experiments.md).
// A tile of up to 3 taps x 4 input channels (12 accumulators, 13 loads for 12 FMAs) sums
// the pixels of a block of output rows for one filter row, then adds into the item's
// partials.
struct EightLanes {
  using V = Lanes<8>::f;

  template <int TB, int CB, bool EDGE>
  static JB_INLINE void pixels(const float* xr, const float* zr, const Shape& s, int64_t t0, int64_t q0, int64_t q1,
                               V (&acc)[TB][CB]) {
    for (int64_t q = q0; q < q1; ++q) {
      const V z = load<8>(zr + q * s.k);
#pragma GCC unroll 4
      for (int tb = 0; tb < TB; ++tb) {
        const int64_t iw = q * s.sw + (t0 + tb) * s.dil_w - s.pl;
        if (EDGE && (iw < 0 || iw >= s.w)) continue;
        const float* xp = xr + iw * s.c;
#pragma GCC unroll 4
        for (int cb = 0; cb < CB; ++cb) acc[tb][cb] += xp[cb] * z;
      }
    }
  }

  // Taps [t0, t0 + TB) of filter row r, input channels [c0, c0 + CB) of the group, over
  // output rows [o0, o1): x at the image's first pixel, group channel c0; dz at the image's
  // first pixel, the group's first channel; cell at dw[r][t0][c0][the group's first k].
  template <int TB, int CB>
  static JB_INLINE void tile(const float* x, const float* dz, const Shape& s, int64_t o0, int64_t o1, int64_t r,
                             int64_t t0, float* cell) {
    V acc[TB][CB] = {};
    // per row: the pixels whose taps all fall inside it, then the others with a check
    const int64_t q = s.q();
    const int64_t lo = std::clamp<int64_t>(ceil_div(s.pl - t0 * s.dil_w, s.sw), 0, q);
    const int64_t hi = std::clamp<int64_t>(ceil_div(s.w + s.pl - (t0 + TB - 1) * s.dil_w, s.sw), lo, q);
    for (int64_t o = o0; o < o1; ++o) {
      const int64_t ih = o * s.sh + r * s.dil_h - s.pt;
      if (ih < 0 || ih >= s.h) continue;
      const float* xr = x + ih * s.w * s.c;
      const float* zr = dz + o * q * s.k;
      pixels<TB, CB, true>(xr, zr, s, t0, 0, lo, acc);
      pixels<TB, CB, false>(xr, zr, s, t0, lo, hi, acc);
      pixels<TB, CB, true>(xr, zr, s, t0, hi, q, acc);
    }
#pragma GCC unroll 4
    for (int tb = 0; tb < TB; ++tb)
#pragma GCC unroll 4
      for (int cb = 0; cb < CB; ++cb) {
        float* c = cell + (tb * s.cg() + cb) * s.k;
        store<8>(c, load<8>(c) + acc[tb][cb]);
      }
  }

  template <int TB>
  static JB_INLINE void taps(const float* x, const float* dz, const Shape& s, int64_t o0, int64_t o1, int64_t r,
                             int64_t t0, float* cell) {
    int64_t c0 = 0;
    for (; c0 + 4 <= s.cg(); c0 += 4) tile<TB, 4>(x + c0, dz, s, o0, o1, r, t0, cell + c0 * s.k);
    switch (s.cg() - c0) {
      case 3: tile<TB, 3>(x + c0, dz, s, o0, o1, r, t0, cell + c0 * s.k); break;
      case 2: tile<TB, 2>(x + c0, dz, s, o0, o1, r, t0, cell + c0 * s.k); break;
      case 1: tile<TB, 1>(x + c0, dz, s, o0, o1, r, t0, cell + c0 * s.k); break;
      default: break;
    }
  }

  // Adds to the partials [r][s][c][k] the products of output rows [o0, o0 + rows) of image
  // img, in blocks of rb rows whose x and dz stay in L2 while every group reads them.
  static JB_INLINE void run(const Shape& s, const float* x, const float* dz, int64_t img, int64_t o0, int64_t rows,
                            int64_t rb, float* part) {
    x += img * s.h * s.w * s.c;
    dz += img * s.p() * s.q() * s.k;
    for (int64_t ob = o0; ob < o0 + rows; ob += rb) {
      const int64_t oe = std::min(o0 + rows, ob + rb);
      for (int64_t g = 0; g < s.groups; ++g)
        for (int64_t r = 0; r < s.r; ++r)
          for (int64_t t0 = 0; t0 < s.s; t0 += 3) {
            const float* xg = x + g * s.cg();
            const float* zg = dz + g * 8;
            float* cell = part + (r * s.s + t0) * s.cg() * s.k + g * 8;
            switch (std::min<int64_t>(3, s.s - t0)) {
              case 3: taps<3>(xg, zg, s, ob, oe, r, t0, cell); break;
              case 2: taps<2>(xg, zg, s, ob, oe, r, t0, cell); break;
              default: taps<1>(xg, zg, s, ob, oe, r, t0, cell); break;
            }
          }
    }
  }
};

// The tiles for the plan's ISA and path, and the pixels a register holds.
TilesFn pick_tiles(Isa isa, bool dot, int64_t* lanes) {
#if JB_X86
  if (dot) return *lanes = DotOps::kPixels, &tiles_dot;
  if (isa >= Isa::avx512) return *lanes = 16, &target::Variants<Tiles<16, 4, 4>>::avx512;
  if (isa == Isa::avx2) return *lanes = 8, &target::Variants<Tiles<8, 2, 4>>::avx2;
#endif
  (void)isa, (void)dot;
  return *lanes = 4, &target::Variants<Tiles<4, 2, 4>>::baseline;
}

UpdatePlan::UpdatePlan(const Shape& s0, const Dispatch& dp, int64_t threads)
    : s(s0), isa(dp.isa), P(s0.p()), Q(s0.q()), cg(s0.cg()), kg(s0.kg()) {
  // vdpbf16ps where the dispatch multiplies bf16 natively without AMX (Zen 4: at the fp32
  // FMA's rate per instruction, two products a lane); fp32 lanes elsewhere.
  dot = s.dt == DType::bf16 && isa == Isa::avx512 && dp.bf16_multiply == DType::bf16;
  eight = s.dt == DType::f32 && isa == Isa::avx2 && kg == 8;
  if (eight) {  // its blocks: x's and dz's rows within 256 KiB (L2)
    const int64_t row_bytes = (s.sh * s.w * s.c + Q * s.k) * 4;
    rb = std::clamp<int64_t>(((256 << 10) - (s.er() - 1) * s.w * s.c * 4) / row_bytes, 1, P);
  }
  tiles = pick_tiles(isa, dot, &lanes);
  nv = ceil_div(Q, lanes);
  ldz = nv * lanes;
  wq = ceil_div((Q - 1) * s.sw + (s.s - 1) * s.dil_w + 1, s.sw);
  ldx = std::max(wq, (s.s - 1) * s.dil_w / s.sw + ldz);
  // Bands of rows only when there are too few images to keep every thread busy.
  const int64_t want = 2 * std::max<int64_t>(1, threads);
  if (s.n < want) {
    bands = std::min(P, ceil_div(want, s.n));
    band = ceil_div(P, bands);
    bands = ceil_div(P, band);
  } else {
    band = P;
  }
  units = s.n * bands;
  items = std::min(units, want);
  // Per group and unit, the rows its tiles read; groups enough for whole 8 x 8 transposes,
  // units as many as the budget holds (each register tile sums over all of them), then groups.
  const int64_t xrows = (band - 1) * s.sh + s.er();
  const int64_t eb = dot ? 2 : 4;  // bytes of a transposed element
  const int64_t per = (xrows * s.sw * cg * ldx + band * kg * ldz) * eb;
  gchunk = std::min(s.groups, ceil_div(8, std::min<int64_t>(cg, kg)));
  ub = std::clamp<int64_t>(kBudget / (gchunk * per), 1, ceil_div(units, items));
  gchunk = std::clamp<int64_t>(kBudget / (ub * per), gchunk, s.groups);
  xunit = xrows * s.sw * gchunk * cg * ldx;
  zunit = band * gchunk * kg * ldz;
  tmp = dot ? gchunk * std::max(cg * ldx, kg * ldz) : 0;  // a block of rows in fp32, then narrowed
  // slack: a tile's rows past the chunk's last channel (discarded accumulators) stay inside
  lease_bytes = Scratch::aligned(size_t(ub * (xunit + zunit) + 4 * (ldx + ldz)) * size_t(eb)) + size_t(tmp) * 4;
}

PlanCache<26, UpdatePlan> plans;

// A block of transposed rows into the lease: fp32 as it is, or narrowed to bf16 (exact: the
// values came from bf16), on AVX-512 (the only ISA of the bf16 path).
struct Narrow {
  static JB_INLINE void run(const float* src, uint16_t* dst, int64_t count) {
    for (int64_t i = 0; i < count; ++i) {
      uint32_t u;
      std::memcpy(&u, src + i, 4);
      dst[i] = uint16_t(u >> 16);
    }
  }
};

void emit(const UpdatePlan& p, const float* rows, int64_t count, void* lease, int64_t at) {
#if JB_X86
  if (p.dot) target::Variants<Narrow>::avx512(rows, static_cast<uint16_t*>(lease) + at, count);
#endif
  (void)p, (void)rows, (void)count, (void)lease, (void)at;  // fp32: written in place
}

// Units [u0, u0 + nb) of groups [g0, g0 + gn) transposed into the lease (see tiles_body);
// `stage`: where the bf16 path writes a block of rows in fp32 first.
template <class T>
void transpose_units(const UpdatePlan& p, const T* x, const T* dz, int64_t g0, int64_t gn, int64_t u0, int64_t nb,
                     void* xb, void* zb, float* stage) {
  const Shape& s = p.s;
  const int64_t xrow = p.gchunk * p.cg * p.ldx, zrow = p.gchunk * p.kg * p.ldz;
  auto block = [&](void* base, int64_t at) { return p.dot ? stage : static_cast<float*>(base) + at; };
  for (int64_t ui = 0; ui < nb; ++ui) {
    const int64_t unit = u0 + ui, img = unit / p.bands, o0 = unit % p.bands * p.band, rows = p.rows_of(unit);
    for (int64_t hr = 0; hr < (rows - 1) * s.sh + s.er(); ++hr) {
      const int64_t ih = o0 * s.sh + hr - s.pt;
      for (int64_t ph = 0; ph < s.sw; ++ph) {
        const int64_t at = ui * p.xunit + (hr * s.sw + ph) * xrow, count = gn * p.cg * p.ldx;
        float* d = block(xb, at);
        const int64_t j_lo = std::clamp<int64_t>(ceil_div(s.pl - ph, s.sw), 0, p.wq);
        const int64_t j_hi = std::clamp<int64_t>(ceil_div(s.w + s.pl - ph, s.sw), j_lo, p.wq);
        if (ih < 0 || ih >= s.h || j_hi == j_lo) {
          std::memset(d, 0, size_t(count) * sizeof(float));
        } else {
          for (int64_t c = 0; c < gn * p.cg; ++c) {
            std::fill(d + c * p.ldx, d + c * p.ldx + j_lo, 0.0f);
            std::fill(d + c * p.ldx + j_hi, d + (c + 1) * p.ldx, 0.0f);
          }
          words(p.isa, x + ((img * s.h + ih) * s.w + j_lo * s.sw + ph - s.pl) * s.c + g0 * p.cg, s.sw * s.c,
                j_hi - j_lo, gn * p.cg, d + j_lo, p.ldx);
        }
        emit(p, d, count, xb, at);
      }
    }
    for (int64_t o = 0; o < rows; ++o) {
      const int64_t at = ui * p.zunit + o * zrow, count = gn * p.kg * p.ldz;
      float* d = block(zb, at);
      words(p.isa, dz + ((img * p.P + o0 + o) * p.Q) * s.k + g0 * p.kg, s.k, p.Q, gn * p.kg, d, p.ldz);
      for (int64_t k = 0; k < gn * p.kg; ++k) std::fill(d + k * p.ldz + p.Q, d + (k + 1) * p.ldz, 0.0f);
      emit(p, d, count, zb, at);
    }
  }
}

}  // namespace

bool narrow_update_fits(const Shape& s, const Dispatch&) {
  return s.groups > 1 && !depthwise(s) && s.kg() <= 8 && s.q() >= 8;
}

void narrow_update(Job& job, int64_t threads, const Dispatch& dp, const Shape& s, const void* x, const void* dz,
                   void* dw, DType dw_dt, float* db) {
  auto plan = plans.get(key_of(s, 0, threads, dp, nullptr), [&] { return UpdatePlan(s, dp, threads); });
  const UpdatePlan* p = plan.get();
  job.keep.push_back(std::move(plan));
  const int64_t welems = s.r * s.s * s.cg() * s.k, conc = std::min(std::max<int64_t>(1, threads), p->items);
  const auto buf = job_scratch<2>(job, {size_t(p->items * welems) * sizeof(float), p->lease_bytes * size_t(conc)});
  float* parts = reinterpret_cast<float*>(buf[0]);
  auto leases = std::make_shared<PanelPool>(buf[1], p->lease_bytes, conc);
  PanelPool* pool = leases.get();
  job.keep.push_back(std::move(leases));
  // The items, then db's columns (64 a piece, summed from dz in place).
  static constexpr int64_t kDbCols = 64;
  const int64_t ndb = db ? ceil_div(s.k, kDbCols) : 0;
  job.add(p->items + ndb, [p, x, dz, db, parts, pool, welems](int64_t i) {
    const Shape& s = p->s;
    if (i >= p->items) {
      const int64_t j0 = (i - p->items) * kDbCols, width = std::min(kDbCols, s.k - j0);
      float acc[kDbCols] = {};
      add_column_sums(at(dz, s.dt, j0), s.dt, s.k, s.n * p->P * p->Q, width, acc);
      std::memcpy(db + j0, acc, size_t(width) * sizeof(float));
      return;
    }
    float* part = parts + i * welems;
    std::memset(part, 0, size_t(welems) * sizeof(float));
    const int64_t first = p->units * i / p->items, last = p->units * (i + 1) / p->items;
#if JB_X86
    if (p->eight) {
      for (int64_t u = first; u < last; ++u)
        target::Variants<EightLanes>::avx2(s, static_cast<const float*>(x), static_cast<const float*>(dz),
                                           u / p->bands, u % p->bands * p->band, p->rows_of(u), p->rb, part);
      return;
    }
#endif
    const PanelPool::Lease l(*pool);
    const size_t eb = p->dot ? 2 : 4;
    char* xb = l.data;
    char* zb = xb + size_t(p->ub * p->xunit) * eb;
    float* stage = reinterpret_cast<float*>(l.data + p->lease_bytes - size_t(p->tmp) * 4);
    with_type(s.dt, [&](auto ts) {
      using T = decltype(ts);
      for (int64_t u0 = first; u0 < last; u0 += p->ub) {
        const int64_t nb = std::min(p->ub, last - u0);
        for (int64_t g0 = 0; g0 < s.groups; g0 += p->gchunk) {
          const int64_t gn = std::min(p->gchunk, s.groups - g0);
          transpose_units(*p, static_cast<const T*>(x), static_cast<const T*>(dz), g0, gn, u0, nb, xb, zb, stage);
          p->tiles(*p, xb, zb, g0, gn, u0, nb, part);
        }
      }
    });
  });
  // The items' partials summed in item order.
  const int64_t items = p->items;
  job.add(ceil_div(welems, 4096), [parts, items, welems, dw, dw_dt](int64_t c) {
    for (int64_t e = c * 4096; e < std::min(welems, (c + 1) * 4096); ++e) {
      float acc = 0;
      for (int64_t i = 0; i < items; ++i) acc += parts[i * welems + e];
      if (dw_dt == DType::f32) static_cast<float*>(dw)[e] = acc;
      else static_cast<uint16_t*>(dw)[e] = f32_to_bf16(acc);
    }
  });
}

}  // namespace jb::conv
