#include "layers/batch_reduce.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "layers/common/blocking.h"
#include "layers/common/emulation.h"
#include "layers/common/kernels.h"
#include "layers/common/plan_cache.h"
#include "layers/common/scratch.h"
#include "layers/common/work.h"
#include "parallel/job.h"

namespace jb::batch_reduce {

namespace {

struct Plan {
  Plan(const Dispatch& dp, const Shape& s, int64_t threads)
      : terms(emulation::terms(s.products)), kd(s.products ? multiply_dtype(DType::bf16, dp) : s.ab) {
    const bool bf16 = kd == DType::bf16;
    // AMX blocks are whole 32-row macro tiles; register tiles take any height.
    const int64_t tile = bf16 && dp.isa == Isa::amx ? 32 : 4;
    choose_blocks(s.items, s.m, s.n, threads, tile);
    mblocks = ceil_div(s.m, bm);
    nblocks = ceil_div(s.n, bn);
    packed_matrix = bf16 ? (s.k + 1) / 2 * 2 * s.n : s.k * s.n;
    BrgemmDesc d;
    d.k = s.k;
    d.lda = s.k;
    d.ldb = bf16 ? 2 * s.n : s.n;
    d.ldc = s.n;
    d.ab = kd;
    d.c = s.out;
    d.accumulate = s.accumulate;
    kernels.emplace(d, s.m, s.n, bm, bn, dp.isa);
  }

  // Splits the M x N output into blocks for the threads: whole rows of N when N is small
  // (the B panel is then read once per block), M blocks of at most 96 rows in multiples
  // of `tile` rows, and a block count that the threads share evenly (or at least 4 per
  // thread). Too few rows to split: split N instead, in whole AMX tile columns.
  void choose_blocks(int64_t items, int64_t m, int64_t n, int64_t threads, int64_t tile) {
    bn = n <= 256 ? n : 128;
    if (items * ceil_div(m, 96) < threads && n >= 64 && m < 2 * tile)  // too few rows
      bn = round_up(ceil_div(n, threads), 16);
    const int64_t nb = ceil_div(n, bn);
    int64_t mb = ceil_div(m, 96);
    auto total = [&] { return items * nb * mb; };
    while (total() % threads != 0 && total() < 4 * threads && round_up((m + mb) / (mb + 1), tile) < m)
      ++mb;
    bm = std::min(m, round_up(ceil_div(m, mb), tile));
  }

  const emulation::Terms terms;  // the products of every multiplication (one, unless emulated)
  const DType kd;                // the kernel's operand dtype
  int64_t bm = 0, bn = 0, mblocks = 0, nblocks = 0, packed_matrix = 0;
  std::optional<KernelSet> kernels;
};

PlanCache<12, Plan> plans;

}  // namespace

Job run_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* a, const void* b, const void* c,
            void* out, const ItemOffsets& offs) {
  Job job;
  job.name = "brgemm";
  if (s.items <= 0 || s.m <= 0 || s.n <= 0) return job;
  const auto plan = plans.get({s.items, s.batch, s.m, s.k, s.n, int64_t(s.ab), int64_t(s.out),
                               s.accumulate, s.b_matrices, threads, int64_t(dp.isa), s.products},
                              [&] { return Plan(dp, s, threads); });
  job.keep.push_back(plan);
  job.flops = 2.0 * double(s.items) * double(s.batch) * double(s.m) * double(s.k) * double(s.n);
  const Plan* p = plan.get();
  const emulation::Terms& t = p->terms;
  const size_t es = dtype_size(p->kd), cs = dtype_size(s.out);
  const int64_t matrix = std::max<int64_t>(1, s.k * s.n);  // k = 0: only c (or zeros)
  // The item offsets, copied (the job may outlive the caller's arrays); emulated, the
  // batch of a block: every (term, i) pair, part offsets included (elements).
  const int64_t count = t.split ? t.count * s.batch : s.batch;
  const int64_t b_step = s.b_matrices * p->packed_matrix;  // from one part of the B buffer to the next
  auto copy = std::make_shared<std::vector<int64_t>>(offs.a, offs.a + s.items);
  copy->insert(copy->end(), offs.b, offs.b + s.items);
  copy->insert(copy->end(), offs.c, offs.c + s.items);
  for (int i = 0; t.split && i < t.count; ++i)  // term-major, the small products first
    for (int64_t j = 0; j < s.batch; ++j) copy->push_back(t.of[0][i] * s.a_elements + j * s.m * s.k);
  for (int i = 0; t.split && i < t.count; ++i)
    for (int64_t j = 0; j < s.batch; ++j) copy->push_back(t.of[1][i] * b_step + j * p->packed_matrix);
  const int64_t* oa = copy->data();
  const int64_t* ob = oa + s.items;
  const int64_t* oc = ob + s.items;
  const int64_t* batch_a = t.split ? oc + s.items : nullptr;
  const int64_t* batch_b = t.split ? batch_a + count : nullptr;
  job.keep.push_back(std::move(copy));

  // The A operand: in place, or its parts. The B operand: in place (fp32), or every distinct
  // matrix packed once into VNNI-2 pairs (bf16) or into its parts, in scratch.
  const char* ap = static_cast<const char*>(a);
  const char* bp = static_cast<const char*>(b);
  const Isa isa = dp.isa;
  const int64_t k = s.k, n = s.n;
  if (t.split && k > 0) {
    const bool vnni = p->kd == DType::bf16;
    const int64_t prows = vnni ? round_up(k, 2) : k;
    const auto buf = job_scratch<2>(job, {size_t(t.parts[0] * s.a_elements) * es, size_t(t.parts[1] * b_step) * es});
    PanelPool* pool = job_leases(job, size_t(2 * prows * n) * sizeof(float), threads);
    const DType kd = p->kd;
    const int64_t a_rows = s.a_elements / k, chunk = std::max<int64_t>(1, 16384 / k);
    char* a_parts = buf[0];
    job.add(ceil_div(a_rows, chunk), [=](int64_t i) {
      const int64_t r0 = i * chunk, rows = std::min(chunk, a_rows - r0);
      emulation::split_rows(t, 0, static_cast<const float*>(a) + r0 * k, k, a_parts + r0 * k * int64_t(es), kd, k,
                            s.a_elements, rows, k, k);
    });
    char* b_parts = buf[1];
    job.add(s.b_matrices, [=](int64_t i) {
      const PanelPool::Lease tmp(*pool);
      emulation::pack(t, 1, static_cast<const float*>(b) + i * matrix, DType::f32, n, false, k, n, prows, n, kd,
                      vnni, b_parts + i * p->packed_matrix * int64_t(es), b_step, isa,
                      reinterpret_cast<float*>(tmp.data));
    });
    ap = a_parts, bp = b_parts;
  } else if (s.ab == DType::bf16) {
    char* packed = job_scratch<1>(job, {size_t(s.b_matrices * p->packed_matrix) * es})[0];
    const auto* src = static_cast<const uint16_t*>(b);
    job.add(s.b_matrices, [=](int64_t i) {
      pack_vnni2(src + i * matrix, k, n, n, reinterpret_cast<uint16_t*>(packed) + i * p->packed_matrix, isa);
    });
    bp = packed;
  }
  const char* cp = static_cast<const char*>(c);
  char* op = static_cast<char*>(out);
  const int64_t b_cols = p->kd == DType::bf16 ? 2 : 1;  // a VNNI pair row holds 2 per column

  job.add(s.items * p->mblocks * p->nblocks, [=](int64_t w) {
    const int64_t jb = w % p->nblocks, ib = w / p->nblocks % p->mblocks, l = w / p->nblocks / p->mblocks;
    const int64_t i0 = ib * p->bm, j0 = jb * p->bn;
    const int64_t rows = std::min(p->bm, s.m - i0), cols = std::min(p->bn, s.n - j0);
    char* o = op + (l * s.m * s.n + i0 * s.n + j0) * cs;
    if (cp) {  // out = c, then accumulate: c may be broadcast, so copy the block
      const char* cb = cp + (oc[l] + i0 * s.n + j0) * cs;
      if (cb != o)
        for (int64_t i = 0; i < rows; ++i) std::memcpy(o + i * s.n * cs, cb + i * s.n * cs, size_t(cols) * cs);
    }
    const char* a0 = ap + (oa[l] + i0 * s.k) * es;
    const char* b0 = bp + (ob[l] / matrix * p->packed_matrix + j0 * b_cols) * es;
    const Brgemm& kernel = (*p->kernels)(rows, cols);
    if (batch_a) kernel.offsets(a0, batch_a, b0, batch_b, count, o);
    else kernel.strided(a0, s.m * s.k, b0, p->packed_matrix, s.batch, o);
  });
  return job;
}

void run(const Executor& ex, const Dispatch& dp, const Shape& s, const void* a, const void* b,
         const void* c, void* out, const ItemOffsets& offs) {
  jb::run(ex, run_job(ex.num_threads, dp, s, a, b, c, out, offs));
}

}  // namespace jb::batch_reduce
