#include "layers/common/blocking.h"

#include <unistd.h>

namespace jb {

namespace {
constexpr int64_t kMaxRows = 96;
}  // namespace

int64_t l2_bytes() {
  static const int64_t bytes = [] {
    long v = -1;
#if defined(_SC_LEVEL2_CACHE_SIZE)
    v = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return v > 0 ? int64_t(v) : kPanelBytes;
  }();
  return bytes;
}

int64_t split_rows(int64_t m, int64_t col_blocks, int64_t threads) {
  if (m <= kRowQuantum) return m;
  int64_t nb = ceil_div(m, kMaxRows);
  int64_t rows = round_up(ceil_div(m, nb), kRowQuantum);
  while (rows > kRowQuantum && ceil_div(m, rows) * col_blocks < kItemsPerThread * threads) {
    ++nb;
    rows = round_up(ceil_div(m, nb), kRowQuantum);
  }
  return std::min(rows, m);
}

int64_t padded_block(int64_t total, int64_t quantum, int64_t max) {
  int64_t best = 0;
  double best_cost = 0;
  for (int64_t r = quantum; r <= std::max(max, quantum); r += quantum) {
    const double cost = double(round_up(total, r)) * (1.0 + 8.0 / double(r));
    if (!best || cost < best_cost - 1e-9) best = r, best_cost = cost;
  }
  return best;
}

int64_t reduction_block(int64_t size, bool even) {
  constexpr int64_t kTarget = 256, kMin = 32;
  if (size <= kTarget) return size;
  for (int pass = even ? 0 : 1; pass < 2; ++pass)
    for (int64_t d = kTarget; d >= kMin; --d)
      if (size % d == 0 && (pass == 1 || d % 2 == 0)) return d;
  return size;
}

}  // namespace jb
