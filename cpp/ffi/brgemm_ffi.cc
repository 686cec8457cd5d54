// XLA FFI handlers of jax_brgemm.brgemm:  out[l] = (c[l] +) sum_i a[l, i] @ b[l, i].
//
// a: (..., B, M, K), b: (..., B, K, N), c: (..., M, N), out: (..., M, N). The leading dims
// broadcast numpy-style, so vmap's unbatched operands and the backward pass's shared
// operands are read in place, never materialized. Decodes and validates, then calls
// cpp/layers/batch_reduce; asynchronous where the work is large enough to split.
// attr products (i64): fp32 a, b and out emulated from that many bf16 products (1, 3, 6;
// 0 exact).
#include <string>
#include <vector>

#include "ffi/ffi_common.h"
#include "layers/batch_reduce.h"

namespace jb {
namespace {

namespace ffi = xla::ffi;
using namespace ffi_util;

ffi::Error brgemm_impl(Launch& launch, ffi::AnyBuffer a, ffi::AnyBuffer b, const ffi::AnyBuffer* c,
                       ffi::Result<ffi::AnyBuffer> out, int64_t products) {
  const char* op = "brgemm";
  JB_TRY(ab, kernel_dtype(op, {{"a", a.element_type()}, {"b", b.element_type()}}));
  JB_TRY(cdt, kernel_dtype(op, {{"the output", out->element_type()}}));
  JB_CHECK(check_products(op, products, ab == DType::f32 && cdt == DType::f32, "a, b and output"));
  if (c && c->element_type() != out->element_type())
    return invalid("brgemm: c must have the output's dtype");

  const auto ad = a.dimensions(), bd = b.dimensions(), od = out->dimensions();
  if (ad.size() < 3 || bd.size() < 3 || od.size() < 2)
    return invalid("brgemm: a and b need rank >= 3, the output rank >= 2");
  const int64_t batch = ad[ad.size() - 3], m = ad[ad.size() - 2], k = ad[ad.size() - 1];
  const int64_t n = bd[bd.size() - 1];
  if (od[od.size() - 2] != m || od[od.size() - 1] != n)
    return invalid("brgemm: out " + dims_str(od) + " is not (..., M, N) for a " + dims_str(ad) +
                   " and b " + dims_str(bd));
  const Items items = items_of(od, 2);
  JB_TRY(la, operand(op, "a", ad, {batch, m, k}, items));
  JB_TRY(lb, operand(op, "b", bd, {batch, k, n}, items));
  Lead lc;
  if (c) {
    JB_TRY(l, operand(op, "c", c->dimensions(), {m, n}, items));
    lc = l;
  }
  if (items.count == 0 || m == 0 || n == 0) return ffi::Error::Success();

  // Where each item's operands start (the caller's memory; workers never allocate).
  std::vector<int64_t> offs(size_t(3 * items.count));
  for (int64_t l = 0; l < items.count; ++l) {
    offs[l] = items.offset(la, l);
    offs[items.count + l] = items.offset(lb, l);
    offs[2 * items.count + l] = c ? items.offset(lc, l) : 0;
  }
  batch_reduce::Shape s;
  s.items = items.count;
  s.batch = batch;
  s.m = m;
  s.k = k;
  s.n = n;
  s.ab = ab;
  s.out = cdt;
  s.accumulate = c != nullptr;
  s.b_matrices = int64_t(b.element_count()) / std::max<int64_t>(1, k * n);
  s.products = products;
  s.a_elements = int64_t(a.element_count());
  return guarded(op, [&] {
    launch(batch_reduce::run_job(launch.threads(), dispatch(), s, a.untyped_data(), b.untyped_data(),
                                 c ? c->untyped_data() : nullptr, out->untyped_data(),
                                 {offs.data(), offs.data() + items.count, offs.data() + 2 * items.count}));
  });
}

// Asynchronous where the work is large enough to split (ffi_common.h's Launch).
ffi::Future brgemm_async(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> out,
                         int64_t products) {
  Launch launch(pool);
  return launch.finish(brgemm_impl(launch, a, b, nullptr, out, products));
}

ffi::Future brgemm_acc_async(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer c,
                             ffi::Result<ffi::AnyBuffer> out, int64_t products) {
  Launch launch(pool);
  return launch.finish(brgemm_impl(launch, a, b, &c, out, products));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_brgemm, brgemm_async, ffi_util::bind(brgemm_async, "products"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_brgemm_acc, brgemm_acc_async, ffi_util::bind(brgemm_acc_async, "products"));

}  // namespace jb
