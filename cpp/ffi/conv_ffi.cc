// XLA FFI handlers of the convolution layer (jb.conv2d): thin wrappers that decode and
// validate the buffers, then call cpp/layers/conv.
//
//   jb_conv_fwd  x (.., N, H, W, C), w (.., R, S, C, K), bias (.., K) or (.., 0)
//                -> y (.., N, P, Q, K), z (.., N, P, Q, K) for gelu else empty
//   jb_conv_bwd  dz (.., N, P, Q, K), w (.., R, S, C, K) -> dx (.., N, H, W, C)
//   jb_conv_upd  x (.., N, H, W, C), dz (.., N, P, Q, K) -> dw (.., R, S, C, K), db (.., K) or (.., 0)
//
// Attributes: act (fwd), strides sh, sw and paddings pt, pb, pl, pr (all passes).
// The activation derivative is element-wise: jb.conv2d uses jb_fc_act_grad for it.
// The leading dims (..) come from vmap (vmap_method="expand_dims"), broadcast as in
// fc_ffi.cc: when the weights are shared and the activations are not, the items fold into
// the mini-batch (one layer call with N' = items * N).
#include <algorithm>
#include <string>
#include <vector>

#include "ffi/ffi_common.h"
#include "layers/conv.h"

namespace jb {
namespace {

namespace ffi = xla::ffi;
using ffi_util::dims_str;
using ffi_util::guarded;
using ffi_util::invalid;
using ffi_util::Items;
using ffi_util::items_of;
using ffi_util::operand;
using ffi_util::ptr;

// The geometry from the attributes and the input / weight dims, checked.
ffi::ErrorOr<conv::Shape> geometry(const char* op, ffi::AnyBuffer::Dimensions xd, ffi::AnyBuffer::Dimensions wd,
                                   int64_t sh, int64_t sw, int64_t pt, int64_t pb, int64_t pl, int64_t pr) {
  if (xd.size() < 4 || wd.size() < 4)
    return ffi::Unexpected(invalid(std::string(op) + ": the input needs rank >= 4 (N, H, W, C), the "
                                   "weights rank >= 4 (R, S, C, K)"));
  conv::Shape s;
  s.n = xd[xd.size() - 4], s.h = xd[xd.size() - 3], s.w = xd[xd.size() - 2], s.c = xd[xd.size() - 1];
  s.r = wd[wd.size() - 4], s.s = wd[wd.size() - 3], s.k = wd[wd.size() - 1];
  s.sh = sh, s.sw = sw, s.pt = pt, s.pb = pb, s.pl = pl, s.pr = pr;
  if (wd[wd.size() - 2] != s.c)
    return ffi::Unexpected(invalid(std::string(op) + ": weights " + dims_str(wd) + " expect " +
                                   std::to_string(wd[wd.size() - 2]) + " input channels, the input " +
                                   dims_str(xd) + " has " + std::to_string(s.c)));
  try {
    conv::validate(s);
  } catch (const std::exception& e) {
    return ffi::Unexpected(invalid(std::string(op) + ": " + e.what()));
  }
  return s;
}

bool same_dims(ffi::AnyBuffer::Dimensions a, ffi::AnyBuffer::Dimensions b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

ffi::Error conv_fwd(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias,
                    ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> z, int32_t act_code,
                    int64_t sh, int64_t sw, int64_t pt, int64_t pb, int64_t pl, int64_t pr) {
  const char* op = "jb_conv_fwd";
  DType dt, w_dt;
  if (!ffi_util::kernel_dtype(x.element_type(), &dt) || y->element_type() != x.element_type() ||
      z->element_type() != x.element_type())
    return invalid("jb_conv_fwd: x, y and z must all be float32 or all bfloat16");
  if (!ffi_util::kernel_dtype(w.element_type(), &w_dt))
    return invalid("jb_conv_fwd: w must be float32 or bfloat16");
  if (bias.element_type() != ffi::DataType::F32) return invalid("jb_conv_fwd: bias must be float32");
  JB_TRY(act, ffi_util::activation(op, act_code));
  JB_TRY(s0, geometry(op, x.dimensions(), w.dimensions(), sh, sw, pt, pb, pl, pr));
  conv::Shape s = s0;
  s.dt = dt;
  s.act = act;
  const auto yd = y->dimensions();
  if (yd.size() < 4 || bias.dimensions().size() < 1)
    return invalid("jb_conv_fwd: y needs rank >= 4, bias rank >= 1");
  const Items items = items_of(yd, 4);
  JB_TRY(lx, operand(op, "x", x.dimensions(), {s.n, s.h, s.w, s.c}, items));
  JB_TRY(lw, operand(op, "w", w.dimensions(), {s.r, s.s, s.c, s.k}, items));
  JB_TRY(ly, operand(op, "y", yd, {s.n, s.p(), s.q(), s.k}, items));
  (void)ly;
  const bool has_bias = bias.element_count() != 0;
  JB_TRY(lb, operand(op, "bias", bias.dimensions(), {has_bias ? s.k : 0}, items));
  const bool gelu = s.act == Activation::gelu;
  if (gelu ? !same_dims(yd, z->dimensions()) : z->element_count() != 0)
    return invalid("jb_conv_fwd: z must have y's shape " + dims_str(yd) + " for gelu, else be empty");
  if (items.count == 0 || s.n == 0) return ffi::Error::Success();

  const Executor ex = ffi_util::executor(pool);
  const Dispatch& dp = dispatch();
  const auto* bias_f = static_cast<const float*>(bias.untyped_data());
  const int64_t ysize = s.n * s.p() * s.q() * s.k;
  return guarded(op, [&] {
    if (lw.shared && lb.shared && lx.dense) {  // one layer call over all items
      conv::Shape all = s;
      all.n = items.count * s.n;
      conv::forward(ex, dp, all, x.untyped_data(), w.untyped_data(), w_dt, has_bias ? bias_f : nullptr,
                    y->untyped_data(), gelu ? z->untyped_data() : nullptr);
      return;
    }
    for (int64_t i = 0; i < items.count; ++i)
      conv::forward(ex, dp, s, ptr(x, items.offset(lx, i)), ptr(w, items.offset(lw, i)), w_dt,
                    has_bias ? bias_f + items.offset(lb, i) : nullptr, ptr(y, i * ysize),
                    gelu ? ptr(z, i * ysize) : nullptr);
  });
}

ffi::Error conv_bwd(ffi::ThreadPool pool, ffi::AnyBuffer dz, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> dx,
                    int64_t sh, int64_t sw, int64_t pt, int64_t pb, int64_t pl, int64_t pr) {
  const char* op = "jb_conv_bwd";
  DType dt, w_dt;
  if (!ffi_util::kernel_dtype(dz.element_type(), &dt) || dx->element_type() != dz.element_type())
    return invalid("jb_conv_bwd: dz and dx must both be float32 or both bfloat16");
  if (!ffi_util::kernel_dtype(w.element_type(), &w_dt))
    return invalid("jb_conv_bwd: w must be float32 or bfloat16");
  JB_TRY(s0, geometry(op, dx->dimensions(), w.dimensions(), sh, sw, pt, pb, pl, pr));
  conv::Shape s = s0;
  s.dt = dt;
  const Items items = items_of(dx->dimensions(), 4);
  JB_TRY(lz, operand(op, "dz", dz.dimensions(), {s.n, s.p(), s.q(), s.k}, items));
  JB_TRY(lw, operand(op, "w", w.dimensions(), {s.r, s.s, s.c, s.k}, items));
  if (items.count == 0 || s.n == 0) return ffi::Error::Success();
  const Executor ex = ffi_util::executor(pool);
  const Dispatch& dp = dispatch();
  const int64_t xsize = s.n * s.h * s.w * s.c;
  return guarded(op, [&] {
    if (lw.shared && lz.dense) {
      conv::Shape all = s;
      all.n = items.count * s.n;
      conv::backward(ex, dp, all, dz.untyped_data(), w.untyped_data(), w_dt, dx->untyped_data());
      return;
    }
    for (int64_t i = 0; i < items.count; ++i)
      conv::backward(ex, dp, s, ptr(dz, items.offset(lz, i)), ptr(w, items.offset(lw, i)), w_dt,
                     ptr(dx, i * xsize));
  });
}

ffi::Error conv_upd(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dz, ffi::Result<ffi::AnyBuffer> dw,
                    ffi::Result<ffi::AnyBuffer> db, int64_t sh, int64_t sw, int64_t pt, int64_t pb,
                    int64_t pl, int64_t pr) {
  const char* op = "jb_conv_upd";
  DType dt, w_dt;
  if (!ffi_util::kernel_dtype(x.element_type(), &dt) || dz.element_type() != x.element_type())
    return invalid("jb_conv_upd: x and dz must both be float32 or both bfloat16");
  if (!ffi_util::kernel_dtype(dw->element_type(), &w_dt))
    return invalid("jb_conv_upd: dw must be float32 or bfloat16");
  if (db->element_type() != ffi::DataType::F32) return invalid("jb_conv_upd: db must be float32");
  JB_TRY(s0, geometry(op, x.dimensions(), dw->dimensions(), sh, sw, pt, pb, pl, pr));
  conv::Shape s = s0;
  s.dt = dt;
  const auto wd = dw->dimensions();
  const Items items = items_of(wd, 4);
  JB_TRY(lx, operand(op, "x", x.dimensions(), {s.n, s.h, s.w, s.c}, items));
  JB_TRY(lz, operand(op, "dz", dz.dimensions(), {s.n, s.p(), s.q(), s.k}, items));
  const bool has_db = db->element_count() != 0;
  const auto bd = db->dimensions();
  if (has_db && (bd.size() != wd.size() - 3 || bd[bd.size() - 1] != s.k ||
                 !std::equal(wd.begin(), wd.end() - 4, bd.begin())))
    return invalid("jb_conv_upd: db " + dims_str(bd) + " must be dw's leading dims + (K,), or empty");
  if (items.count == 0) return ffi::Error::Success();
  const Executor ex = ffi_util::executor(pool);
  const Dispatch& dp = dispatch();
  auto* db_f = static_cast<float*>(db->untyped_data());
  const int64_t wsize = s.r * s.s * s.c * s.k;
  return guarded(op, [&] {
    for (int64_t i = 0; i < items.count; ++i)
      conv::update(ex, dp, s, ptr(x, items.offset(lx, i)), ptr(dz, items.offset(lz, i)), ptr(dw, i * wsize),
                   w_dt, has_db ? db_f + i * s.k : nullptr);
  });
}

}  // namespace

#define JB_CONV_GEOMETRY                                                                    \
  .Attr<int64_t>("sh").Attr<int64_t>("sw").Attr<int64_t>("pt").Attr<int64_t>("pb")          \
      .Attr<int64_t>("pl").Attr<int64_t>("pr")

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_conv_fwd, conv_fwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // z
                                  .Attr<int32_t>("act") JB_CONV_GEOMETRY);

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_conv_bwd, conv_bwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // dz
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Ret<ffi::AnyBuffer>()  // dx
                                      JB_CONV_GEOMETRY);

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_conv_upd, conv_upd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // dz
                                  .Ret<ffi::AnyBuffer>()  // dw
                                  .Ret<ffi::AnyBuffer>()  // db
                                      JB_CONV_GEOMETRY);

#undef JB_CONV_GEOMETRY

}  // namespace jb
