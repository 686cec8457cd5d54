// XLA FFI handlers of the fully-connected layer (jb.dense): thin wrappers that decode and
// validate the buffers, then call cpp/layers/fc.
//
//   jb_fc_fwd       x (.., N, C), w (.., C, K), bias (.., K) or (.., 0)
//                   -> y (.., N, K), z (.., N, K) for gelu else empty      attrs act, products
//   jb_fc_act_grad  dy (.., N, K), saved (.., N, K) -> dz (.., N, K)       attr act
//   jb_fc_bwd       dz (.., N, K'), w (.., C, K) -> dx (.., N, C);  K' >= K (dz's first K
//                   columns)                                               attr products
//   jb_fc_upd       x (.., N, C'), dz (.., N, K') -> dw (.., C, K), db (.., K) or (.., 0);
//                   C' >= C, K' >= K (x's first C columns, dz's first K)  attr products
//   products (i64): fp32 emulated from that many bf16 products (1, 3, 6), 0 exact; fc.h
//   jb_fc_upd_sgd   x (N, C), dz (N, K), w (C, K), mw (C, K), b (K) or (0), mb like b,
//                   lr (), after (any; not read) -> w, mw, b, mb, updated in place
//                   (aliased to the inputs)
//                   attrs momentum, weight_decay, bias_weight_decay, nesterov: the weight
//                   update with SGD's step fused (fc::update_sgd); fp32 parameters, no
//                   leading dims
//   jb_fc_upd_adamw x (N, C), dz (N, K), w, mu, nu (C, K), b, bmu, bnu (K) or (0),
//                   scalars (3,) = (lr, 1 - b1^t, 1 - b2^t), after -> w, mu, nu, b, bmu, bnu
//                   in place; attrs b1, b2, c1, c2, eps, eps_root, weight_decay,
//                   bias_weight_decay: AdamW's step fused (fc::update_adamw)
//
// The leading dims (..) come from vmap (vmap_method="expand_dims"): an operand's leading
// dims broadcast numpy-style to the output's, so unbatched weights arrive with size-1
// dims and are read in place. When the weights are shared by every item and the
// activations are not, the items fold into the mini-batch: one layer call with N' = items
// * N instead of a loop.
//
// Every handler is asynchronous where its work is large enough to split
// (ffi_common.h's Launch): it returns a future, and XLA runs other thunks meanwhile.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "ffi/ffi_common.h"
#include "layers/fc/fc.h"

namespace jb {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_util;

ffi::Error fc_fwd(Launch& launch, ffi::AnyBuffer x, ffi::AnyBuffer w, F32 bias, ffi::Result<ffi::AnyBuffer> y,
                  ffi::Result<ffi::AnyBuffer> z, int32_t act_code, int64_t products) {
  const char* op = "jb_fc_fwd";
  JB_TRY(dt, kernel_dtype(op, {{"x", x.element_type()}, {"y", y->element_type()}, {"z", z->element_type()}}));
  JB_CHECK(check_products(op, products, dt == DType::f32, "operands"));
  JB_TRY(w_dt, kernel_dtype(op, {{"w", w.element_type()}}));
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
  JB_CHECK(expect_z(op, act, yd, z->dimensions()));
  if (items.count == 0 || n == 0 || k == 0) return ffi::Error::Success();
  if (c == 0) return invalid("jb_fc_fwd: x has no features (C = 0)");

  const bool gelu = act == Activation::gelu;
  return guarded(op, [&] {
    // Weights shared by every item: the items fold into the mini-batch.
    per_item(items, lw.shared && lb.shared && lx.dense, [&](int64_t count, int64_t i) {
      launch(fc::forward_job(launch.threads(), dispatch(), {count * n, c, k, dt, act, 0, 0, products},
                             ptr(x, items.offset(lx, i)),
                             ptr(w, items.offset(lw, i)), w_dt,
                             has_bias ? bias.typed_data() + items.offset(lb, i) : nullptr, ptr(y, i * n * k),
                             gelu ? ptr(z, i * n * k) : nullptr));
    });
  });
}

ffi::Error fc_act_grad(Launch& launch, ffi::AnyBuffer dy, ffi::AnyBuffer saved,
                       ffi::Result<ffi::AnyBuffer> dz, int32_t act_code) {
  const char* op = "jb_fc_act_grad";
  JB_TRY(dt, kernel_dtype(op, {{"dy", dy.element_type()}, {"saved", saved.element_type()}, {"dz", dz->element_type()}}));
  JB_TRY(act, activation(op, act_code));
  if (act == Activation::none) return invalid("jb_fc_act_grad: needs an activation");
  const auto dd = dz->dimensions();
  if (dd.size() < 2) return invalid("jb_fc_act_grad: dz needs rank >= 2");
  const int64_t n = dd[dd.size() - 2], k = dd[dd.size() - 1];
  const Items items = items_of(dd, 2);
  JB_TRY(ldy, operand(op, "dy", dy.dimensions(), {n, k}, items));
  JB_TRY(ls, operand(op, "saved", saved.dimensions(), {n, k}, items));
  if (items.count == 0 || n == 0 || k == 0) return ffi::Error::Success();
  return guarded(op, [&] {
    per_item(items, ldy.dense && ls.dense, [&](int64_t count, int64_t i) {
      launch(fc::act_grad_job(launch.threads(), dispatch(), {count * n, 0, k, dt, act}, ptr(dy, items.offset(ldy, i)),
                              ptr(saved, items.offset(ls, i)), ptr(dz, i * n * k)));
    });
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

ffi::Error fc_bwd(Launch& launch, ffi::AnyBuffer dz, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> dx,
                  int64_t products) {
  const char* op = "jb_fc_bwd";
  JB_TRY(dt, kernel_dtype(op, {{"dz", dz.element_type()}, {"dx", dx->element_type()}}));
  JB_CHECK(check_products(op, products, dt == DType::f32, "operands"));
  JB_TRY(w_dt, kernel_dtype(op, {{"w", w.element_type()}}));
  const auto xd = dx->dimensions(), wd = w.dimensions();
  if (xd.size() < 2 || wd.size() < 2) return invalid("jb_fc_bwd: dx and w need rank >= 2");
  const int64_t n = xd[xd.size() - 2], c = xd[xd.size() - 1], k = wd[wd.size() - 1];
  const Items items = items_of(xd, 2);
  JB_TRY(ldz, dz_columns(op, dz.dimensions(), k));
  JB_TRY(lz, operand(op, "dz", dz.dimensions(), {n, ldz}, items));
  JB_TRY(lw, operand(op, "w", wd, {c, k}, items));
  if (items.count == 0 || n == 0 || c == 0) return ffi::Error::Success();
  if (k == 0) return invalid("jb_fc_bwd: w has no output features (K = 0)");
  return guarded(op, [&] {
    per_item(items, lw.shared && lz.dense, [&](int64_t count, int64_t i) {
      launch(fc::backward_job(launch.threads(), dispatch(), {count * n, c, k, dt, Activation::none, 0, ldz, products},
                              ptr(dz, items.offset(lz, i)), ptr(w, items.offset(lw, i)), w_dt, ptr(dx, i * n * c)));
    });
  });
}

ffi::Error fc_upd(Launch& launch, ffi::AnyBuffer x, ffi::AnyBuffer dz, ffi::Result<ffi::AnyBuffer> dw,
                  F32Out db, int64_t products) {
  const char* op = "jb_fc_upd";
  JB_TRY(dt, kernel_dtype(op, {{"x", x.element_type()}, {"dz", dz.element_type()}}));
  JB_CHECK(check_products(op, products, dt == DType::f32, "operands"));
  JB_TRY(w_dt, kernel_dtype(op, {{"dw", dw->element_type()}}));
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
  JB_CHECK(expect_db(op, db->dimensions(), wd, 2, k));
  if (items.count == 0 || c == 0 || k == 0) return ffi::Error::Success();
  const bool has_db = db->element_count() != 0;
  return guarded(op, [&] {
    for (int64_t i = 0; i < items.count; ++i)
      launch(fc::update_job(launch.threads(), dispatch(), {n, c, k, dt, Activation::none, ldx, ldz, products},
                            ptr(x, items.offset(lx, i)), ptr(dz, items.offset(lz, i)), ptr(dw, i * c * k), w_dt,
                            has_db ? db->typed_data() + i * k : nullptr));
  });
}

// The fused updates' shapes: x (N, C), dz (N, K), w (C, K) and its state like it, the bias
// and its state (K) or all empty.
ffi::Error check_fused(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& dz, const F32& w,
                       std::initializer_list<const F32*> w_state, const F32& b,
                       std::initializer_list<const F32*> b_state) {
  JB_TRY(dt, kernel_dtype(op, {{"x", x.element_type()}, {"dz", dz.element_type()}}));
  (void)dt;
  const auto xd = x.dimensions(), zd = dz.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || zd.size() != 2 || wd.size() != 2)
    return invalid(std::string(op) + ": x, dz and w must be matrices");
  const int64_t n = xd[0], c = xd[1], k = zd[1];
  if (zd[0] != n || wd[0] != c || wd[1] != k)
    return invalid(std::string(op) + ": x " + dims_str(xd) + ", dz " + dims_str(zd) + " and w " + dims_str(wd) +
                   " do not match (N, C), (N, K), (C, K)");
  for (const F32* m : w_state)
    if (int64_t(m->element_count()) != c * k) return invalid(std::string(op) + ": w's state must have w's shape");
  const bool has_b = b.element_count() != 0;
  if (has_b && int64_t(b.element_count()) != k) return invalid(std::string(op) + ": b must have K elements or none");
  for (const F32* m : b_state)
    if (m->element_count() != b.element_count()) return invalid(std::string(op) + ": b's state must have b's shape");
  return ffi::Error::Success();
}

// Aliased: the outputs are the inputs' buffers. Copied first if XLA gave others.
void alias_inputs(std::initializer_list<const F32*> ins, std::initializer_list<F32Out*> outs) {
  auto o = outs.begin();
  for (const F32* in : ins) {
    F32Out& out = **o++;
    if (out->untyped_data() != in->untyped_data() && in->size_bytes())
      std::memcpy(out->untyped_data(), in->untyped_data(), in->size_bytes());
  }
}

ffi::Error fc_upd_sgd(Launch& launch, ffi::AnyBuffer x, ffi::AnyBuffer dz, F32 w, F32 mw, F32 b, F32 mb,
                      F32 lr, ffi::AnyBuffer /*after*/, F32Out w_out, F32Out mw_out, F32Out b_out, F32Out mb_out,
                      float momentum, float weight_decay, float bias_weight_decay, bool nesterov) {
  const char* op = "jb_fc_upd_sgd";
  JB_CHECK(check_fused(op, x, dz, w, {&mw}, b, {&mb}));
  if (lr.element_count() != 1) return invalid("jb_fc_upd_sgd: lr must be a scalar");
  alias_inputs({&w, &mw, &b, &mb}, {&w_out, &mw_out, &b_out, &mb_out});
  JB_TRY(dt, kernel_dtype(op, {{"x", x.element_type()}, {"dz", dz.element_type()}}));
  const int64_t n = x.dimensions()[0], c = x.dimensions()[1], k = dz.dimensions()[1];
  const bool has_b = b.element_count() != 0;
  const fc::Sgd o{*lr.typed_data(), momentum, weight_decay, nesterov, bias_weight_decay};
  return guarded(op, [&] {
    launch(fc::update_sgd_job(launch.threads(), dispatch(), {n, c, k, dt}, x.untyped_data(), dz.untyped_data(), o,
                              w_out->typed_data(), mw_out->typed_data(), has_b ? b_out->typed_data() : nullptr,
                              has_b ? mb_out->typed_data() : nullptr));
  });
}

ffi::Error fc_upd_adamw(Launch& launch, ffi::AnyBuffer x, ffi::AnyBuffer dz, F32 w, F32 mu, F32 nu, F32 b, F32 bmu,
                        F32 bnu, F32 scalars, ffi::AnyBuffer /*after*/, F32Out w_out, F32Out mu_out, F32Out nu_out,
                        F32Out b_out, F32Out bmu_out, F32Out bnu_out, float b1, float b2, float c1, float c2,
                        float eps, float eps_root, float weight_decay, float bias_weight_decay) {
  const char* op = "jb_fc_upd_adamw";
  JB_CHECK(check_fused(op, x, dz, w, {&mu, &nu}, b, {&bmu, &bnu}));
  if (scalars.element_count() != 3) return invalid("jb_fc_upd_adamw: scalars must be (lr, 1 - b1^t, 1 - b2^t)");
  alias_inputs({&w, &mu, &nu, &b, &bmu, &bnu}, {&w_out, &mu_out, &nu_out, &b_out, &bmu_out, &bnu_out});
  JB_TRY(dt, kernel_dtype(op, {{"x", x.element_type()}, {"dz", dz.element_type()}}));
  const int64_t n = x.dimensions()[0], c = x.dimensions()[1], k = dz.dimensions()[1];
  const bool has_b = b.element_count() != 0;
  const float* sc = scalars.typed_data();
  const fc::AdamW o{sc[0], b1, b2, c1, c2, eps, eps_root, weight_decay, sc[1], sc[2], bias_weight_decay};
  return guarded(op, [&] {
    launch(fc::update_adamw_job(launch.threads(), dispatch(), {n, c, k, dt}, x.untyped_data(), dz.untyped_data(),
                                o, w_out->typed_data(), mu_out->typed_data(), nu_out->typed_data(),
                                has_b ? b_out->typed_data() : nullptr, has_b ? bmu_out->typed_data() : nullptr,
                                has_b ? bnu_out->typed_data() : nullptr));
  });
}

// The handlers XLA calls: validate and build the passes' jobs, then return the future of
// the ones worth running asynchronously (see Launch).
ffi::Future fc_fwd_async(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, F32 bias,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> z, int32_t act_code,
                         int64_t products) {
  Launch launch(pool);
  return launch.finish(fc_fwd(launch, x, w, bias, y, z, act_code, products));
}

ffi::Future fc_act_grad_async(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer saved,
                              ffi::Result<ffi::AnyBuffer> dz, int32_t act_code) {
  Launch launch(pool);
  return launch.finish(fc_act_grad(launch, dy, saved, dz, act_code));
}

ffi::Future fc_bwd_async(ffi::ThreadPool pool, ffi::AnyBuffer dz, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> dx,
                         int64_t products) {
  Launch launch(pool);
  return launch.finish(fc_bwd(launch, dz, w, dx, products));
}

ffi::Future fc_upd_async(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dz, ffi::Result<ffi::AnyBuffer> dw,
                         F32Out db, int64_t products) {
  Launch launch(pool);
  return launch.finish(fc_upd(launch, x, dz, dw, db, products));
}

ffi::Future fc_upd_sgd_async(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dz, F32 w, F32 mw, F32 b,
                             F32 mb, F32 lr, ffi::AnyBuffer after, F32Out w_out, F32Out mw_out, F32Out b_out,
                             F32Out mb_out, float momentum, float weight_decay, float bias_weight_decay,
                             bool nesterov) {
  Launch launch(pool);
  return launch.finish(fc_upd_sgd(launch, x, dz, w, mw, b, mb, lr, after, w_out, mw_out, b_out, mb_out, momentum,
                                  weight_decay, bias_weight_decay, nesterov));
}

ffi::Future fc_upd_adamw_async(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dz, F32 w, F32 mu, F32 nu,
                               F32 b, F32 bmu, F32 bnu, F32 scalars, ffi::AnyBuffer after, F32Out w_out,
                               F32Out mu_out, F32Out nu_out, F32Out b_out, F32Out bmu_out, F32Out bnu_out, float b1,
                               float b2, float c1, float c2, float eps, float eps_root, float weight_decay,
                               float bias_weight_decay) {
  Launch launch(pool);
  return launch.finish(fc_upd_adamw(launch, x, dz, w, mu, nu, b, bmu, bnu, scalars, after, w_out, mu_out, nu_out,
                                    b_out, bmu_out, bnu_out, b1, b2, c1, c2, eps, eps_root, weight_decay,
                                    bias_weight_decay));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_fc_fwd, fc_fwd_async, ffi_util::bind(fc_fwd_async, "act", "products"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_fc_act_grad, fc_act_grad_async, ffi_util::bind(fc_act_grad_async, "act"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_fc_bwd, fc_bwd_async, ffi_util::bind(fc_bwd_async, "products"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_fc_upd, fc_upd_async, ffi_util::bind(fc_upd_async, "products"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_fc_upd_sgd, fc_upd_sgd_async,
                              ffi_util::bind(fc_upd_sgd_async, "momentum", "weight_decay", "bias_weight_decay",
                                             "nesterov"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_fc_upd_adamw, fc_upd_adamw_async,
                              ffi_util::bind(fc_upd_adamw_async, "b1", "b2", "c1", "c2", "eps", "eps_root",
                                             "weight_decay", "bias_weight_decay"));

}  // namespace jb
