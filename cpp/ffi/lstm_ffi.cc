// XLA FFI handlers of the LSTM layer (jb.lstm): thin wrappers that decode and validate the
// buffers, then call cpp/layers/lstm.
//
//   jb_lstm_fwd   x (N, T, C) | (T, N, C), w (C, 4K), r (K, 4K), bias (4K,) f32,
//                 c0 (N, K) f32, h0 (N, K)
//                 -> y (x's layout, K features), c_T (N, K) f32, h_T (N, K),
//                    gates (T, ceil(K / B), N, 4B, x's dtype; B = lstm::gate_block),
//                    cs (T, N, K) f32 and xh (x's layout,
//                    lstm::saved_width features, x's dtype) when training, else (0,) each
//                 attrs time_major, variant (0 automatic or 1 fused: the same forward)
//   jb_lstm_bptt  r (K, 4K), gates, cs, c0, dy (y's shape), dc_T (N, K) f32, dh_T (N, K)
//                 -> da (x's layout, lstm::da_width features: the first 4K, then padding),
//                    db (4K,) f32, dc0 (N, K) f32, dh0 (N, K)
//                 attr time_major
// x, y, h, dy, dh and da share the compute dtype (float32 or bfloat16); w and r are
// float32 or bfloat16 (cast inside the call).
#include <string>
#include <vector>

#include "ffi/ffi_common.h"
#include "layers/lstm/lstm.h"

namespace jb {
namespace {

namespace ffi = xla::ffi;
using ffi_util::dims_str;
using ffi_util::guarded;
using ffi_util::invalid;

bool dims_are(ffi::AnyBuffer::Dimensions d, const std::vector<int64_t>& want) {
  if (d.size() != want.size()) return false;
  for (size_t i = 0; i < want.size(); ++i)
    if (d[i] != want[i]) return false;
  return true;
}

// The saved gates' dimensions (lstm.h).
std::vector<int64_t> gate_dims(const lstm::Shape& s) {
  const auto d = lstm::saved_gate_dims(s, dispatch());
  return {d.begin(), d.end()};
}

std::string shape_str(const std::vector<int64_t>& v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + (v.size() == 1 ? ",)" : ")");
}

// An error naming the operand when its shape is not `want`.
#define JB_SHAPE(op, name, buf_dims, ...)                                                       \
  do {                                                                                          \
    const std::vector<int64_t> want_ = __VA_ARGS__;                                             \
    if (!dims_are(buf_dims, want_))                                                             \
      return invalid(std::string(op) + ": " + name + " has shape " + dims_str(buf_dims) +       \
                     ", expected " + shape_str(want_));                                         \
  } while (0)

#define JB_DTYPE(op, name, buf, want)                                                     \
  do {                                                                                    \
    if ((buf).element_type() != (want))                                                   \
      return invalid(std::string(op) + ": " + name + " has the wrong dtype");             \
  } while (0)

ffi::Error lstm_fwd(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer r,
                    ffi::AnyBuffer bias, ffi::AnyBuffer c0, ffi::AnyBuffer h0,
                    ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> c_last,
                    ffi::Result<ffi::AnyBuffer> h_last, ffi::Result<ffi::AnyBuffer> gates,
                    ffi::Result<ffi::AnyBuffer> cs, ffi::Result<ffi::AnyBuffer> xh, bool time_major,
                    int32_t variant) {
  const char* op = "jb_lstm_fwd";
  DType dt, w_dt, r_dt;
  if (!ffi_util::kernel_dtype(x.element_type(), &dt))
    return invalid("jb_lstm_fwd: x must be float32 or bfloat16");
  if (!ffi_util::kernel_dtype(w.element_type(), &w_dt) || !ffi_util::kernel_dtype(r.element_type(), &r_dt) ||
      w_dt != r_dt)
    return invalid("jb_lstm_fwd: w and r must both be float32 or both bfloat16");
  // 0 lets the layer choose, 1 asks for the fused forward: the same, the only one there is.
  if (variant < 0 || variant > 1) return invalid("jb_lstm_fwd: unknown variant " + std::to_string(variant));
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 3 || wd.size() != 2) return invalid("jb_lstm_fwd: x needs rank 3 and w rank 2");
  const int64_t t = time_major ? xd[0] : xd[1], n = time_major ? xd[1] : xd[0], c = xd[2];
  if (wd[1] % 4) return invalid("jb_lstm_fwd: w " + dims_str(wd) + " must have 4K columns");
  const int64_t k = wd[1] / 4, g = 4 * k;
  JB_SHAPE(op, "w", wd, {c, g});
  JB_SHAPE(op, "r", r.dimensions(), {k, g});
  JB_SHAPE(op, "bias", bias.dimensions(), {g});
  JB_SHAPE(op, "c0", c0.dimensions(), {n, k});
  JB_SHAPE(op, "h0", h0.dimensions(), {n, k});
  JB_SHAPE(op, "y", y->dimensions(), time_major ? std::vector<int64_t>{t, n, k} : std::vector<int64_t>{n, t, k});
  JB_SHAPE(op, "c_last", c_last->dimensions(), {n, k});
  JB_SHAPE(op, "h_last", h_last->dimensions(), {n, k});
  const bool save = gates->element_count() != 0 || cs->element_count() != 0 || xh->element_count() != 0;
  const lstm::Shape s{t, n, c, k, dt, time_major};
  if (save) {
    JB_SHAPE(op, "gates", gates->dimensions(), gate_dims(s));
    JB_SHAPE(op, "cs", cs->dimensions(), {t, n, k});
    const int64_t width = lstm::saved_width(s, dispatch());
    JB_SHAPE(op, "xh", xh->dimensions(), time_major ? std::vector<int64_t>{t, n, width} : std::vector<int64_t>{n, t, width});
  }
  JB_DTYPE(op, "bias", bias, ffi::DataType::F32);
  JB_DTYPE(op, "c0", c0, ffi::DataType::F32);
  JB_DTYPE(op, "h0", h0, x.element_type());
  JB_DTYPE(op, "y", *y, x.element_type());
  JB_DTYPE(op, "c_last", *c_last, ffi::DataType::F32);
  JB_DTYPE(op, "h_last", *h_last, x.element_type());
  JB_DTYPE(op, "gates", *gates, x.element_type());
  JB_DTYPE(op, "cs", *cs, ffi::DataType::F32);
  JB_DTYPE(op, "xh", *xh, x.element_type());
  if (n == 0 || k == 0) return ffi::Error::Success();
  if (c == 0 && t > 0) return invalid("jb_lstm_fwd: x has no features (C = 0)");

  const Executor ex = ffi_util::executor(pool);
  lstm::ForwardArgs a;
  a.x = {x.untyped_data(), dt};
  a.w = {w.untyped_data(), w_dt};
  a.r = {r.untyped_data(), w_dt};
  a.bias = static_cast<const float*>(bias.untyped_data());
  a.c0 = static_cast<const float*>(c0.untyped_data());
  a.h0 = {h0.untyped_data(), dt};
  a.y = {y->untyped_data(), dt};
  a.c_last = static_cast<float*>(c_last->untyped_data());
  a.h_last = {h_last->untyped_data(), dt};
  if (save) a.saved = {{gates->untyped_data(), dt}, static_cast<float*>(cs->untyped_data()), {xh->untyped_data(), dt}};
  return guarded(op, [&] { lstm::forward(ex, dispatch(), s, a); });
}

ffi::Error lstm_bptt(ffi::ThreadPool pool, ffi::AnyBuffer r, ffi::AnyBuffer gates, ffi::AnyBuffer cs,
                     ffi::AnyBuffer c0, ffi::AnyBuffer dy, ffi::AnyBuffer dc_last, ffi::AnyBuffer dh_last,
                     ffi::Result<ffi::AnyBuffer> da, ffi::Result<ffi::AnyBuffer> db,
                     ffi::Result<ffi::AnyBuffer> dc0, ffi::Result<ffi::AnyBuffer> dh0, bool time_major) {
  const char* op = "jb_lstm_bptt";
  DType dt, w_dt;
  if (!ffi_util::kernel_dtype(dy.element_type(), &dt))
    return invalid("jb_lstm_bptt: dy must be float32 or bfloat16");
  if (!ffi_util::kernel_dtype(r.element_type(), &w_dt))
    return invalid("jb_lstm_bptt: r must be float32 or bfloat16");
  const auto rd = r.dimensions(), yd = dy.dimensions();
  if (rd.size() != 2 || yd.size() != 3) return invalid("jb_lstm_bptt: r needs rank 2 and dy rank 3");
  const int64_t k = rd[0], g = 4 * k;
  const int64_t t = time_major ? yd[0] : yd[1], n = time_major ? yd[1] : yd[0];
  JB_SHAPE(op, "r", rd, {k, g});
  JB_SHAPE(op, "dy", yd, time_major ? std::vector<int64_t>{t, n, k} : std::vector<int64_t>{n, t, k});
  const lstm::Shape s{t, n, 0, k, dt, time_major};
  JB_SHAPE(op, "gates", gates.dimensions(), gate_dims(s));
  JB_SHAPE(op, "cs", cs.dimensions(), {t, n, k});
  JB_SHAPE(op, "c0", c0.dimensions(), {n, k});
  JB_SHAPE(op, "dc_last", dc_last.dimensions(), {n, k});
  JB_SHAPE(op, "dh_last", dh_last.dimensions(), {n, k});
  const int64_t width = lstm::da_width(s);
  JB_SHAPE(op, "da", da->dimensions(),
           time_major ? std::vector<int64_t>{t, n, width} : std::vector<int64_t>{n, t, width});
  JB_SHAPE(op, "db", db->dimensions(), {g});
  JB_SHAPE(op, "dc0", dc0->dimensions(), {n, k});
  JB_SHAPE(op, "dh0", dh0->dimensions(), {n, k});
  JB_DTYPE(op, "gates", gates, dy.element_type());
  JB_DTYPE(op, "cs", cs, ffi::DataType::F32);
  JB_DTYPE(op, "c0", c0, ffi::DataType::F32);
  JB_DTYPE(op, "dc_last", dc_last, ffi::DataType::F32);
  JB_DTYPE(op, "dh_last", dh_last, dy.element_type());
  JB_DTYPE(op, "da", *da, dy.element_type());
  JB_DTYPE(op, "db", *db, ffi::DataType::F32);
  JB_DTYPE(op, "dc0", *dc0, ffi::DataType::F32);
  JB_DTYPE(op, "dh0", *dh0, dy.element_type());
  const Executor ex = ffi_util::executor(pool);
  lstm::BpttArgs a;
  a.r = {r.untyped_data(), w_dt};
  a.gates = {gates.untyped_data(), dt};
  a.cs = static_cast<const float*>(cs.untyped_data());
  a.c0 = static_cast<const float*>(c0.untyped_data());
  a.dy = {dy.untyped_data(), dt};
  a.dc_last = static_cast<const float*>(dc_last.untyped_data());
  a.dh_last = {dh_last.untyped_data(), dt};
  a.da = {da->untyped_data(), dt};
  a.db = static_cast<float*>(db->untyped_data());
  a.dc0 = static_cast<float*>(dc0->untyped_data());
  a.dh0 = {dh0->untyped_data(), dt};
  return guarded(op, [&] { lstm::bptt(ex, dispatch(), s, a); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_lstm_fwd, lstm_fwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Arg<ffi::AnyBuffer>()  // r
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Arg<ffi::AnyBuffer>()  // c0
                                  .Arg<ffi::AnyBuffer>()  // h0
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // c_last
                                  .Ret<ffi::AnyBuffer>()  // h_last
                                  .Ret<ffi::AnyBuffer>()  // gates
                                  .Ret<ffi::AnyBuffer>()  // cs
                                  .Ret<ffi::AnyBuffer>()  // xh
                                  .Attr<bool>("time_major")
                                  .Attr<int32_t>("variant"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_lstm_bptt, lstm_bptt,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // r
                                  .Arg<ffi::AnyBuffer>()  // gates
                                  .Arg<ffi::AnyBuffer>()  // cs
                                  .Arg<ffi::AnyBuffer>()  // c0
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // dc_last
                                  .Arg<ffi::AnyBuffer>()  // dh_last
                                  .Ret<ffi::AnyBuffer>()  // da
                                  .Ret<ffi::AnyBuffer>()  // db
                                  .Ret<ffi::AnyBuffer>()  // dc0
                                  .Ret<ffi::AnyBuffer>()  // dh0
                                  .Attr<bool>("time_major"));

}  // namespace jb
