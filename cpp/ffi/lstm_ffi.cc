// XLA FFI handlers of the LSTM layer (jb.lstm): thin wrappers that decode and validate the
// buffers, then call cpp/layers/lstm.
//
//   jb_lstm_fwd   x (N, T, C) | (T, N, C), w (C, 4K), r (K, 4K), bias (4K,) f32,
//                 c0 (N, K) f32, h0 (N, K), last_step (N,) s32 or (0,)
//                 -> y (x's layout, K features), c_T (N, K) f32, h_T (N, K) (row n's
//                    after step last_step[n] when given, else after T-1),
//                    gates (T, ceil(K / B), N, 4B, x's dtype; B = lstm::gate_block),
//                    cs (T, N, K) f32 and xh (x's layout,
//                    lstm::saved_width features, x's dtype) when training, else (0,) each
//                 attrs time_major, variant (0 automatic or 1 fused: the same forward),
//                 products (fp32 emulated from that many bf16 products, 0 exact; lstm.h)
//   jb_lstm_bptt  r (K, 4K), gates, cs, c0, dy (y's shape), dc_T (N, K) f32, dh_T (N, K),
//                 last_step (N,) s32 or (0,): where row n's dc_T, dh_T enter (else T-1)
//                 -> da (x's layout, lstm::da_width features: the first 4K, then padding),
//                    db (4K,) f32, dc0 (N, K) f32, dh0 (N, K)
//                 attrs time_major, products
//   jb_lstm_tangent  r (K, 4K), gates, cs, c0 (the forward's), tp0, tp1 (x's layout, 4K
//                 features, or (0,) for zero: the pre-activations' tangent but its
//                 recurrent part), tb (4K,) or (N, 4K) f32, tc0 (N, K) f32, th0 (N, K),
//                 last_step (N,) s32 or (0,)
//                 -> ty (x's layout, K features), tc_T (N, K) f32, th_T (N, K): forward mode
//                 attrs time_major, products
// x, y, h, dy, dh, da, tp, th and ty share the compute dtype (float32 or bfloat16); w and r are
// float32 or bfloat16 (cast inside the call).
#include <string>
#include <vector>

#include "ffi/ffi_common.h"
#include "layers/lstm/lstm.h"

namespace jb {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_util;

// x-like dims: (N, T, features) or time-major (T, N, features).
std::vector<int64_t> seq_dims(bool time_major, int64_t t, int64_t n, int64_t features) {
  return time_major ? std::vector<int64_t>{t, n, features} : std::vector<int64_t>{n, t, features};
}

// The optional per-row last steps: (N,), or (0,) for none (null).
ffi::ErrorOr<const int32_t*> last_steps(const char* op, const ffi::Buffer<ffi::S32>& last_step, int64_t n) {
  if (last_step.element_count() == 0 && n != 0) return static_cast<const int32_t*>(nullptr);
  const auto d = last_step.dimensions();
  if (d.size() != 1 || d[0] != n)
    return ffi::Unexpected(invalid(std::string(op) + ": last_step has shape " + dims_str(d) + ", expected (" +
                                   std::to_string(n) + ",) or (0,)"));
  return last_step.typed_data();
}

// The saved gates' dimensions (lstm.h).
std::vector<int64_t> gate_dims(const lstm::Shape& s) {
  const auto d = lstm::saved_gate_dims(s, dispatch());
  return {d.begin(), d.end()};
}

ffi::Error lstm_fwd(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer r, F32 bias, F32 c0,
                    ffi::AnyBuffer h0, ffi::Buffer<ffi::S32> last_step, ffi::Result<ffi::AnyBuffer> y, F32Out c_last,
                    ffi::Result<ffi::AnyBuffer> h_last, ffi::Result<ffi::AnyBuffer> gates, F32Out cs,
                    ffi::Result<ffi::AnyBuffer> xh, bool time_major, int32_t variant, int64_t products) {
  const char* op = "jb_lstm_fwd";
  JB_TRY(dt, kernel_dtype(op, {{"x", x.element_type()}}));
  JB_TRY(w_dt, kernel_dtype(op, {{"w", w.element_type()}, {"r", r.element_type()}}));
  // 0 lets the layer choose, 1 asks for the fused forward: the same, the only one there is.
  if (variant < 0 || variant > 1) return invalid("jb_lstm_fwd: unknown variant " + std::to_string(variant));
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 3 || wd.size() != 2) return invalid("jb_lstm_fwd: x needs rank 3 and w rank 2");
  const int64_t t = time_major ? xd[0] : xd[1], n = time_major ? xd[1] : xd[0], c = xd[2];
  if (wd[1] % 4) return invalid("jb_lstm_fwd: w " + dims_str(wd) + " must have 4K columns");
  const int64_t k = wd[1] / 4, g = 4 * k;
  JB_CHECK(expect_dims(op, "w", wd, {c, g}));
  JB_CHECK(expect_dims(op, "r", r.dimensions(), {k, g}));
  JB_CHECK(expect_dims(op, "bias", bias.dimensions(), {g}));
  JB_CHECK(expect_dims(op, "c0", c0.dimensions(), {n, k}));
  JB_CHECK(expect_dims(op, "h0", h0.dimensions(), {n, k}));
  JB_TRY(steps, last_steps(op, last_step, n));
  JB_CHECK(expect_dims(op, "y", y->dimensions(), seq_dims(time_major, t, n, k)));
  JB_CHECK(expect_dims(op, "c_last", c_last->dimensions(), {n, k}));
  JB_CHECK(expect_dims(op, "h_last", h_last->dimensions(), {n, k}));
  const bool save = gates->element_count() != 0 || cs->element_count() != 0 || xh->element_count() != 0;
  const lstm::Shape s{t, n, c, k, dt, time_major, products};
  if (save) {
    JB_CHECK(expect_dims(op, "gates", gates->dimensions(), gate_dims(s)));
    JB_CHECK(expect_dims(op, "cs", cs->dimensions(), {t, n, k}));
    JB_CHECK(expect_dims(op, "xh", xh->dimensions(), seq_dims(time_major, t, n, lstm::saved_width(s, dispatch()))));
  }
  JB_CHECK(expect_dtype(op, x.element_type(),
                        {{"h0", h0.element_type()}, {"y", y->element_type()}, {"h_last", h_last->element_type()},
                         {"gates", gates->element_type()}, {"xh", xh->element_type()}}));
  if (n == 0 || k == 0) return ffi::Error::Success();
  if (c == 0 && t > 0) return invalid("jb_lstm_fwd: x has no features (C = 0)");

  lstm::ForwardArgs a;
  a.x = view(x, dt);
  a.w = view(w, w_dt);
  a.r = view(r, w_dt);
  a.bias = bias.typed_data();
  a.c0 = c0.typed_data();
  a.h0 = view(h0, dt);
  a.y = view(y, dt);
  a.c_last = c_last->typed_data();
  a.h_last = view(h_last, dt);
  if (save) a.saved = {view(gates, dt), cs->typed_data(), view(xh, dt)};
  a.last_step = steps;
  const Executor ex = executor(pool);
  return guarded(op, [&] { lstm::forward(ex, dispatch(), s, a); });
}

ffi::Error lstm_bptt(ffi::ThreadPool pool, ffi::AnyBuffer r, ffi::AnyBuffer gates, F32 cs, F32 c0,
                     ffi::AnyBuffer dy, F32 dc_last, ffi::AnyBuffer dh_last, ffi::Buffer<ffi::S32> last_step,
                     ffi::Result<ffi::AnyBuffer> da,
                     F32Out db, F32Out dc0, ffi::Result<ffi::AnyBuffer> dh0, bool time_major,
                     int64_t products) {
  const char* op = "jb_lstm_bptt";
  JB_TRY(dt, kernel_dtype(op, {{"dy", dy.element_type()}}));
  JB_TRY(w_dt, kernel_dtype(op, {{"r", r.element_type()}}));
  const auto rd = r.dimensions(), yd = dy.dimensions();
  if (rd.size() != 2 || yd.size() != 3) return invalid("jb_lstm_bptt: r needs rank 2 and dy rank 3");
  const int64_t k = rd[0], g = 4 * k;
  const int64_t t = time_major ? yd[0] : yd[1], n = time_major ? yd[1] : yd[0];
  JB_CHECK(expect_dims(op, "r", rd, {k, g}));
  JB_CHECK(expect_dims(op, "dy", yd, seq_dims(time_major, t, n, k)));
  const lstm::Shape s{t, n, 0, k, dt, time_major, products};
  JB_CHECK(expect_dims(op, "gates", gates.dimensions(), gate_dims(s)));
  JB_CHECK(expect_dims(op, "cs", cs.dimensions(), {t, n, k}));
  JB_CHECK(expect_dims(op, "c0", c0.dimensions(), {n, k}));
  JB_CHECK(expect_dims(op, "dc_last", dc_last.dimensions(), {n, k}));
  JB_CHECK(expect_dims(op, "dh_last", dh_last.dimensions(), {n, k}));
  JB_TRY(steps, last_steps(op, last_step, n));
  JB_CHECK(expect_dims(op, "da", da->dimensions(), seq_dims(time_major, t, n, lstm::da_width(s))));
  JB_CHECK(expect_dims(op, "db", db->dimensions(), {g}));
  JB_CHECK(expect_dims(op, "dc0", dc0->dimensions(), {n, k}));
  JB_CHECK(expect_dims(op, "dh0", dh0->dimensions(), {n, k}));
  JB_CHECK(expect_dtype(op, dy.element_type(),
                        {{"gates", gates.element_type()}, {"dh_last", dh_last.element_type()},
                         {"da", da->element_type()}, {"dh0", dh0->element_type()}}));

  lstm::BpttArgs a;
  a.r = view(r, w_dt);
  a.gates = view(gates, dt);
  a.cs = cs.typed_data();
  a.c0 = c0.typed_data();
  a.dy = view(dy, dt);
  a.dc_last = dc_last.typed_data();
  a.dh_last = view(dh_last, dt);
  a.last_step = steps;
  a.da = view(da, dt);
  a.db = db->typed_data();
  a.dc0 = dc0->typed_data();
  a.dh0 = view(dh0, dt);
  const Executor ex = executor(pool);
  return guarded(op, [&] { lstm::bptt(ex, dispatch(), s, a); });
}

ffi::Error lstm_tangent(ffi::ThreadPool pool, ffi::AnyBuffer r, ffi::AnyBuffer gates, F32 cs, F32 c0,
                        ffi::AnyBuffer tp0, ffi::AnyBuffer tp1, F32 tb, F32 tc0, ffi::AnyBuffer th0,
                        ffi::Buffer<ffi::S32> last_step, ffi::Result<ffi::AnyBuffer> ty, F32Out tc_last,
                        ffi::Result<ffi::AnyBuffer> th_last, bool time_major, int64_t products) {
  const char* op = "jb_lstm_tangent";
  JB_TRY(dt, kernel_dtype(op, {{"ty", ty->element_type()}}));
  JB_TRY(w_dt, kernel_dtype(op, {{"r", r.element_type()}}));
  const auto rd = r.dimensions(), yd = ty->dimensions();
  if (rd.size() != 2 || yd.size() != 3) return invalid("jb_lstm_tangent: r needs rank 2 and ty rank 3");
  const int64_t k = rd[0], g = 4 * k;
  const int64_t t = time_major ? yd[0] : yd[1], n = time_major ? yd[1] : yd[0];
  JB_CHECK(expect_dims(op, "r", rd, {k, g}));
  JB_CHECK(expect_dims(op, "ty", yd, seq_dims(time_major, t, n, k)));
  const lstm::Shape s{t, n, 0, k, dt, time_major, products};
  JB_CHECK(expect_dims(op, "gates", gates.dimensions(), gate_dims(s)));
  JB_CHECK(expect_dims(op, "cs", cs.dimensions(), {t, n, k}));
  JB_CHECK(expect_dims(op, "c0", c0.dimensions(), {n, k}));
  const ffi::AnyBuffer* tps[2] = {&tp0, &tp1};
  for (int i = 0; i < 2; ++i)
    if (tps[i]->element_count() != 0)
      JB_CHECK(expect_dims(op, i ? "tp1" : "tp0", tps[i]->dimensions(), seq_dims(time_major, t, n, g)));
  const bool tb_rows = tb.dimensions().size() == 2;
  JB_CHECK(expect_dims(op, "tb", tb.dimensions(), tb_rows ? std::vector<int64_t>{n, g} : std::vector<int64_t>{g}));
  JB_CHECK(expect_dims(op, "tc0", tc0.dimensions(), {n, k}));
  JB_CHECK(expect_dims(op, "th0", th0.dimensions(), {n, k}));
  JB_TRY(steps, last_steps(op, last_step, n));
  JB_CHECK(expect_dims(op, "tc_last", tc_last->dimensions(), {n, k}));
  JB_CHECK(expect_dims(op, "th_last", th_last->dimensions(), {n, k}));
  JB_CHECK(expect_dtype(op, ty->element_type(),
                        {{"gates", gates.element_type()}, {"tp0", tp0.element_type()}, {"tp1", tp1.element_type()},
                         {"th0", th0.element_type()}, {"th_last", th_last->element_type()}}));

  lstm::TangentArgs a;
  a.r = view(r, w_dt);
  a.gates = view(gates, dt);
  a.cs = cs.typed_data();
  a.c0 = c0.typed_data();
  for (int i = 0; i < 2; ++i)
    if (tps[i]->element_count() != 0) a.tp[i] = view(*tps[i], dt);
  a.tb = tb.typed_data();
  a.tb_rows = tb_rows;
  a.tc0 = tc0.typed_data();
  a.th0 = view(th0, dt);
  a.last_step = steps;
  a.ty = view(ty, dt);
  a.tc_last = tc_last->typed_data();
  a.th_last = view(th_last, dt);
  const Executor ex = executor(pool);
  return guarded(op, [&] { lstm::tangent(ex, dispatch(), s, a); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_lstm_fwd, lstm_fwd, ffi_util::bind(lstm_fwd, "time_major", "variant", "products"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_lstm_bptt, lstm_bptt, ffi_util::bind(lstm_bptt, "time_major", "products"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_lstm_tangent, lstm_tangent,
                              ffi_util::bind(lstm_tangent, "time_major", "products"));

}  // namespace jb
