// XLA FFI handlers of the convolution layer (jb.conv2d): thin wrappers that decode and
// validate the buffers, then call cpp/layers/conv; asynchronous where the work is large
// enough to split.
//
//   jb_conv_fwd  x (.., N, H, W, C), w (.., R, S, C/G, K), bias (.., K) or (.., 0)
//                -> y (.., N, P, Q, K), z (.., N, P, Q, K) for gelu else empty
//   jb_conv_bwd  dz (.., N, P, Q, K), w (.., R, S, C/G, K) -> dx (.., N, H, W, C)
//   (y, z and dx in x's / dz's dtype)
//   jb_conv_upd  x (.., N, H, W, C), dz (.., N, P, Q, K) -> dw (.., R, S, C/G, K), db (.., K) or (.., 0)
//
// Attributes: act (fwd), strides sh, sw, paddings pt, pb, pl, pr, kernel dilations dh, dw,
// feature groups g and products (all passes): fp32 emulated from that many bf16 products
// (1, 3, 6), 0 exact; conv.h.
// The activation derivative is element-wise: jb.conv2d uses jb_fc_act_grad for it.
// The leading dims (..) come from vmap (vmap_method="expand_dims"), broadcast as in
// fc_ffi.cc: when the weights are shared and the activations are not, the items fold into
// the mini-batch (one layer call with N' = items * N).
#include <algorithm>
#include <string>
#include <vector>

#include "ffi/ffi_common.h"
#include "layers/conv/conv.h"

namespace jb {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_util;

// The geometry from the attributes and the input / weight dims, checked.
ffi::ErrorOr<conv::Shape> geometry(const char* op, ffi::AnyBuffer::Dimensions xd, ffi::AnyBuffer::Dimensions wd,
                                   int64_t sh, int64_t sw, int64_t pt, int64_t pb, int64_t pl, int64_t pr,
                                   int64_t dil_h, int64_t dil_w, int64_t groups) {
  if (xd.size() < 4 || wd.size() < 4)
    return ffi::Unexpected(invalid(std::string(op) + ": the input needs rank >= 4 (N, H, W, C), the "
                                   "weights rank >= 4 (R, S, C, K)"));
  conv::Shape s;
  s.n = xd[xd.size() - 4], s.h = xd[xd.size() - 3], s.w = xd[xd.size() - 2], s.c = xd[xd.size() - 1];
  s.r = wd[wd.size() - 4], s.s = wd[wd.size() - 3], s.k = wd[wd.size() - 1];
  s.sh = sh, s.sw = sw, s.pt = pt, s.pb = pb, s.pl = pl, s.pr = pr, s.dil_h = dil_h, s.dil_w = dil_w;
  s.groups = groups;
  if (groups < 1 || wd[wd.size() - 2] * groups != s.c)
    return ffi::Unexpected(invalid(std::string(op) + ": weights " + dims_str(wd) + " in " + std::to_string(groups) +
                                   " feature groups expect " + std::to_string(wd[wd.size() - 2] * groups) +
                                   " input channels, the input " + dims_str(xd) + " has " + std::to_string(s.c)));
  try {
    conv::validate(s);
  } catch (const std::exception& e) {
    return ffi::Unexpected(invalid(std::string(op) + ": " + e.what()));
  }
  return s;
}

ffi::Error conv_fwd(Launch& launch, ffi::AnyBuffer x, ffi::AnyBuffer w, F32 bias,
                    ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> z, int32_t act_code,
                    int64_t sh, int64_t sw, int64_t pt, int64_t pb, int64_t pl, int64_t pr,
                    int64_t dil_h, int64_t dil_w, int64_t groups, int64_t products) {
  const char* op = "jb_conv_fwd";
  JB_TRY(dt, kernel_dtype(op, {{"x", x.element_type()}, {"y", y->element_type()}, {"z", z->element_type()}}));
  JB_TRY(w_dt, kernel_dtype(op, {{"w", w.element_type()}}));
  JB_CHECK(check_products(op, products, dt == DType::f32 && w_dt == DType::f32, "x and w"));
  JB_TRY(act, activation(op, act_code));
  JB_TRY(s0, geometry(op, x.dimensions(), w.dimensions(), sh, sw, pt, pb, pl, pr, dil_h, dil_w, groups));
  conv::Shape s = s0;
  s.dt = dt;
  s.products = products;
  s.act = act;
  const auto yd = y->dimensions();
  if (yd.size() < 4 || bias.dimensions().size() < 1)
    return invalid("jb_conv_fwd: y needs rank >= 4, bias rank >= 1");
  const Items items = items_of(yd, 4);
  JB_TRY(lx, operand(op, "x", x.dimensions(), {s.n, s.h, s.w, s.c}, items));
  JB_TRY(lw, operand(op, "w", w.dimensions(), {s.r, s.s, s.cg(), s.k}, items));
  JB_TRY(ly, operand(op, "y", yd, {s.n, s.p(), s.q(), s.k}, items));
  (void)ly;
  const bool has_bias = bias.element_count() != 0;
  JB_TRY(lb, operand(op, "bias", bias.dimensions(), {has_bias ? s.k : 0}, items));
  JB_CHECK(expect_z(op, act, yd, z->dimensions()));
  if (items.count == 0 || s.n == 0) return ffi::Error::Success();

  const bool gelu = act == Activation::gelu;
  const int64_t ysize = s.n * s.p() * s.q() * s.k;
  return guarded(op, [&] {
    // Weights shared by every item: the items fold into the mini-batch.
    per_item(items, lw.shared && lb.shared && lx.dense, [&](int64_t count, int64_t i) {
      conv::Shape batch = s;
      batch.n = count * s.n;
      launch(conv::forward_job(launch.threads(), dispatch(), batch, ptr(x, items.offset(lx, i)),
                               ptr(w, items.offset(lw, i)), w_dt,
                               has_bias ? bias.typed_data() + items.offset(lb, i) : nullptr, ptr(y, i * ysize),
                               gelu ? ptr(z, i * ysize) : nullptr));
    });
  });
}

ffi::Error conv_bwd(Launch& launch, ffi::AnyBuffer dz, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> dx,
                    int64_t sh, int64_t sw, int64_t pt, int64_t pb, int64_t pl, int64_t pr,
                    int64_t dil_h, int64_t dil_w, int64_t groups, int64_t products) {
  const char* op = "jb_conv_bwd";
  JB_TRY(dt, kernel_dtype(op, {{"dz", dz.element_type()}, {"dx", dx->element_type()}}));
  JB_TRY(w_dt, kernel_dtype(op, {{"w", w.element_type()}}));
  JB_CHECK(check_products(op, products, dt == DType::f32 && w_dt == DType::f32, "dz and w"));
  JB_TRY(s0, geometry(op, dx->dimensions(), w.dimensions(), sh, sw, pt, pb, pl, pr, dil_h, dil_w, groups));
  conv::Shape s = s0;
  s.dt = dt;
  s.products = products;
  const Items items = items_of(dx->dimensions(), 4);
  JB_TRY(lz, operand(op, "dz", dz.dimensions(), {s.n, s.p(), s.q(), s.k}, items));
  JB_TRY(lw, operand(op, "w", w.dimensions(), {s.r, s.s, s.cg(), s.k}, items));
  if (items.count == 0 || s.n == 0) return ffi::Error::Success();
  const int64_t xsize = s.n * s.h * s.w * s.c;
  return guarded(op, [&] {
    per_item(items, lw.shared && lz.dense, [&](int64_t count, int64_t i) {
      conv::Shape batch = s;
      batch.n = count * s.n;
      launch(conv::backward_job(launch.threads(), dispatch(), batch, ptr(dz, items.offset(lz, i)),
                                ptr(w, items.offset(lw, i)), w_dt, ptr(dx, i * xsize)));
    });
  });
}

ffi::Error conv_upd(Launch& launch, ffi::AnyBuffer x, ffi::AnyBuffer dz, ffi::Result<ffi::AnyBuffer> dw,
                    F32Out db, int64_t sh, int64_t sw, int64_t pt, int64_t pb, int64_t pl, int64_t pr,
                    int64_t dil_h, int64_t dil_w, int64_t groups, int64_t products) {
  const char* op = "jb_conv_upd";
  JB_TRY(dt, kernel_dtype(op, {{"x", x.element_type()}, {"dz", dz.element_type()}}));
  JB_CHECK(check_products(op, products, dt == DType::f32, "x and dz"));
  JB_TRY(w_dt, kernel_dtype(op, {{"dw", dw->element_type()}}));
  JB_TRY(s0, geometry(op, x.dimensions(), dw->dimensions(), sh, sw, pt, pb, pl, pr, dil_h, dil_w, groups));
  conv::Shape s = s0;
  s.dt = dt;
  s.products = products;
  const auto wd = dw->dimensions();
  const Items items = items_of(wd, 4);
  JB_TRY(lx, operand(op, "x", x.dimensions(), {s.n, s.h, s.w, s.c}, items));
  JB_TRY(lz, operand(op, "dz", dz.dimensions(), {s.n, s.p(), s.q(), s.k}, items));
  JB_CHECK(expect_db(op, db->dimensions(), wd, 4, s.k));
  if (items.count == 0) return ffi::Error::Success();
  const bool has_db = db->element_count() != 0;
  const int64_t wsize = s.r * s.s * s.cg() * s.k;
  return guarded(op, [&] {
    for (int64_t i = 0; i < items.count; ++i)
      launch(conv::update_job(launch.threads(), dispatch(), s, ptr(x, items.offset(lx, i)),
                              ptr(dz, items.offset(lz, i)), ptr(dw, i * wsize), w_dt,
                              has_db ? db->typed_data() + i * s.k : nullptr));
  });
}

// Asynchronous where the work is large enough to split (ffi_common.h's Launch).
ffi::Future conv_fwd_async(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, F32 bias,
                           ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> z, int32_t act_code, int64_t sh,
                           int64_t sw, int64_t pt, int64_t pb, int64_t pl, int64_t pr, int64_t dil_h, int64_t dil_w,
                           int64_t groups, int64_t products) {
  Launch launch(pool);
  return launch.finish(
      conv_fwd(launch, x, w, bias, y, z, act_code, sh, sw, pt, pb, pl, pr, dil_h, dil_w, groups, products));
}

ffi::Future conv_bwd_async(ffi::ThreadPool pool, ffi::AnyBuffer dz, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> dx,
                           int64_t sh, int64_t sw, int64_t pt, int64_t pb, int64_t pl, int64_t pr, int64_t dil_h,
                           int64_t dil_w, int64_t groups, int64_t products) {
  Launch launch(pool);
  return launch.finish(conv_bwd(launch, dz, w, dx, sh, sw, pt, pb, pl, pr, dil_h, dil_w, groups, products));
}

ffi::Future conv_upd_async(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dz, ffi::Result<ffi::AnyBuffer> dw,
                           F32Out db, int64_t sh, int64_t sw, int64_t pt, int64_t pb, int64_t pl, int64_t pr,
                           int64_t dil_h, int64_t dil_w, int64_t groups, int64_t products) {
  Launch launch(pool);
  return launch.finish(conv_upd(launch, x, dz, dw, db, sh, sw, pt, pb, pl, pr, dil_h, dil_w, groups, products));
}

}  // namespace

// The attributes after each pass's operands: strides, padding top, bottom, left, right, then
// the kernel dilations, the feature groups and the emulated products.
#define JB_CONV_GEOMETRY "sh", "sw", "pt", "pb", "pl", "pr", "dh", "dw", "g", "products"

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_conv_fwd, conv_fwd_async, ffi_util::bind(conv_fwd_async, "act", JB_CONV_GEOMETRY));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_conv_bwd, conv_bwd_async, ffi_util::bind(conv_bwd_async, JB_CONV_GEOMETRY));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_conv_upd, conv_upd_async, ffi_util::bind(conv_upd_async, JB_CONV_GEOMETRY));

#undef JB_CONV_GEOMETRY

}  // namespace jb
