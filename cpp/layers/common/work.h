// How a pass shares work between the threads: work groups (a panel of one operand, re-blocked
// by the item that uses it, and the output blocks computed with it) and the pool of panel
// buffers the items running at once lease.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "layers/common/blocking.h"
#include "parallel/job.h"

namespace jb {

// Work items over `panels` panels and `nblocks` output blocks per panel: one group of
// blocks per panel when there are enough panels to keep every thread busy (4 items
// each); otherwise the blocks are split into as many groups as needed (each re-blocking
// its own copy of the small panel). Panel-major: neighbouring items share a panel.
class WorkGroups {
 public:
  WorkGroups(int64_t panels, int64_t nblocks, int64_t threads) : panels_(panels), nblocks_(nblocks) {
    const int64_t want = 4 * std::max<int64_t>(1, threads);
    groups_ = std::max<int64_t>(1, std::min(nblocks, ceil_div(want, std::max<int64_t>(1, panels))));
    per_ = ceil_div(nblocks, groups_);
    groups_ = ceil_div(nblocks, per_);
    concurrency_ = std::max<int64_t>(1, std::min(std::max<int64_t>(1, threads), items()));
  }
  int64_t items() const { return panels_ * groups_; }
  int64_t panel(int64_t i) const { return i / groups_; }
  int64_t first(int64_t i) const { return i % groups_ * per_; }  // its blocks [first, last)
  int64_t last(int64_t i) const { return std::min(nblocks_, first(i) + per_); }
  int64_t concurrency() const { return concurrency_; }  // items that can run at once

 private:
  int64_t panels_, nblocks_, groups_, per_, concurrency_;
};

// Panel buffers for the items running at once (at most one per thread): an item leases a
// free one for its duration. Carved from the caller's scratch up front, so no worker ever
// allocates (an exception there could not be reported).
class PanelPool {
 public:
  PanelPool(char* base, size_t bytes, int64_t count)
      : base_(base), bytes_((bytes + 63) / 64 * 64), busy_(size_t(count)) {}
  class Lease {
   public:
    explicit Lease(PanelPool& pool) : pool_(pool) {
      for (size_t i = 0;; i = (i + 1) % pool_.busy_.size()) {
        bool expected = false;
        if (pool_.busy_[i].compare_exchange_strong(expected, true, std::memory_order_acquire)) {
          slot_ = i;
          break;
        }
      }
      data = pool_.base_ + slot_ * pool_.bytes_;
    }
    ~Lease() { pool_.busy_[slot_].store(false, std::memory_order_release); }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    char* data;

   private:
    PanelPool& pool_;
    size_t slot_ = 0;
  };

 private:
  char* base_;
  size_t bytes_;
  std::vector<std::atomic<bool>> busy_;
};

// `count` leases of `bytes` carved from new scratch of the job, the pool kept alive by it
// (parallel/job.h): the per-item scratch of the workers that run its phases.
inline PanelPool* job_leases(Job& job, size_t bytes, int64_t count) {
  auto pool = std::make_shared<PanelPool>(job_scratch<1>(job, {(bytes + 63) / 64 * 64 * size_t(count)})[0], bytes, count);
  PanelPool* p = pool.get();
  job.keep.push_back(std::move(pool));
  return p;
}

}  // namespace jb
