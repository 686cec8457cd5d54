// The plain batch-reduce GEMM op (jb.brgemm) over a set of items:
//
//   out[l] = (c[l] +) sum_i a[l, i] @ b[l, i]      a[l, i]: m x k, b[l, i]: k x n, out[l]: m x n
//
// Work items are (item, M-block, N-block) blocks of the output, one BRGEMM call each.
// bf16 B matrices are packed into VNNI-2 pairs first, each distinct matrix once (items
// that share a B by broadcasting share its packed copy). fp32 operands may ask for their
// products to be emulated from bf16 ones (Shape::products): a and every distinct B are then
// split into their bf16 parts first, and each block's batch walks every (term, i) pair.
#pragma once

#include <cstdint>

#include "brgemm/brgemm.h"
#include "parallel/job.h"
#include "parallel/parallel_for.h"

namespace jb::batch_reduce {

struct Shape {
  int64_t items = 0, batch = 0, m = 0, k = 0, n = 0;
  DType ab = DType::f32;   // dtype of a and b
  DType out = DType::f32;  // dtype of c and out
  bool accumulate = false;  // c is given
  int64_t b_matrices = 0;  // k x n matrices in the b buffer (to pack for bf16)
  int64_t products = 0;    // fp32 a and b: each product from this many bf16 ones (1, 3, 6; 0 exact)
  int64_t a_elements = 0;  // elements of the a buffer (split whole when emulated)
};

// Where item l's operands start, in elements of the arrays as passed: a[l, 0], b[l, 0],
// c[l] (0 where an operand is broadcast over the items). Arrays of s.items entries.
struct ItemOffsets {
  const int64_t* a;
  const int64_t* b;
  const int64_t* c;
};

// The plan (blocking, kernels) is cached by shape, thread count and dispatch. run_job is
// the same work as a Job (parallel/job.h) for `threads` workers, for asynchronous calls;
// same blocks, same bits. The offsets are copied into it.
Job run_job(int64_t threads, const Dispatch& dp, const Shape& s, const void* a, const void* b, const void* c,
            void* out, const ItemOffsets& offs);
void run(const Executor& ex, const Dispatch& dp, const Shape& s, const void* a, const void* b,
         const void* c, void* out, const ItemOffsets& offs);

}  // namespace jb::batch_reduce
