// XLA FFI handlers of the fully-connected layer (jb.dense): thin wrappers that decode and
// validate the buffers, then call cpp/layers/fc.
//
//   jb_fc_fwd       x (.., N, C), w (.., C, K), bias (.., K) or (.., 0)
//                   -> y (.., N, K), z (.., N, K) for gelu else empty      attr act
//   jb_fc_act_grad  dy (.., N, K), saved (.., N, K) -> dz (.., N, K)       attr act
//   jb_fc_bwd       dz (.., N, K), w (.., C, K) -> dx (.., N, C)
//   jb_fc_upd       x (.., N, C), dz (.., N, K) -> dw (.., C, K), db (.., K) or (.., 0)
//
// The leading dims (..) come from vmap (vmap_method="expand_dims"): an operand's leading
// dims broadcast numpy-style to the output's, so unbatched weights arrive with size-1
// dims and are read in place. When the weights are shared by every item and the
// activations are not, the items fold into the mini-batch: one layer call with N' = items
// * N instead of a loop.
#include <algorithm>
#include <exception>
#include <string>
#include <vector>

#include "ffi/ffi_common.h"
#include "layers/fc.h"

namespace jb {
namespace {

namespace ffi = xla::ffi;
using ffi_util::dims_str;
using ffi_util::invalid;

// How one operand is laid out over the output's leading dims.
struct Lead {
  std::vector<int64_t> stride;  // elements per step of each leading dim; 0 where broadcast
  bool shared = true;           // broadcast over every leading dim (one matrix for all items)
  bool dense = true;            // one distinct, contiguous matrix per item
};

struct Items {
  std::vector<int64_t> dims;  // the output's leading dims
  int64_t count = 1;

  int64_t offset(const Lead& l, int64_t item) const {
    int64_t off = 0;
    for (int64_t d = int64_t(dims.size()) - 1; d >= 0; --d) {
      off += item % dims[d] * l.stride[d];
      item /= dims[d];
    }
    return off;
  }
};

Items items_of(ffi::AnyBuffer::Dimensions out, size_t inner) {
  Items it;
  it.dims.assign(out.begin(), out.end() - inner);
  for (int64_t d : it.dims) it.count *= d;
  return it;
}

// Checks that `dims` is (lead.., inner...) with `inner` trailing dims equal to `want`
// and lead broadcasting to the items' dims; returns its strides.
ffi::ErrorOr<Lead> operand(const char* op, const char* name, ffi::AnyBuffer::Dimensions dims,
                           const std::vector<int64_t>& want, const Items& items) {
  const size_t inner = want.size();
  auto shape_error = [&] {
    std::string w = "(..., ";
    for (size_t i = 0; i < inner; ++i) w += (i ? ", " : "") + std::to_string(want[i]);
    return ffi::Unexpected(invalid(std::string(op) + ": " + name + " has shape " + dims_str(dims) +
                                   ", expected " + w + ")"));
  };
  if (dims.size() < inner || dims.size() - inner > items.dims.size()) return shape_error();
  for (size_t i = 0; i < inner; ++i)
    if (dims[dims.size() - inner + i] != want[i]) return shape_error();
  int64_t matrix = 1;
  for (int64_t w : want) matrix *= w;
  const size_t rank = dims.size() - inner;
  Lead l;
  l.stride.assign(items.dims.size(), 0);
  int64_t stride = matrix;
  for (size_t d = 0; d < items.dims.size(); ++d) {
    const size_t od = items.dims.size() - 1 - d;
    const int64_t size = d < rank ? dims[rank - 1 - d] : 1;
    if (size != items.dims[od] && size != 1)
      return ffi::Unexpected(invalid(std::string(op) + ": the leading dims of " + name + " " +
                                     dims_str(dims) + " do not broadcast to the output's"));
    if (size == 1 && items.dims[od] != 1) l.dense = false;
    if (size != 1) l.shared = false;
    l.stride[od] = size == 1 ? 0 : stride;
    stride *= size;
  }
  return l;
}

ffi::ErrorOr<Activation> activation(const char* op, int32_t code) {
  if (code < 0 || code > int32_t(Activation::tanh))
    return ffi::Unexpected(invalid(std::string(op) + ": unknown activation code " + std::to_string(code)));
  return Activation(code);
}

// Runs a layer call, turning exceptions (bad sizes, out of memory, a bad JAX_BRGEMM_ISA)
// into an ffi::Error instead of letting them cross the C boundary.
template <class F>
ffi::Error guarded(const char* op, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(op) + ": " + e.what());
  }
  return ffi::Error::Success();
}

const char* ptr(const ffi::AnyBuffer& b, int64_t elems) {
  return static_cast<const char*>(b.untyped_data()) + elems * int64_t(ffi::ByteWidth(b.element_type()));
}
char* ptr(ffi::Result<ffi::AnyBuffer>& b, int64_t elems) {
  return static_cast<char*>(b->untyped_data()) + elems * int64_t(ffi::ByteWidth(b->element_type()));
}

#define JB_TRY(var, expr)              \
  auto var##_or = (expr);              \
  if (!var##_or.has_value()) return var##_or.error(); \
  const auto& var = var##_or.value()

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
  const auto* bias_f = static_cast<const float*>(bias.untyped_data());
  return guarded(op, [&] {
    if (lw.shared && lb.shared && lx.dense) {  // one layer over all items
      fc::forward(ex, {items.count * n, c, k, dt, act}, x.untyped_data(), w.untyped_data(), w_dt,
                  has_bias ? bias_f : nullptr, y->untyped_data(), gelu ? z->untyped_data() : nullptr);
      return;
    }
    for (int64_t i = 0; i < items.count; ++i)
      fc::forward(ex, {n, c, k, dt, act}, ptr(x, items.offset(lx, i)), ptr(w, items.offset(lw, i)),
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
  return guarded(op, [&] {
    if (ldy.dense && ls.dense) {
      fc::act_grad(ex, {items.count * n, 0, k, dt, act}, dy.untyped_data(), saved.untyped_data(),
                   dz->untyped_data());
      return;
    }
    for (int64_t i = 0; i < items.count; ++i)
      fc::act_grad(ex, {n, 0, k, dt, act}, ptr(dy, items.offset(ldy, i)),
                   ptr(saved, items.offset(ls, i)), ptr(dz, i * n * k));
  });
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
  JB_TRY(lz, operand(op, "dz", dz.dimensions(), {n, k}, items));
  JB_TRY(lw, operand(op, "w", wd, {c, k}, items));
  if (items.count == 0 || n == 0 || c == 0) return ffi::Error::Success();
  if (k == 0) return invalid("jb_fc_bwd: w has no output features (K = 0)");
  const Executor ex = ffi_util::executor(pool);
  return guarded(op, [&] {
    if (lw.shared && lz.dense) {
      fc::backward(ex, {items.count * n, c, k, dt, Activation::none}, dz.untyped_data(),
                   w.untyped_data(), w_dt, dx->untyped_data());
      return;
    }
    for (int64_t i = 0; i < items.count; ++i)
      fc::backward(ex, {n, c, k, dt, Activation::none}, ptr(dz, items.offset(lz, i)),
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
  const Items items = items_of(wd, 2);
  JB_TRY(lx, operand(op, "x", xd, {n, c}, items));
  JB_TRY(lz, operand(op, "dz", dz.dimensions(), {n, k}, items));
  const bool has_db = db->element_count() != 0;
  const auto bd = db->dimensions();
  if (has_db && (bd.size() != wd.size() - 1 || bd[bd.size() - 1] != k ||
                 !std::equal(wd.begin(), wd.end() - 2, bd.begin())))
    return invalid("jb_fc_upd: db " + dims_str(bd) + " must be dw's shape without C, or empty");
  if (items.count == 0 || c == 0 || k == 0) return ffi::Error::Success();
  const Executor ex = ffi_util::executor(pool);
  auto* db_f = static_cast<float*>(db->untyped_data());
  return guarded(op, [&] {
    for (int64_t i = 0; i < items.count; ++i)
      fc::update(ex, {n, c, k, dt, Activation::none}, ptr(x, items.offset(lx, i)),
                 ptr(dz, items.offset(lz, i)), ptr(dw, i * c * k), w_dt,
                 has_db ? db_f + i * k : nullptr);
  });
}

#undef JB_TRY

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

}  // namespace jb
