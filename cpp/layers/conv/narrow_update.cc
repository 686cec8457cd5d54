// The weight update of narrow feature groups (narrow.h) with the pixels in the vector lanes.
// For one group, dw[r][s][c][k] = sum over the output pixels of x at the tap's input pixel
// times dz: a dot product along the output rows. An item transposes the padded input rows
// and the dz rows of its images (or band of rows) to [channel][pixel] in fp32 (bf16 widened:
// exact products), a few groups at a time so that they stay in L2, and a register tile of
// CB input x KB output channels sums one tap's products over all those rows, W pixels a
// register, before its lanes are added up. In a row's last register the lanes past Q are
// masked off in x: the input columns there are real pixels the tap never multiplies (an Inf
// there must not turn dz's zero padding into NaN). Each item keeps fp32 partials of dw; a
// last loop sums them in item order, so the result does not depend on the scheduling.
#include <algorithm>
#include <cstring>
#include <memory>

#include "layers/common/lanes.h"
#include "layers/common/operand.h"
#include "layers/common/plan_cache.h"
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
using TilesFn = void (*)(const UpdatePlan&, const float*, const float*, int64_t, int64_t, int64_t, int64_t, float*);

struct UpdatePlan {
  UpdatePlan(const Shape& s0, const Dispatch& dp, int64_t threads);

  Shape s;
  Isa isa;
  int64_t P, Q, cg, kg, lanes, nv, ldz, wq, ldx;
  int64_t band = 1, bands = 1, units = 1, items = 1;  // a unit: the rows [band * b, ...) of one image
  int64_t ub = 1, gchunk = 1;                         // units and groups transposed at once
  int64_t xunit = 0, zunit = 0;                       // floats of a unit's x and dz rows in a lease
  size_t lease_bytes = 0;
  TilesFn tiles = nullptr;

  int64_t rows_of(int64_t unit) const { return std::min(band, P - unit % bands * band); }
};

// acc[i][j] += x row i * dz row j over W pixels (x's lanes masked when `mask` is given).
template <int W, int CB, int KB>
JB_INLINE void fma_step(const float* x, int64_t ldx, const float* z, int64_t ldz, const typename Lanes<W>::u* mask,
                        typename Lanes<W>::f (&acc)[CB][KB]) {
  using V = typename Lanes<W>::f;
  using M = typename Lanes<W>::u;
  V xv[CB], zv[KB];
#pragma GCC unroll 4
  for (int i = 0; i < CB; ++i) {
    xv[i] = load<W>(x + i * ldx);
    if (mask) xv[i] = (V)((M)xv[i] & *mask);
  }
#pragma GCC unroll 4
  for (int j = 0; j < KB; ++j) zv[j] = load<W>(z + j * ldz);
#pragma GCC unroll 4
  for (int i = 0; i < CB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < KB; ++j) acc[i][j] += xv[i] * zv[j];
}

// One group chunk's products: xb, zb hold units [u0, u0 + nb) of groups [g0, g0 + gn),
// x as [unit][padded row][phase][gi * cg + c][ldx], dz as [unit][row][gi * kg + k][ldz].
template <int W, int CB, int KB>
JB_INLINE void tiles_body(const UpdatePlan& p, const float* xb, const float* zb, int64_t g0, int64_t gn,
                          int64_t u0, int64_t nb, float* part) {
  using V = typename Lanes<W>::f;
  using M = typename Lanes<W>::u;
  const Shape& s = p.s;
  M tail;
  for (int l = 0; l < W; ++l) tail[l] = (p.nv - 1) * W + l < p.Q ? ~0u : 0u;
  const int64_t xrow = p.gchunk * p.cg * p.ldx, zrow = p.gchunk * p.kg * p.ldz;  // a row's stride
  for (int64_t gi = 0; gi < gn; ++gi)
    for (int64_t r = 0; r < s.r; ++r)
      for (int64_t t = 0; t < s.s; ++t) {
        const int64_t ph = t * s.dil_w % s.sw, js = t * s.dil_w / s.sw;
        for (int64_t c0 = 0; c0 < p.cg; c0 += CB)
          for (int64_t k0 = 0; k0 < p.kg; k0 += KB) {
            V acc[CB][KB] = {};
            for (int64_t ui = 0; ui < nb; ++ui) {
              const float* xu = xb + ui * p.xunit + (r * s.dil_h * s.sw + ph) * xrow + (gi * p.cg + c0) * p.ldx + js;
              const float* zu = zb + ui * p.zunit + (gi * p.kg + k0) * p.ldz;
              for (int64_t o = 0, rows = p.rows_of(u0 + ui); o < rows; ++o) {
                const float* xr = xu + o * s.sh * s.sw * xrow;
                const float* zr = zu + o * zrow;
                int64_t v = 0;
                for (; v + 1 < p.nv; ++v) fma_step<W, CB, KB>(xr + v * W, p.ldx, zr + v * W, p.ldz, nullptr, acc);
                fma_step<W, CB, KB>(xr + v * W, p.ldx, zr + v * W, p.ldz, &tail, acc);
              }
            }
            for (int64_t i = 0; i < std::min<int64_t>(CB, p.cg - c0); ++i)
              for (int64_t j = 0; j < std::min<int64_t>(KB, p.kg - k0); ++j) {
                float sum = 0;
                for (int l = 0; l < W; ++l) sum += acc[i][j][l];
                part[((r * s.s + t) * p.cg + c0 + i) * s.k + (g0 + gi) * p.kg + k0 + j] += sum;
              }
          }
      }
}

template <int W, int CB, int KB>
struct Tiles {
  static JB_INLINE void run(const UpdatePlan& p, const float* xb, const float* zb, int64_t g0, int64_t gn,
                            int64_t u0, int64_t nb, float* part) {
    tiles_body<W, CB, KB>(p, xb, zb, g0, gn, u0, nb, part);
  }
};

// Lanes per register and the tile (CB x KB accumulators and CB + KB operands in registers).
TilesFn pick_tiles(Isa isa, int64_t* lanes) {
#if JB_X86
  if (isa >= Isa::avx512) return *lanes = 16, &target::Variants<Tiles<16, 4, 4>>::avx512;
  if (isa == Isa::avx2) return *lanes = 8, &target::Variants<Tiles<8, 2, 4>>::avx2;
#endif
  (void)isa;
  return *lanes = 4, &target::Variants<Tiles<4, 2, 4>>::baseline;
}

UpdatePlan::UpdatePlan(const Shape& s0, const Dispatch& dp, int64_t threads)
    : s(s0), isa(dp.isa), P(s0.p()), Q(s0.q()), cg(s0.cg()), kg(s0.kg()) {
  tiles = pick_tiles(isa, &lanes);
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
  const int64_t per = (xrows * s.sw * cg * ldx + band * kg * ldz) * int64_t(sizeof(float));
  gchunk = std::min(s.groups, ceil_div(8, std::min<int64_t>(cg, kg)));
  ub = std::clamp<int64_t>(kBudget / (gchunk * per), 1, ceil_div(units, items));
  gchunk = std::clamp<int64_t>(kBudget / (ub * per), gchunk, s.groups);
  xunit = xrows * s.sw * gchunk * cg * ldx;
  zunit = band * gchunk * kg * ldz;
  // slack: a tile's rows past the chunk's last channel (discarded accumulators) stay inside
  lease_bytes = size_t(ub * (xunit + zunit) + 4 * (ldx + ldz)) * sizeof(float);
}

PlanCache<25, UpdatePlan> plans;

// Units [u0, u0 + nb) of groups [g0, g0 + gn) transposed into the lease (see tiles_body).
template <class T>
void transpose_units(const UpdatePlan& p, const T* x, const T* dz, int64_t g0, int64_t gn, int64_t u0, int64_t nb,
                     float* xb, float* zb) {
  const Shape& s = p.s;
  const int64_t xrow = p.gchunk * p.cg * p.ldx, zrow = p.gchunk * p.kg * p.ldz;
  for (int64_t ui = 0; ui < nb; ++ui) {
    const int64_t unit = u0 + ui, img = unit / p.bands, o0 = unit % p.bands * p.band, rows = p.rows_of(unit);
    float* xu = xb + ui * p.xunit;
    for (int64_t hr = 0; hr < (rows - 1) * s.sh + s.er(); ++hr) {
      const int64_t ih = o0 * s.sh + hr - s.pt;
      for (int64_t ph = 0; ph < s.sw; ++ph) {
        float* d = xu + (hr * s.sw + ph) * xrow;
        const int64_t j_lo = std::clamp<int64_t>(ceil_div(s.pl - ph, s.sw), 0, p.wq);
        const int64_t j_hi = std::clamp<int64_t>(ceil_div(s.w + s.pl - ph, s.sw), j_lo, p.wq);
        if (ih < 0 || ih >= s.h || j_hi == j_lo) {
          std::memset(d, 0, size_t(gn * p.cg * p.ldx) * sizeof(float));
          continue;
        }
        for (int64_t c = 0; c < gn * p.cg; ++c) {
          std::fill(d + c * p.ldx, d + c * p.ldx + j_lo, 0.0f);
          std::fill(d + c * p.ldx + j_hi, d + (c + 1) * p.ldx, 0.0f);
        }
        words(p.isa, x + ((img * s.h + ih) * s.w + j_lo * s.sw + ph - s.pl) * s.c + g0 * p.cg, s.sw * s.c,
              j_hi - j_lo, gn * p.cg, d + j_lo, p.ldx);
      }
    }
    float* zu = zb + ui * p.zunit;
    for (int64_t o = 0; o < rows; ++o) {
      float* d = zu + o * zrow;
      words(p.isa, dz + ((img * p.P + o0 + o) * p.Q) * s.k + g0 * p.kg, s.k, p.Q, gn * p.kg, d, p.ldz);
      for (int64_t k = 0; k < gn * p.kg; ++k) std::fill(d + k * p.ldz + p.Q, d + (k + 1) * p.ldz, 0.0f);
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
    const PanelPool::Lease l(*pool);
    float* xb = reinterpret_cast<float*>(l.data);
    float* zb = xb + p->ub * p->xunit;
    const int64_t first = p->units * i / p->items, last = p->units * (i + 1) / p->items;
    with_type(s.dt, [&](auto ts) {
      using T = decltype(ts);
      for (int64_t u0 = first; u0 < last; u0 += p->ub) {
        const int64_t nb = std::min(p->ub, last - u0);
        for (int64_t g0 = 0; g0 < s.groups; g0 += p->gchunk) {
          const int64_t gn = std::min(p->gchunk, s.groups - g0);
          transpose_units(*p, static_cast<const T*>(x), static_cast<const T*>(dz), g0, gn, u0, nb, xb, zb);
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
