// XLA FFI handlers of the fully-connected layer (jb.dense): thin wrappers that decode and
// validate the buffers, then call cpp/layers/fc.
//
//   jb_fc_fwd       x (.., N, C), w (.., C, K), bias (.., K) or (.., 0)
//                   -> y (.., N, K), z (.., N, K) for gelu else empty      attr act
//   jb_fc_act_grad  dy (.., N, K), saved (.., N, K) -> dz (.., N, K)       attr act
//   jb_fc_bwd       dz (.., N, K'), w (.., C, K) -> dx (.., N, C);  K' >= K (dz's first K
//                   columns)
//   jb_fc_upd       x (.., N, C'), dz (.., N, K') -> dw (.., C, K), db (.., K) or (.., 0);
//                   C' >= C, K' >= K (x's first C columns, dz's first K)
//   jb_fc_upd_sgd   x (N, C), dz (N, K), w (C, K), mw (C, K), b (K) or (0), mb like b,
//                   lr (), after (any; not read) -> w, mw, b, mb, updated in place
//                   (aliased to the inputs)
//                   attrs momentum, weight_decay, nesterov: the weight update with
//                   SGD's step fused (fc::update_sgd); fp32 parameters, no leading dims
//
// The leading dims (..) come from vmap (vmap_method="expand_dims"): an operand's leading
// dims broadcast numpy-style to the output's, so unbatched weights arrive with size-1
// dims and are read in place. When the weights are shared by every item and the
// activations are not, the items fold into the mini-batch: one layer call with N' = items
// * N instead of a loop.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "ffi/ffi_common.h"
#include "layers/fc.h"

namespace jb {
namespace {

namespace ffi = xla::ffi;
using ffi_util::dims_str;
using ffi_util::activation;
using ffi_util::invalid;
using ffi_util::guarded;
using ffi_util::Items;
using ffi_util::items_of;
using ffi_util::operand;
using ffi_util::ptr;

// ----------------------------------------------------------------------------------------

ffi::Error fc_fwd(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias,
                  ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> z, int32_t act_code) {
  const char* op = "jb_fc_fwd";
  DType dt, w_dt;
  if (!ffi_util::kernel_dtype(x.element_type(), &dt) || y->element_type() != x.element_type() ||
      z->element_type() != x.element_type())
    return invalid("jb_fc_fwd: x, y and z must all be float32 or all bfloat16");
  if (!ffi_util::kernel_dtype(w.element_type(), &w_dt))
    return invalid("jb_fc_fwd: w must be float32 or bfloat16");
  if (bias.element_type() != ffi::DataType::F32) return invalid("jb_fc_fwd: bias must be float32");
  JB_TRY(act, activation(op, act_code));
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() < 2 || wd.size() < 2 || yd.size() < 2 || bias.dimensions().size() < 1)
    return invalid("jb_fc_fwd: x, w and y need rank >= 2, bias rank >= 1");
  const int64_t n = xd[xd.size() - 2], c = xd[xd.size() - 1], k = wd[wd.size() - 1];
  const Items items = items_of(yd, 2);
  JB_TRY(lx, operand(op, "x", xd, {n, c}, items));
  JB_TRY(lw, operand(op, "w", wd, {c, k}, items));
  JB_TRY(ly, operand(op, "y", yd, {n, k}, items));
  (void)ly;
  const bool has_bias = bias.element_count() != 0;
  JB_TRY(lb, operand(op, "bias", bias.dimensions(), {has_bias ? k : 0}, items));
  const bool gelu = act == Activation::gelu;
  if (gelu) {
    if (z->dimensions().size() != yd.size() ||
        !std::equal(yd.begin(), yd.end(), z->dimensions().begin()))
      return invalid("jb_fc_fwd: z (the saved pre-activation) must have y's shape " + dims_str(yd));
  } else if (z->element_count() != 0) {
    return invalid("jb_fc_fwd: z must be empty unless the activation is gelu");
  }
  if (items.count == 0 || n == 0 || k == 0) return ffi::Error::Success();
  if (c == 0) return invalid("jb_fc_fwd: x has no features (C = 0)");

  const Executor ex = ffi_util::executor(pool);
  const Dispatch& dp = dispatch();
  const auto* bias_f = static_cast<const float*>(bias.untyped_data());
  return guarded(op, [&] {
    if (lw.shared && lb.shared && lx.dense) {  // one layer over all items
      fc::forward(ex, dp, {items.count * n, c, k, dt, act}, x.untyped_data(), w.untyped_data(), w_dt,
                  has_bias ? bias_f : nullptr, y->untyped_data(), gelu ? z->untyped_data() : nullptr);
      return;
    }
    for (int64_t i = 0; i < items.count; ++i)
      fc::forward(ex, dp, {n, c, k, dt, act}, ptr(x, items.offset(lx, i)), ptr(w, items.offset(lw, i)),
                  w_dt, has_bias ? bias_f + items.offset(lb, i) : nullptr, ptr(y, i * n * k),
                  gelu ? ptr(z, i * n * k) : nullptr);
  });
}

ffi::Error fc_act_grad(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer saved,
                       ffi::Result<ffi::AnyBuffer> dz, int32_t act_code) {
  const char* op = "jb_fc_act_grad";
  DType dt;
  if (!ffi_util::kernel_dtype(dy.element_type(), &dt) ||
      saved.element_type() != dy.element_type() || dz->element_type() != dy.element_type())
    return invalid("jb_fc_act_grad: dy, saved and dz must all be float32 or all bfloat16");
  JB_TRY(act, activation(op, act_code));
  if (act == Activation::none) return invalid("jb_fc_act_grad: needs an activation");
  const auto dd = dz->dimensions();
  if (dd.size() < 2) return invalid("jb_fc_act_grad: dz needs rank >= 2");
  const int64_t n = dd[dd.size() - 2], k = dd[dd.size() - 1];
  const Items items = items_of(dd, 2);
  JB_TRY(ldy, operand(op, "dy", dy.dimensions(), {n, k}, items));
  JB_TRY(ls, operand(op, "saved", saved.dimensions(), {n, k}, items));
  if (items.count == 0 || n == 0 || k == 0) return ffi::Error::Success();
  const Executor ex = ffi_util::executor(pool);
  const Dispatch& dp = dispatch();
  return guarded(op, [&] {
    if (ldy.dense && ls.dense) {
      fc::act_grad(ex, dp, {items.count * n, 0, k, dt, act}, dy.untyped_data(), saved.untyped_data(),
                   dz->untyped_data());
      return;
    }
    for (int64_t i = 0; i < items.count; ++i)
      fc::act_grad(ex, dp, {n, 0, k, dt, act}, ptr(dy, items.offset(ldy, i)),
                   ptr(saved, items.offset(ls, i)), ptr(dz, i * n * k));
  });
}

// dz's row length: its last dim, at least K (jb.lstm's da is wider: padded rows, the first K
// columns used).
ffi::ErrorOr<int64_t> dz_columns(const char* op, ffi::AnyBuffer::Dimensions dz, int64_t k) {
  if (dz.size() < 2 || dz[dz.size() - 1] < k)
    return ffi::Unexpected(invalid(std::string(op) + ": dz has shape " + dims_str(dz) + ", expected (..., N, " +
                                   std::to_string(k) + ") or more columns"));
  return dz[dz.size() - 1];
}

ffi::Error fc_bwd(ffi::ThreadPool pool, ffi::AnyBuffer dz, ffi::AnyBuffer w,
                  ffi::Result<ffi::AnyBuffer> dx) {
  const char* op = "jb_fc_bwd";
  DType dt, w_dt;
  if (!ffi_util::kernel_dtype(dz.element_type(), &dt) || dx->element_type() != dz.element_type())
    return invalid("jb_fc_bwd: dz and dx must both be float32 or both bfloat16");
  if (!ffi_util::kernel_dtype(w.element_type(), &w_dt))
    return invalid("jb_fc_bwd: w must be float32 or bfloat16");
  const auto xd = dx->dimensions(), wd = w.dimensions();
  if (xd.size() < 2 || wd.size() < 2) return invalid("jb_fc_bwd: dx and w need rank >= 2");
  const int64_t n = xd[xd.size() - 2], c = xd[xd.size() - 1], k = wd[wd.size() - 1];
  const Items items = items_of(xd, 2);
  JB_TRY(ldz, dz_columns(op, dz.dimensions(), k));
  JB_TRY(lz, operand(op, "dz", dz.dimensions(), {n, ldz}, items));
  JB_TRY(lw, operand(op, "w", wd, {c, k}, items));
  if (items.count == 0 || n == 0 || c == 0) return ffi::Error::Success();
  if (k == 0) return invalid("jb_fc_bwd: w has no output features (K = 0)");
  const Executor ex = ffi_util::executor(pool);
  const Dispatch& dp = dispatch();
  return guarded(op, [&] {
    if (lw.shared && lz.dense) {
      fc::backward(ex, dp, {items.count * n, c, k, dt, Activation::none, 0, ldz}, dz.untyped_data(),
                   w.untyped_data(), w_dt, dx->untyped_data());
      return;
    }
    for (int64_t i = 0; i < items.count; ++i)
      fc::backward(ex, dp, {n, c, k, dt, Activation::none, 0, ldz}, ptr(dz, items.offset(lz, i)),
                   ptr(w, items.offset(lw, i)), w_dt, ptr(dx, i * n * c));
  });
}

ffi::Error fc_upd(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dz,
                  ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> db) {
  const char* op = "jb_fc_upd";
  DType dt, w_dt;
  if (!ffi_util::kernel_dtype(x.element_type(), &dt) || dz.element_type() != x.element_type())
    return invalid("jb_fc_upd: x and dz must both be float32 or both bfloat16");
  if (!ffi_util::kernel_dtype(dw->element_type(), &w_dt))
    return invalid("jb_fc_upd: dw must be float32 or bfloat16");
  if (db->element_type() != ffi::DataType::F32) return invalid("jb_fc_upd: db must be float32");
  const auto xd = x.dimensions(), wd = dw->dimensions();
  if (xd.size() < 2 || wd.size() < 2 || db->dimensions().size() < 1)
    return invalid("jb_fc_upd: x and dw need rank >= 2, db rank >= 1");
  const int64_t n = xd[xd.size() - 2], c = wd[wd.size() - 2], k = wd[wd.size() - 1];
  // x may be wider than dw has rows: its first c columns are used (jb.lstm's saved xh).
  const int64_t ldx = xd[xd.size() - 1];
  if (ldx < c)
    return invalid("jb_fc_upd: x " + dims_str(xd) + " has fewer columns than dw " + dims_str(wd) + " has rows");
  const Items items = items_of(wd, 2);
  JB_TRY(lx, operand(op, "x", xd, {n, ldx}, items));
  JB_TRY(ldz, dz_columns(op, dz.dimensions(), k));
  JB_TRY(lz, operand(op, "dz", dz.dimensions(), {n, ldz}, items));
  const bool has_db = db->element_count() != 0;
  const auto bd = db->dimensions();
  if (has_db && (bd.size() != wd.size() - 1 || bd[bd.size() - 1] != k ||
                 !std::equal(wd.begin(), wd.end() - 2, bd.begin())))
    return invalid("jb_fc_upd: db " + dims_str(bd) + " must be dw's shape without C, or empty");
  if (items.count == 0 || c == 0 || k == 0) return ffi::Error::Success();
  const Executor ex = ffi_util::executor(pool);
  const Dispatch& dp = dispatch();
  auto* db_f = static_cast<float*>(db->untyped_data());
  return guarded(op, [&] {
    for (int64_t i = 0; i < items.count; ++i)
      fc::update(ex, dp, {n, c, k, dt, Activation::none, ldx, ldz}, ptr(x, items.offset(lx, i)), ptr(dz, items.offset(lz, i)),
                 ptr(dw, i * c * k), w_dt, has_db ? db_f + i * k : nullptr);
  });
}

ffi::Error fc_upd_sgd(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dz, ffi::AnyBuffer w,
                      ffi::AnyBuffer mw, ffi::AnyBuffer b, ffi::AnyBuffer mb, ffi::AnyBuffer lr,
                      ffi::AnyBuffer /*after*/, ffi::Result<ffi::AnyBuffer> w_out, ffi::Result<ffi::AnyBuffer> mw_out,
                      ffi::Result<ffi::AnyBuffer> b_out, ffi::Result<ffi::AnyBuffer> mb_out,
                      float momentum, float weight_decay, bool nesterov) {
  const char* op = "jb_fc_upd_sgd";
  DType dt;
  if (!ffi_util::kernel_dtype(x.element_type(), &dt) || dz.element_type() != x.element_type())
    return invalid("jb_fc_upd_sgd: x and dz must both be float32 or both bfloat16");
  for (const ffi::AnyBuffer* a : {&w, &mw, &b, &mb, &lr})
    if (a->element_type() != ffi::DataType::F32)
      return invalid("jb_fc_upd_sgd: the parameters, their momenta and lr must be float32");
  const auto xd = x.dimensions(), zd = dz.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || zd.size() != 2 || wd.size() != 2)
    return invalid("jb_fc_upd_sgd: x, dz and w must be matrices");
  const int64_t n = xd[0], c = xd[1], k = zd[1];
  if (zd[0] != n || wd[0] != c || wd[1] != k)
    return invalid("jb_fc_upd_sgd: x " + dims_str(xd) + ", dz " + dims_str(zd) + " and w " +
                   dims_str(wd) + " do not match (N, C), (N, K), (C, K)");
  if (mw.element_count() != c * k) return invalid("jb_fc_upd_sgd: mw must have w's shape");
  const bool has_b = b.element_count() != 0;
  if ((has_b && b.element_count() != k) || mb.element_count() != b.element_count())
    return invalid("jb_fc_upd_sgd: b and mb must both have K elements or both be empty");
  if (lr.element_count() != 1) return invalid("jb_fc_upd_sgd: lr must be a scalar");
  // Aliased: the outputs are the inputs' buffers. Copied first if XLA gave others.
  const ffi::AnyBuffer* ins[] = {&w, &mw, &b, &mb};
  ffi::Result<ffi::AnyBuffer>* outs[] = {&w_out, &mw_out, &b_out, &mb_out};
  for (int i = 0; i < 4; ++i)
    if ((*outs[i])->untyped_data() != ins[i]->untyped_data() && ins[i]->size_bytes())
      std::memcpy((*outs[i])->untyped_data(), ins[i]->untyped_data(), ins[i]->size_bytes());
  const fc::Sgd o{*static_cast<const float*>(lr.untyped_data()), momentum, weight_decay, nesterov};
  auto f32 = [](ffi::Result<ffi::AnyBuffer>& r) { return static_cast<float*>(r->untyped_data()); };
  const Executor ex = ffi_util::executor(pool);
  return guarded(op, [&] {
    fc::update_sgd(ex, dispatch(), {n, c, k, dt}, x.untyped_data(), dz.untyped_data(), o, f32(w_out),
                   f32(mw_out), has_b ? f32(b_out) : nullptr, has_b ? f32(mb_out) : nullptr);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_fc_fwd, fc_fwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // z
                                  .Attr<int32_t>("act"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_fc_act_grad, fc_act_grad,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // saved
                                  .Ret<ffi::AnyBuffer>()  // dz
                                  .Attr<int32_t>("act"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_fc_bwd, fc_bwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // dz
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Ret<ffi::AnyBuffer>());  // dx

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_fc_upd, fc_upd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // dz
                                  .Ret<ffi::AnyBuffer>()  // dw
                                  .Ret<ffi::AnyBuffer>());  // db

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_fc_upd_sgd, fc_upd_sgd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // dz
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Arg<ffi::AnyBuffer>()  // mw
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Arg<ffi::AnyBuffer>()  // mb
                                  .Arg<ffi::AnyBuffer>()  // lr
                                  .Arg<ffi::AnyBuffer>()  // after: ordering only, not read
                                  .Ret<ffi::AnyBuffer>()  // w
                                  .Ret<ffi::AnyBuffer>()  // mw
                                  .Ret<ffi::AnyBuffer>()  // b
                                  .Ret<ffi::AnyBuffer>()  // mb
                                  .Attr<float>("momentum")
                                  .Attr<float>("weight_decay")
                                  .Attr<bool>("nesterov"));

}  // namespace jb
