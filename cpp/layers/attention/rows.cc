// The portable row loops and the choice of the ISA's.
#include "layers/attention/rows.h"

#include "layers/attention/row_loops.h"

namespace jb::attention {

namespace {

const detail::RowFns& fns(Isa isa) {
  static const detail::RowFns base = row_fns<Scalar>();
#if defined(JB_X86)
  static const detail::RowFns avx2 = detail::rows_avx2(), avx512 = detail::rows_avx512();
  if (isa >= Isa::avx512) return avx512;
  if (isa == Isa::avx2) return avx2;
#endif
  (void)isa;
  return base;
}

}  // namespace

void softmax_forward(const ScoreTile& t, float* m, float* l, float* alpha, void* p, int64_t ldp,
                     DType pt, Isa isa) {
  (pt == DType::f32 ? fns(isa).forward_f32 : fns(isa).forward_bf16)(t, m, l, alpha, p, ldp);
}

void softmax_backward(const ScoreTile& t, float* dp, int64_t lddp, const float* m,
                      const float* inv_l, const float* d, float* dbias, int64_t lddb, Isa isa) {
  fns(isa).backward(t, dp, lddp, m, inv_l, d, dbias, lddb);
}

void softmax_tangent(const ScoreTile& t, const float* ts_a, const float* ts_b, int64_t ldts, const float* tbias,
                     const float* m, const float* inv_l, float* c, void* z, void* w, int64_t ldz, DType pt, Isa isa) {
  (pt == DType::f32 ? fns(isa).tangent_f32 : fns(isa).tangent_bf16)(t, ts_a, ts_b, ldts, tbias, m, inv_l, c, z, w,
                                                                    ldz);
}

void store_rows(const float* x, int64_t ldx, const float* scale, int64_t rows, int64_t cols, void* y, int64_t ldy,
                DType dt, Isa isa) {
  fns(isa).store(x, ldx, scale, rows, cols, y, ldy, dt);
}

void row_dots(const void* a, const void* b, int64_t ld, int64_t rows, int64_t n, DType dt, float* d, Isa isa) {
  fns(isa).dots(a, b, ld, rows, n, dt, d);
}

}  // namespace jb::attention
