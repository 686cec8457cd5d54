// Helpers shared by the thin FFI handlers, the one set every handler's prologue uses: the
// pool adapter, dtype and shape checks that name the operand, numpy-style broadcasting of
// leading dims, calls per item or folded into the mini-batch, and C++ exceptions turned into
// ffi::Error. Operands that are always fp32 are typed ffi::Buffer<ffi::F32> (XLA checks them).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "brgemm/brgemm.h"
#include "layers/common/view.h"
#include "parallel/job.h"
#include "parallel/parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace jb::ffi_util {

namespace ffi = xla::ffi;

// An operand that is always fp32, as an input and as an output.
using F32 = ffi::Buffer<ffi::F32>;
using F32Out = ffi::Result<ffi::Buffer<ffi::F32>>;

// XLA's intra-op pool as an Executor for parallel_for. The pool lives for the whole call.
inline Executor executor(ffi::ThreadPool& pool) {
  Executor ex;
  ex.num_threads = std::max<int64_t>(1, pool.num_threads());
  ex.schedule = [&pool](std::function<void()> task) { pool.Schedule(std::move(task)); };
  return ex;
}

// Whether handlers may return before their work is done (dispatch().async_calls at load;
// jax_brgemm._jax_brgemm.set_async switches it for benchmarks). Results are the same bits
// either way.
inline std::atomic<bool>& async_enabled() {
  static std::atomic<bool> on{dispatch().async_calls};
  return on;
}

// Below this much work (flops, or bytes for element-wise passes) a call runs synchronously:
// scheduling the workers and signalling the runtime would cost more than overlap can win.
constexpr double kAsyncMinWork = 1e6;

// Runs a handler's layer calls (Jobs): a small one at once, on the calling thread and the
// pool; the others, once the handler has validated everything, asynchronously: the workers
// are scheduled on XLA's pool inside the handler (the pool is only valid during the call),
// and the last one to finish sets the promise of the future the handler returns.
class Launch {
 public:
  explicit Launch(ffi::ThreadPool& pool) : pool_(pool), threads_(std::max<int64_t>(1, pool.num_threads())) {}
  int64_t threads() const { return threads_; }
  void operator()(Job job) {
    if (!async_enabled().load(std::memory_order_relaxed) || threads_ < 2 || job.flops < kAsyncMinWork)
      return run(executor(pool_), std::move(job));
    const char* name = job.name;
    pending_.then(std::move(job));
    pending_.name = name;
  }
  // The handler's result: `error`, or the future of the pending jobs.
  ffi::Future finish(const ffi::Error& error) {
    ffi::Promise promise;
    ffi::Future future(promise);
    if (error.failure()) {
      promise.SetError(error);
      return future;
    }
    ffi::ThreadPool& pool = pool_;
    run_async([&pool](std::function<void()> task) { pool.Schedule(std::move(task)); }, threads_,
              std::move(pending_), [promise]() mutable { promise.SetAvailable(); });
    return future;
  }

 private:
  ffi::ThreadPool& pool_;
  const int64_t threads_;
  Job pending_;
};

inline ffi::Error invalid(const std::string& what) { return ffi::Error::InvalidArgument(what); }

// The `products` attr of an emulating handler: 0 (exact), 1, 3 or 6, the latter from fp32
// operands only (`f32`: they are; `operands` names them in the error).
inline ffi::Error check_products(const char* op, int64_t products, bool f32, const char* operands) {
  if (products != 0 && products != 1 && products != 3 && products != 6)
    return invalid(std::string(op) + ": products = " + std::to_string(products) + "; 0 (exact), 1, 3 or 6");
  if (products && !f32)
    return invalid(std::string(op) + ": emulated products (products = " + std::to_string(products) + ") take float32 " +
                   operands);
  return ffi::Error::Success();
}

// `var` = the value of an ffi::ErrorOr expression, or return its error.
#define JB_TRY(var, expr)                              \
  auto var##_or = (expr);                              \
  if (!var##_or.has_value()) return var##_or.error(); \
  const auto& var = var##_or.value()

// Return the ffi::Error of `expr` unless it is a success.
#define JB_CHECK(expr)                 \
  do {                                 \
    ffi::Error error_ = (expr);        \
    if (error_.failure()) return error_; \
  } while (0)

// Dims (a buffer's, or a list of sizes) as a Python tuple.
template <class Dims>
std::string dims_str(const Dims& dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

// ---------------------------------------------------------------------------------------
// Dtypes. Operands of the compute dtype are fp32 or bf16, the two dtypes every kernel takes.

struct Named {
  const char* name;
  ffi::DataType type;
};

inline std::string names_str(std::initializer_list<Named> operands) {
  std::string s;
  size_t i = 0;
  for (const Named& o : operands) s += (i++ == 0 ? "" : i == operands.size() ? " and " : ", ") + std::string(o.name);
  return s;
}

// The kernel dtype the operands share ("x must be float32 or bfloat16", "a and b must both
// be ...", "x, y and z must all be ..." otherwise).
inline ffi::ErrorOr<DType> kernel_dtype(const char* op, std::initializer_list<Named> operands) {
  const ffi::DataType t = operands.begin()->type;
  bool same = t == ffi::DataType::F32 || t == ffi::DataType::BF16;
  for (const Named& o : operands) same = same && o.type == t;
  if (same) return t == ffi::DataType::F32 ? DType::f32 : DType::bf16;
  const char* each = operands.size() == 1 ? "" : operands.size() == 2 ? "both " : "all ";
  return ffi::Unexpected(invalid(std::string(op) + ": " + names_str(operands) + " must " +
                                 (operands.size() == 1 ? "be" : operands.size() == 2 ? "both be" : "all be") +
                                 " float32 or " + each + "bfloat16"));
}

// An error naming the first operand whose dtype is not `want` (the compute dtype's, or x's).
inline ffi::Error expect_dtype(const char* op, ffi::DataType want, std::initializer_list<Named> operands) {
  for (const Named& o : operands)
    if (o.type != want) return invalid(std::string(op) + ": " + o.name + " has the wrong dtype");
  return ffi::Error::Success();
}

// An error naming the operand unless its dims are exactly `want`.
inline ffi::Error expect_dims(const char* op, const char* name, ffi::AnyBuffer::Dimensions dims,
                              const std::vector<int64_t>& want) {
  if (dims.size() == want.size() && std::equal(want.begin(), want.end(), dims.begin()))
    return ffi::Error::Success();
  return invalid(std::string(op) + ": " + name + " has shape " + dims_str(dims) + ", expected " + dims_str(want));
}

// ---------------------------------------------------------------------------------------
// Leading dims. An op's output is (lead.., inner...): its items are the lead dims (vmap's
// batch dims, jb.brgemm's broadcast dims). Each operand's own leading dims broadcast to
// them numpy-style (right-aligned, size 1 repeats), so unbatched operands are read in place.

// How one operand is laid out over the output's leading dims.
struct Lead {
  std::vector<int64_t> stride;  // elements per step of each leading dim; 0 where broadcast
  bool shared = true;           // broadcast over every leading dim (one matrix for all items)
  bool dense = true;            // one distinct, contiguous matrix per item
};

struct Items {
  std::vector<int64_t> dims;  // the output's leading dims
  int64_t count = 1;

  // Element offset of item `item` (row-major over dims) in an operand laid out as l.
  int64_t offset(const Lead& l, int64_t item) const {
    int64_t off = 0;
    for (int64_t d = int64_t(dims.size()) - 1; d >= 0; --d) {
      off += item % dims[d] * l.stride[d];
      item /= dims[d];
    }
    return off;
  }
};

// The items of an output whose last `inner` dims are one item's result.
inline Items items_of(ffi::AnyBuffer::Dimensions out, size_t inner) {
  Items it;
  it.dims.assign(out.begin(), out.end() - inner);
  for (int64_t d : it.dims) it.count *= d;
  return it;
}

// Checks that `dims` is (lead.., inner...) with `inner` trailing dims equal to `want` and
// lead broadcasting to the items' dims; returns its layout. `op` and `name` go into the
// error message.
inline ffi::ErrorOr<Lead> operand(const char* op, const char* name, ffi::AnyBuffer::Dimensions dims,
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

// Where the output's leading dims (vmap's batch dims) go: with `fold`, every item in one
// layer call whose mini-batch is items x N (call(items.count, 0)); else one call per item,
// call(1, i). Operand offsets of item 0 are 0, so the one call reads every item in place.
template <class Call>
void per_item(const Items& items, bool fold, Call&& call) {
  if (fold) return call(items.count, int64_t(0));
  for (int64_t i = 0; i < items.count; ++i) call(int64_t(1), i);
}

// The activation an `act` attribute names, or an error naming the op.
inline ffi::ErrorOr<Activation> activation(const char* op, int32_t code) {
  if (code < 0 || code > int32_t(Activation::tanh))
    return ffi::Unexpected(invalid(std::string(op) + ": unknown activation code " + std::to_string(code)));
  return Activation(code);
}

inline int64_t elements(ffi::AnyBuffer::Dimensions dims) {
  int64_t count = 1;
  for (int64_t d : dims) count *= d;
  return count;
}

// A forward's z output: the saved pre-activation, y's shape, for gelu; empty otherwise.
inline ffi::Error expect_z(const char* op, Activation act, ffi::AnyBuffer::Dimensions y,
                           ffi::AnyBuffer::Dimensions z) {
  if (act != Activation::gelu)
    return elements(z) == 0 ? ffi::Error::Success()
                            : invalid(std::string(op) + ": z must be empty unless the activation is gelu");
  if (z.size() == y.size() && std::equal(y.begin(), y.end(), z.begin())) return ffi::Error::Success();
  return invalid(std::string(op) + ": z (the saved pre-activation) must have y's shape " + dims_str(y));
}

// An update's db: dw's leading dims (all but its last `w_inner`) and K, or empty.
inline ffi::Error expect_db(const char* op, ffi::AnyBuffer::Dimensions db, ffi::AnyBuffer::Dimensions dw,
                            size_t w_inner, int64_t k) {
  if (elements(db) == 0 || (db.size() == dw.size() - w_inner + 1 && db[db.size() - 1] == k &&
                            std::equal(dw.begin(), dw.end() - w_inner, db.begin())))
    return ffi::Error::Success();
  return invalid(std::string(op) + ": db " + dims_str(db) + " must be dw's leading dims + (K,), or empty");
}

// ---------------------------------------------------------------------------------------
// Binding. A handler's binding follows its parameters: the thread pool as context, buffers
// as operands, ffi::Result<...> as results, any other type as an attribute named by the
// next of `bind`'s names. The handler's signature is thus the one list of its operands.

template <class P>
constexpr bool is_operand = !std::is_void_v<typename ffi::ArgBinding<P>::Arg>;
template <class P>
constexpr bool is_result = !std::is_void_v<typename ffi::RetBinding<P>::Ret>;
template <class P>
constexpr bool is_attribute = !std::is_same_v<P, ffi::ThreadPool> && !is_operand<P> && !is_result<P>;

// Binding has no public move constructor, so each step returns the next binding as a prvalue.
template <class P, class Binding>
auto bind_one(Binding&& binding, const char* name) {
  if constexpr (std::is_same_v<P, ffi::ThreadPool>)
    return std::move(binding).template Ctx<ffi::ThreadPool>();
  else if constexpr (is_operand<P>)
    return std::move(binding).template Arg<typename ffi::ArgBinding<P>::Arg>();
  else if constexpr (is_result<P>)
    return std::move(binding).template Ret<typename ffi::RetBinding<P>::Ret>();
  else
    return std::move(binding).template Attr<P>(name);
}

template <class P, class... Rest, class Binding>
auto bind_params(Binding&& binding, const char* const* names) {
  if constexpr (sizeof...(Rest) == 0)
    return bind_one<P>(std::move(binding), *names);
  else
    return bind_params<Rest...>(bind_one<P>(std::move(binding), *names), is_attribute<P> ? names + 1 : names);
}

// The binding of `handler`, its attributes named in order: bind(fc_fwd, "act").
template <class R, class... P, class... Names>
auto bind(R (*)(P...), Names... attribute_names) {
  static_assert(sizeof...(Names) == (size_t(0) + ... + size_t(is_attribute<P>)), "one name per attribute");
  const char* const names[] = {attribute_names..., nullptr};
  return bind_params<P...>(ffi::Ffi::Bind(), names);
}

// ---------------------------------------------------------------------------------------

// Runs a layer call, turning exceptions (bad sizes, out of memory) into an ffi::Error
// instead of letting them cross the C boundary.
template <class F>
ffi::Error guarded(const char* op, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(op) + ": " + e.what());
  }
  return ffi::Error::Success();
}

// Address of element `elems` of a buffer.
inline const char* ptr(const ffi::AnyBuffer& b, int64_t elems) {
  return static_cast<const char*>(b.untyped_data()) + elems * int64_t(ffi::ByteWidth(b.element_type()));
}
inline char* ptr(ffi::Result<ffi::AnyBuffer>& b, int64_t elems) {
  return static_cast<char*>(b->untyped_data()) + elems * int64_t(ffi::ByteWidth(b->element_type()));
}

// A buffer of the compute dtype as the layers' view of it.
inline InView view(const ffi::AnyBuffer& b, DType dt) { return {b.untyped_data(), dt}; }
inline OutView view(ffi::Result<ffi::AnyBuffer>& b, DType dt) { return {b->untyped_data(), dt}; }

}  // namespace jb::ffi_util
