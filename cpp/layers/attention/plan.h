// The plan of an attention pass: blocking, the kernels of every product, the work split and
// the scratch layout of one work item. It depends only on the shape, the dtypes, what is
// given (bias, mask), the thread count and the dispatch, so it is built once per call site
// and taken from a cache after that.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "brgemm/brgemm.h"
#include "layers/attention/attention.h"
#include "layers/attention/rows.h"
#include "layers/common/blocking.h"
#include "layers/common/emulation.h"
#include "layers/common/work.h"

namespace jb::attention {

// The kernels of one product, for every block the loops meet: the query block full or the
// last (shorter) one, and key chunks whose width is a multiple of the key quantum.
class KernelTable {
 public:
  KernelTable() = default;
  // desc(last, width): the descriptor for that block.
  template <class Desc>
  KernelTable(int64_t quantum, int64_t chunk, bool has_last, Desc&& desc, Isa isa) : q_(quantum) {
    for (int last = 0; last < (has_last ? 2 : 1); ++last)
      for (int64_t w = quantum; w <= chunk; w += quantum) k_[last].emplace_back(desc(last != 0, w), isa);
  }
  const Brgemm& operator()(bool last, int64_t width) const {
    return k_[last && !k_[1].empty() ? 1 : 0][size_t(width / q_ - 1)];
  }

 private:
  int64_t q_ = 1;
  std::vector<Brgemm> k_[2];
};

// Regions of one work item's scratch, carved in order, each 64-byte aligned.
struct Layout {
  size_t add(size_t bytes) {
    const size_t at = total;
    total += (bytes + 63) / 64 * 64;
    return at;
  }
  size_t total = 0;
};

// One query block of a work item: head n of the batch item's kv head, rows [i0, i0 + rows).
struct Block {
  int64_t item, kvh, n, qb, i0, rows;
  bool last;  // the shorter last block (its own kernels)
};

// The pass a plan is for.
enum class Pass { forward, backward, tangent };

struct Plan {
  Plan(const Dispatch& dp, const Shape& s, bool bias, bool mask, int64_t threads, const Blocks* force, Pass pass);

  // The key chunks of query block qb: [0, end) in steps of bn (end a multiple of kq).
  int64_t keys_end(int64_t qb) const;
  int64_t rows_of(int64_t qb) const { return qb + 1 < nqb ? bm : last_rows; }
  // Block blk (in [groups.first(it), groups.last(it))) of work item it.
  Block block(int64_t it, int64_t blk, int64_t kv_heads) const {
    const int64_t panel = groups.panel(it), qb = blk % nqb;
    return {panel / kv_heads, panel % kv_heads, panel % kv_heads * group + blk / nqb, qb, qb * bm, rows_of(qb),
            rows_of(qb) != bm};
  }

  Isa isa;
  emulation::Terms terms;  // the products of every multiplication (one, unless emulated)
  DType kd;     // the multiply dtype
  bool vnni;    // bf16 multiplies: B operands in VNNI-2 pairs
  size_t ks;    // bytes of a kd element
  int64_t t, s, h, group;  // group: query heads per kv head
  int64_t bm, nqb, last_rows;  // query blocks
  int64_t kq, bn, sp;          // key quantum, chunk width, S padded to kq
  int64_t hp;                  // H padded: the reduction of Q K^T and dO V^T
  int64_t bmp, last_rp;        // query rows padded: the reduction of the dK, dV updates
  bool skip;  // causal with neither bias nor mask: chunks past the diagonal are skipped
  // Q and dO, the A operands of Q K^T and dO V^T, are read where they are when the kernel
  // multiplies in their dtype and H needs no padding (K and V, B operands, are always packed:
  // read in place, their rows N x H apart fall into few L1 sets and evict each other).
  bool q_in_place;
  WorkGroups groups;  // panels (item, kv head) x blocks (head of the group, query block)
  bool split;         // panels are split: dK and dV are summed from per-item parts

  // C = S tile: Q K^T (and dP = dO V^T); O += P V (and dQ += dS K); dK^T += Q^T dS (and
  // dV^T += dO^T P).
  KernelTable qk, pv, kv;

  // Elements between the parts of a packed operand (emulation): K^T and V^T, V and K, a
  // Q or dO block, its transpose, a P or dS tile as A, as B.
  int64_t kt_step = 0, kv_step = 0, q_step = 0, qt_step = 0, pa_step = 0, pb_step = 0;

  // Work item scratch (byte offsets): packed K^T, V (or V^T), K; the per-block tiles; tmp,
  // the fp32 blocks the emulation splits from.
  Layout lease;
  size_t kt = 0, vv = 0, kb = 0;
  size_t qt = 0, dot = 0, q_t = 0, do_t = 0;
  size_t st = 0, dpt = 0, pt = 0, pvn = 0, dsv = 0, dsa = 0;
  size_t acc = 0, m = 0, l = 0, alpha = 0, d = 0, tmp = 0;
  size_t dkt = 0, dvt = 0;     // in the lease when the panel is not split
  size_t kv_out = 0;           // dK or dV transposed, before its copy into the output
  size_t part_bytes = 0;       // one item's dK^T and dV^T parts (split panels)
  // The tangent pass: packed tK^T and tV, a tQ block, the tiles tQ K^T and Q tK^T, W = Z tS,
  // and the rows' sums c.
  size_t tkt = 0, tvv = 0, tqt = 0, tsa = 0, tsb = 0, wt = 0, c = 0;
};

// Asks for `rows` rows of row_bytes each, ld_bytes apart, to be brought into cache while the
// current block computes: rows N x H apart in the (T, N, H) layout defeat the hardware
// prefetchers.
inline void prefetch_rows(const void* p, int64_t rows, int64_t row_bytes, int64_t ld_bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(c + r * ld_bytes + b, 0, 2);
}
// The same for rows about to be written (the outputs' lines, read for ownership).
inline void prefetch_rows_for_write(void* p, int64_t rows, int64_t row_bytes, int64_t ld_bytes) {
  char* c = static_cast<char*>(p);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(c + r * ld_bytes + b, 1, 2);
}

// The score tile of block b against the key chunk [c0, c0 + width), with its bias and mask.
ScoreTile score_tile(const Shape& s, const Inputs& in, const Plan& p, const Block& b, float* st, int64_t c0,
                     int64_t width);

// Throws std::invalid_argument for sizes the passes do not take.
void check_shape(const Shape& s);

// The cached plan of a pass.
std::shared_ptr<const Plan> plan_for(const Dispatch& dp, const Shape& s, bool bias, bool mask,
                                     int64_t threads, const Blocks* force, Pass pass);

}  // namespace jb::attention
