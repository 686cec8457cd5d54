// XLA FFI handler of jax_brgemm.brgemm:  out[l] = c[l] + sum_i a[l, i] @ b[l, i].
//
// a: (..., B, M, K), b: (..., B, K, N), c: (..., M, N), out: (..., M, N). Leading dims
// broadcast numpy-style (right-aligned, size 1 repeats), so vmap's unbatched operands and
// the backward pass's shared operands are read in place, never materialized.
// Work items are (leading index, M block, N block) C blocks; each is one BRGEMM call.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "ffi/ffi_common.h"

namespace jb {
namespace {

namespace ffi = xla::ffi;
using ffi_util::dims_str;
using ffi_util::invalid;

// Element strides of one operand over the output's leading dims (0 where broadcast).
struct Leading {
  std::vector<int64_t> stride;
  // Offset of output item l (row-major over the output's leading dims `lead`).
  int64_t offset(int64_t l, const std::vector<int64_t>& lead) const {
    int64_t off = 0;
    for (int64_t d = int64_t(lead.size()) - 1; d >= 0; --d) {
      off += l % lead[d] * stride[d];
      l /= lead[d];
    }
    return off;
  }
};

// Checks that `lead` (the operand's dims before its `inner` trailing ones) broadcasts to
// `out_lead`, and returns its strides; `matrix` is the element count of one inner item.
ffi::ErrorOr<Leading> leading(const char* name, ffi::AnyBuffer::Dimensions dims, size_t inner,
                              const std::vector<int64_t>& out_lead, int64_t matrix) {
  const size_t rank = dims.size() - inner;
  if (rank > out_lead.size())
    return ffi::Unexpected(invalid(std::string("brgemm: ") + name + " has more leading dims than the output"));
  Leading l{std::vector<int64_t>(out_lead.size(), 0)};
  int64_t stride = matrix;
  for (size_t d = 0; d < rank; ++d) {
    const size_t od = out_lead.size() - 1 - d;
    const int64_t size = dims[rank - 1 - d];
    if (size != out_lead[od] && size != 1)
      return ffi::Unexpected(invalid(std::string("brgemm: leading dims of ") + name + " " +
                                     dims_str(dims) + " do not broadcast to the output's"));
    l.stride[od] = size == 1 ? 0 : stride;
    stride *= size;
  }
  return l;
}

int64_t product(const std::vector<int64_t>& v) {
  int64_t p = 1;
  for (int64_t x : v) p *= x;
  return p;
}

// Splits the M x N output into blocks for the threads: whole rows of N when N is small
// (the B panel is then read once per block), M blocks of at most 96 rows in multiples of
// `tile` rows (32 for AMX macro tiles; 4 for register tiles, which take any height), and
// a block count that the threads share evenly (or at least 4 per thread). Too few rows to
// split: split N instead, in whole AMX tile columns.
void choose_blocks(int64_t items, int64_t m, int64_t n, int64_t threads, int64_t tile,
                   int64_t* bm, int64_t* bn) {
  auto round_up = [](int64_t x, int64_t r) { return (x + r - 1) / r * r; };
  *bn = n <= 256 ? n : 128;
  if (items * ((m + 95) / 96) < threads && n >= 64 && m < 2 * tile)  // too few rows to split
    *bn = round_up((n + threads - 1) / threads, 16);
  const int64_t nblocks = (n + *bn - 1) / *bn;
  int64_t mblocks = (m + 95) / 96;
  auto total = [&] { return items * nblocks * mblocks; };
  while (total() % threads != 0 && total() < 4 * threads &&
         round_up((m + mblocks) / (mblocks + 1), tile) < m)
    ++mblocks;
  *bm = std::min(m, round_up((m + mblocks - 1) / mblocks, tile));
}

ffi::Error brgemm_impl(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b,
                       const ffi::AnyBuffer* c, ffi::Result<ffi::AnyBuffer> out) {
  DType ab, ab2, cdt;
  if (!ffi_util::kernel_dtype(a.element_type(), &ab) ||
      !ffi_util::kernel_dtype(b.element_type(), &ab2) || ab != ab2)
    return invalid("brgemm: a and b must both be float32 or both bfloat16");
  if (!ffi_util::kernel_dtype(out->element_type(), &cdt))
    return invalid("brgemm: the output must be float32 or bfloat16");
  if (c && c->element_type() != out->element_type())
    return invalid("brgemm: c must have the output's dtype");

  const auto ad = a.dimensions(), bd = b.dimensions(), od = out->dimensions();
  if (ad.size() < 3 || bd.size() < 3 || od.size() < 2 || (c && c->dimensions().size() < 2))
    return invalid("brgemm: a and b need rank >= 3, c and the output rank >= 2");
  const int64_t batch = ad[ad.size() - 3], m = ad[ad.size() - 2], k = ad[ad.size() - 1];
  const int64_t n = bd[bd.size() - 1];
  if (bd[bd.size() - 3] != batch || bd[bd.size() - 2] != k || od[od.size() - 2] != m ||
      od[od.size() - 1] != n)
    return invalid("brgemm: shapes a " + dims_str(ad) + ", b " + dims_str(bd) + ", out " +
                   dims_str(od) + " do not form (.., B, M, K) x (.., B, K, N) -> (.., M, N)");
  if (c) {
    const auto cd = c->dimensions();
    if (cd[cd.size() - 2] != m || cd[cd.size() - 1] != n)
      return invalid("brgemm: c " + dims_str(cd) + " is not (..., M, N) = " + dims_str(od));
  }
  const std::vector<int64_t> out_lead(od.begin(), od.end() - 2);
  auto la = leading("a", ad, 3, out_lead, batch * m * k);
  auto lb = leading("b", bd, 3, out_lead, batch * k * n);
  if (!la.has_value()) return la.error();
  if (!lb.has_value()) return lb.error();
  ffi::ErrorOr<Leading> lc = Leading{};
  if (c) {
    lc = leading("c", c->dimensions(), 2, out_lead, m * n);
    if (!lc.has_value()) return lc.error();
  }
  const int64_t items = product(out_lead);
  if (items == 0 || m == 0 || n == 0) return ffi::Error::Success();

  Executor ex = ffi_util::executor(pool);
  const size_t es = dtype_size(ab), cs = dtype_size(cdt);

  // bf16: pack every distinct B matrix (not every broadcast copy) into VNNI-2 pairs.
  const char* b_data = static_cast<const char*>(b.untyped_data());
  int64_t b_matrix = k * n, ldb = n;
  // Kept per calling thread and reused: no allocation and page faults on every call.
  thread_local std::vector<uint16_t> packed;
  Leading b_lead = lb.value();
  if (ab == DType::bf16) {
    const int64_t count = static_cast<int64_t>(b.element_count()) / std::max<int64_t>(1, k * n);
    b_matrix = (k + 1) / 2 * 2 * n;
    ldb = 2 * n;
    if (packed.size() < size_t(count * b_matrix)) packed.resize(size_t(count * b_matrix));
    uint16_t* dst = packed.data();
    const auto* src = static_cast<const uint16_t*>(b.untyped_data());
    parallel_for(ex, count, [&](int64_t i) { pack_vnni2(src + i * k * n, k, n, n, dst + i * b_matrix); });
    b_data = reinterpret_cast<const char*>(dst);
    for (int64_t& s : b_lead.stride) s = s / std::max<int64_t>(1, k * n) * b_matrix;
  }

  int64_t bm, bn;
  choose_blocks(items, m, n, ex.num_threads, ab == DType::bf16 ? 32 : 4, &bm, &bn);
  const int64_t mblocks = (m + bm - 1) / bm, nblocks = (n + bn - 1) / bn;

  BrgemmDesc desc;
  desc.k = k;
  desc.lda = k;
  desc.ldb = ldb;
  desc.ldc = n;
  desc.ab = ab;
  desc.c = cdt;
  desc.accumulate = c != nullptr;
  std::unique_ptr<Brgemm> full;
  try {
    desc.m = bm;
    desc.n = bn;
    full = std::make_unique<Brgemm>(desc);
  } catch (const std::exception& e) {
    return invalid(e.what());
  }
  const char* a_data = static_cast<const char*>(a.untyped_data());
  char* o_data = static_cast<char*>(out->untyped_data());
  const char* c_data = c ? static_cast<const char*>(c->untyped_data()) : nullptr;
  const Leading& a_lead = la.value();
  const Leading& c_lead = lc.value();

  parallel_for(ex, items * mblocks * nblocks, [&](int64_t w) {
    const int64_t jb = w % nblocks, ib = w / nblocks % mblocks, l = w / nblocks / mblocks;
    const int64_t i0 = ib * bm, j0 = jb * bn;
    BrgemmDesc edge = desc;
    edge.m = std::min(bm, m - i0);
    edge.n = std::min(bn, n - j0);
    char* o = o_data + (l * m * n + i0 * n + j0) * cs;
    if (c_data) {  // out = c, then accumulate: c may be broadcast, so copy the block
      const char* cb = c_data + (c_lead.offset(l, out_lead) + i0 * n + j0) * cs;
      if (cb != o)
        for (int64_t i = 0; i < edge.m; ++i) std::memcpy(o + i * n * cs, cb + i * n * cs, edge.n * cs);
    }
    const Brgemm kernel = edge.m == bm && edge.n == bn ? *full : Brgemm(edge, full->isa());
    const char* a0 = a_data + (a_lead.offset(l, out_lead) + i0 * k) * es;
    const char* b0 = b_data + (b_lead.offset(l, out_lead) + j0 * (ab == DType::bf16 ? 2 : 1)) * es;
    kernel.strided(a0, m * k, b0, b_matrix, batch, o);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jb_brgemm, [](ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b,
                  ffi::Result<ffi::AnyBuffer> out) { return brgemm_impl(pool, a, b, nullptr, out); },
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jb_brgemm_acc,
    [](ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer c,
       ffi::Result<ffi::AnyBuffer> out) { return brgemm_impl(pool, a, b, &c, out); },
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Ret<ffi::AnyBuffer>());

}  // namespace jb
