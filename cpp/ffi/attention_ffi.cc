// XLA FFI handlers of jb.dot_product_attention: decode and validate, then call
// cpp/layers/attention; asynchronous where the work is large enough to split.
//
//   jb_attention_fwd  q (.., T, N, H), k (.., S, K, H), v like k, bias (.., n, t, s) f32
//                     or empty, mask (.., n, t, s) pred or empty, keep (.., n, t,
//                     ceil(S / 8)) u8 or empty (the dropout's bits, attention.h's Inputs)
//                     -> o (.., T, N, H), stats (.., N, T, 2) f32 (row max and sum)
//   jb_attention_bwd  q, k, v, bias, mask, keep as above, o, stats, dout (o's shape)
//                     -> dq (q's shape), dk, dv (.., S, K, H), dbias (.., N, T, S) f32 or
//                        empty (not wanted)
//   jb_attention_jvp  q, k, v, bias, mask, keep, o, stats as above, tq (q's shape), tk, tv
//                     (k's), tbias (bias's shape, or empty) -> to (q's shape): the
//                     forward-mode tangent (exact products: products must be 0)
//   attrs scale (f32), causal (bool), products (i64: fp32 emulated from that many bf16
//         products, 0 exact; attention.h's Shape::products), keep_scale (f32: a kept
//         weight's factor, 1 / keep_prob)
//
// The output's leading dims (..) are the items (the batch, and vmap's dims under
// vmap_method="expand_dims"); every operand's leading dims broadcast to them, and bias and
// mask dims n, t, s are each N, T, S or 1 (broadcast). q, k, v, o, dout and the gradients
// share one dtype, float32 or bfloat16.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "ffi/ffi_common.h"
#include "layers/attention/attention.h"

namespace jb {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_util;

// Element offsets of every item's first element in an operand laid out as l.
std::vector<int64_t> offsets(const Items& items, const Lead& l) {
  std::vector<int64_t> offs(size_t(items.count));
  for (int64_t i = 0; i < items.count; ++i) offs[size_t(i)] = items.offset(l, i);
  return offs;
}

// An output's expected dims: the items' dims, then `inner`.
std::vector<int64_t> dims_of(const Items& items, std::initializer_list<int64_t> inner) {
  std::vector<int64_t> d = items.dims;
  d.insert(d.end(), inner);
  return d;
}

// The decoded inputs both handlers share.
struct Decoded {
  attention::Shape s;
  Items items;
  std::vector<int64_t> q_offs, k_offs, v_offs, bias_offs, mask_offs, keep_offs;
  std::vector<int64_t> o_offs, g_offs, s_offs;  // the backward's saved operands
  std::vector<int64_t> tq_offs, tk_offs, tv_offs, tb_offs;  // the tangents
  attention::Inputs in;
};

// Bias, mask or keep: absent when empty; else (.., n, t, s) with n, t, s each full or 1 (for
// keep, bits: s is the row's bytes, exactly ceil(S / 8)).
template <class Buffer>
ffi::Error broadcast(const char* op, const char* name, const Buffer& b, const Decoded& dec,
                     attention::Broadcast* out, std::vector<int64_t>* offs, bool bits = false) {
  if (b.element_count() == 0) return ffi::Error::Success();
  const auto d = b.dimensions();
  const int64_t full[3] = {dec.s.heads, dec.s.t, bits ? (dec.s.s + 7) / 8 : dec.s.s};
  if (bits && (d.size() == 0 || d[d.size() - 1] != full[2]))
    return invalid(std::string(op) + ": " + name + " has shape " + dims_str(d) + ", expected rows of ceil(S / 8) = " +
                   std::to_string(full[2]) + " bytes");
  bool ok = d.size() >= 3;
  for (size_t i = 0; ok && i < 3; ++i) ok = d[d.size() - 3 + i] == full[i] || d[d.size() - 3 + i] == 1;
  if (!ok)
    return invalid(std::string(op) + ": " + name + " has shape " + dims_str(d) +
                   ", expected (..., N or 1, T or 1, S or 1) with N, T, S = " + std::to_string(full[0]) + ", " +
                   std::to_string(full[1]) + ", " + std::to_string(full[2]));
  const int64_t bn = d[d.size() - 3], bt = d[d.size() - 2], bs = d[d.size() - 1];
  JB_TRY(lead, operand(op, name, d, {bn, bt, bs}, dec.items));
  *offs = offsets(dec.items, lead);
  out->data = b.untyped_data();
  out->offs = offs->data();
  out->ss = bs == 1 ? 0 : 1;
  out->st = bt == 1 ? 0 : bs;
  out->sn = bn == 1 ? 0 : bt * bs;
  return ffi::Error::Success();
}

// Checks q, k, v, bias and mask against the output's items (`out`, shaped like q).
ffi::Error decode(const char* op, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, const F32& bias,
                  ffi::AnyBuffer mask, ffi::AnyBuffer keep, ffi::AnyBuffer::Dimensions out, float scale, bool causal,
                  int64_t products, float keep_scale, Decoded* dec) {
  JB_TRY(dt, kernel_dtype(op, {{"q", q.element_type()}, {"k", k.element_type()}, {"v", v.element_type()}}));
  dec->s.dt = dt;
  if (mask.element_count() && mask.element_type() != ffi::DataType::PRED && mask.element_type() != ffi::DataType::U8)
    return invalid(std::string(op) + ": mask must be bool");
  if (keep.element_count() && keep.element_type() != ffi::DataType::U8)
    return invalid(std::string(op) + ": keep must be uint8 (the dropout's bits)");
  if (keep.element_count() && !(keep_scale >= 1.0f && std::isfinite(keep_scale)))
    return invalid(std::string(op) + ": keep_scale must be 1 / keep_prob, finite and >= 1");
  const auto kd = k.dimensions();
  if (out.size() < 3 || kd.size() < 3) return invalid(std::string(op) + ": q and k need rank >= 3");
  Decoded& d = *dec;
  d.items = items_of(out, 3);
  d.s.items = d.items.count;
  d.s.t = out[out.size() - 3];
  d.s.heads = out[out.size() - 2];
  d.s.h = out[out.size() - 1];
  d.s.s = kd[kd.size() - 3];
  d.s.kv_heads = kd[kd.size() - 2];
  d.s.scale = scale;
  d.s.causal = causal;
  d.s.products = products;
  JB_CHECK(check_products(op, products, dt == DType::f32, "q, k and v"));
  if (d.s.kv_heads < 1 || d.s.heads % d.s.kv_heads != 0)
    return invalid(std::string(op) + ": the key/value heads K = " + std::to_string(d.s.kv_heads) +
                   " must divide the query heads N = " + std::to_string(d.s.heads));
  JB_TRY(lq, operand(op, "q", q.dimensions(), {d.s.t, d.s.heads, d.s.h}, d.items));
  JB_TRY(lk, operand(op, "k", kd, {d.s.s, d.s.kv_heads, d.s.h}, d.items));
  JB_TRY(lv, operand(op, "v", v.dimensions(), {d.s.s, d.s.kv_heads, d.s.h}, d.items));
  d.q_offs = offsets(d.items, lq);
  d.k_offs = offsets(d.items, lk);
  d.v_offs = offsets(d.items, lv);
  d.in.q = q.untyped_data(), d.in.k = k.untyped_data(), d.in.v = v.untyped_data();
  d.in.q_offs = d.q_offs.data(), d.in.k_offs = d.k_offs.data(), d.in.v_offs = d.v_offs.data();
  JB_CHECK(broadcast(op, "bias", bias, d, &d.in.bias, &d.bias_offs));
  JB_CHECK(broadcast(op, "mask", mask, d, &d.in.mask, &d.mask_offs));
  JB_CHECK(broadcast(op, "keep", keep, d, &d.in.keep, &d.keep_offs, true));
  d.in.keep_scale = keep_scale;
  return ffi::Error::Success();
}

ffi::Error attention_fwd(Launch& launch, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, F32 bias,
                         ffi::AnyBuffer mask, ffi::AnyBuffer keep, ffi::Result<ffi::AnyBuffer> o, F32Out stats,
                         float scale, bool causal, int64_t products, float keep_scale) {
  const char* op = "jb_attention_fwd";
  auto decoded = std::make_shared<Decoded>();  // its offset arrays live as long as the job
  Decoded& d = *decoded;
  JB_CHECK(decode(op, q, k, v, bias, mask, keep, o->dimensions(), scale, causal, products, keep_scale, &d));
  JB_CHECK(expect_dtype(op, q.element_type(), {{"o", o->element_type()}}));
  JB_CHECK(expect_dims(op, "stats", stats->dimensions(), dims_of(d.items, {d.s.heads, d.s.t, 2})));
  if (o->element_count() == 0) {  // H = 0: nothing to attend with
    std::fill_n(stats->typed_data(), stats->element_count(), 0.0f);
    return ffi::Error::Success();
  }
  return guarded(op, [&] {
    Job job = attention::forward_job(launch.threads(), dispatch(), d.s, d.in, o->untyped_data(), stats->typed_data());
    job.keep.push_back(decoded);
    launch(std::move(job));
  });
}

ffi::Error attention_bwd(Launch& launch, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, F32 bias,
                         ffi::AnyBuffer mask, ffi::AnyBuffer keep, ffi::AnyBuffer o, F32 stats, ffi::AnyBuffer dout,
                         ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                         ffi::Result<ffi::AnyBuffer> dv, F32Out dbias, float scale, bool causal,
                         int64_t products, float keep_scale) {
  const char* op = "jb_attention_bwd";
  auto decoded = std::make_shared<Decoded>();
  Decoded& d = *decoded;
  JB_CHECK(decode(op, q, k, v, bias, mask, keep, dq->dimensions(), scale, causal, products, keep_scale, &d));
  JB_CHECK(expect_dtype(op, q.element_type(), {{"o", o.element_type()}, {"dout", dout.element_type()},
                                               {"dq", dq->element_type()}, {"dk", dk->element_type()},
                                               {"dv", dv->element_type()}}));
  JB_TRY(lo, operand(op, "o", o.dimensions(), {d.s.t, d.s.heads, d.s.h}, d.items));
  JB_TRY(lg, operand(op, "dout", dout.dimensions(), {d.s.t, d.s.heads, d.s.h}, d.items));
  JB_TRY(ls, operand(op, "stats", stats.dimensions(), {d.s.heads, d.s.t, 2}, d.items));
  JB_CHECK(expect_dims(op, "dk", dk->dimensions(), dims_of(d.items, {d.s.s, d.s.kv_heads, d.s.h})));
  JB_CHECK(expect_dims(op, "dv", dv->dimensions(), dims_of(d.items, {d.s.s, d.s.kv_heads, d.s.h})));
  const bool want_dbias = dbias->element_count() != 0;
  if (want_dbias) JB_CHECK(expect_dims(op, "dbias", dbias->dimensions(), dims_of(d.items, {d.s.heads, d.s.t, d.s.s})));
  if (dq->element_count() == 0 && dk->element_count() == 0) return ffi::Error::Success();
  d.o_offs = offsets(d.items, lo), d.g_offs = offsets(d.items, lg), d.s_offs = offsets(d.items, ls);
  attention::Saved saved;
  saved.o = o.untyped_data(), saved.dout = dout.untyped_data();
  saved.stats = stats.typed_data();
  saved.o_offs = d.o_offs.data(), saved.dout_offs = d.g_offs.data(), saved.stats_offs = d.s_offs.data();
  return guarded(op, [&] {
    Job job = attention::backward_job(launch.threads(), dispatch(), d.s, d.in, saved, dq->untyped_data(),
                                      dk->untyped_data(), dv->untyped_data(),
                                      want_dbias ? dbias->typed_data() : nullptr);
    job.keep.push_back(decoded);
    launch(std::move(job));
  });
}

ffi::Error attention_jvp(Launch& launch, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, F32 bias,
                         ffi::AnyBuffer mask, ffi::AnyBuffer keep, ffi::AnyBuffer o, F32 stats, ffi::AnyBuffer tq,
                         ffi::AnyBuffer tk, ffi::AnyBuffer tv, F32 tbias, ffi::Result<ffi::AnyBuffer> to, float scale,
                         bool causal, int64_t products, float keep_scale) {
  const char* op = "jb_attention_jvp";
  auto decoded = std::make_shared<Decoded>();
  Decoded& d = *decoded;
  JB_CHECK(decode(op, q, k, v, bias, mask, keep, to->dimensions(), scale, causal, products, keep_scale, &d));
  if (products) return invalid(std::string(op) + ": the tangent multiplies exactly (products must be 0)");
  JB_CHECK(expect_dtype(op, q.element_type(), {{"o", o.element_type()}, {"tq", tq.element_type()},
                                               {"tk", tk.element_type()}, {"tv", tv.element_type()},
                                               {"to", to->element_type()}}));
  JB_TRY(lo, operand(op, "o", o.dimensions(), {d.s.t, d.s.heads, d.s.h}, d.items));
  JB_TRY(ls, operand(op, "stats", stats.dimensions(), {d.s.heads, d.s.t, 2}, d.items));
  JB_TRY(ltq, operand(op, "tq", tq.dimensions(), {d.s.t, d.s.heads, d.s.h}, d.items));
  JB_TRY(ltk, operand(op, "tk", tk.dimensions(), {d.s.s, d.s.kv_heads, d.s.h}, d.items));
  JB_TRY(ltv, operand(op, "tv", tv.dimensions(), {d.s.s, d.s.kv_heads, d.s.h}, d.items));
  if (to->element_count() == 0) return ffi::Error::Success();
  d.o_offs = offsets(d.items, lo), d.s_offs = offsets(d.items, ls);
  d.tq_offs = offsets(d.items, ltq), d.tk_offs = offsets(d.items, ltk), d.tv_offs = offsets(d.items, ltv);
  attention::Saved saved;
  saved.o = o.untyped_data(), saved.stats = stats.typed_data();
  saved.o_offs = d.o_offs.data(), saved.stats_offs = d.s_offs.data();
  attention::Tangents tin;
  tin.q = tq.untyped_data(), tin.k = tk.untyped_data(), tin.v = tv.untyped_data();
  tin.q_offs = d.tq_offs.data(), tin.k_offs = d.tk_offs.data(), tin.v_offs = d.tv_offs.data();
  if (tbias.element_count()) {  // the bias's (n, t, s), so its strides; leading dims of its own
    const auto bd = bias.dimensions(), td = tbias.dimensions();
    bool same = d.in.bias.data && td.size() >= 3;
    for (size_t i = 1; same && i <= 3; ++i) same = td[td.size() - i] == bd[bd.size() - i];
    if (!same) return invalid(std::string(op) + ": tbias " + dims_str(td) + " must end as the bias " + dims_str(bd));
    JB_CHECK(broadcast(op, "tbias", tbias, d, &tin.bias, &d.tb_offs));
  }
  return guarded(op, [&] {
    Job job = attention::tangent_job(launch.threads(), dispatch(), d.s, d.in, saved, tin, to->untyped_data());
    job.keep.push_back(decoded);
    launch(std::move(job));
  });
}

// Asynchronous where the work is large enough to split (ffi_common.h's Launch).
ffi::Future attention_fwd_async(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, F32 bias,
                                ffi::AnyBuffer mask, ffi::AnyBuffer keep, ffi::Result<ffi::AnyBuffer> o, F32Out stats,
                                float scale, bool causal, int64_t products, float keep_scale) {
  Launch launch(pool);
  return launch.finish(attention_fwd(launch, q, k, v, bias, mask, keep, o, stats, scale, causal, products, keep_scale));
}

ffi::Future attention_bwd_async(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, F32 bias,
                                ffi::AnyBuffer mask, ffi::AnyBuffer keep, ffi::AnyBuffer o, F32 stats,
                                ffi::AnyBuffer dout, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                                ffi::Result<ffi::AnyBuffer> dv, F32Out dbias, float scale, bool causal,
                                int64_t products, float keep_scale) {
  Launch launch(pool);
  return launch.finish(attention_bwd(launch, q, k, v, bias, mask, keep, o, stats, dout, dq, dk, dv, dbias, scale,
                                     causal, products, keep_scale));
}

ffi::Future attention_jvp_async(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, F32 bias,
                                ffi::AnyBuffer mask, ffi::AnyBuffer keep, ffi::AnyBuffer o, F32 stats,
                                ffi::AnyBuffer tq, ffi::AnyBuffer tk, ffi::AnyBuffer tv, F32 tbias,
                                ffi::Result<ffi::AnyBuffer> to, float scale, bool causal, int64_t products,
                                float keep_scale) {
  Launch launch(pool);
  return launch.finish(attention_jvp(launch, q, k, v, bias, mask, keep, o, stats, tq, tk, tv, tbias, to, scale,
                                     causal, products, keep_scale));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_attention_fwd, attention_fwd_async,
                              ffi_util::bind(attention_fwd_async, "scale", "causal", "products", "keep_scale"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_attention_bwd, attention_bwd_async,
                              ffi_util::bind(attention_bwd_async, "scale", "causal", "products", "keep_scale"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_attention_jvp, attention_jvp_async,
                              ffi_util::bind(attention_jvp_async, "scale", "causal", "products", "keep_scale"));

}  // namespace jb
