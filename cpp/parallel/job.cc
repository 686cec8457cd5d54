#include "parallel/job.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <new>
#include <thread>
#include <utility>


namespace jb {

namespace {

// ---------------------------------------------------------------------------------------
// One run of a job, shared by its workers.

struct Run {
  Run(Job j, bool async) : job(std::move(j)), next(job.loops.size()), finished(job.loops.size()), async(async) {
    for (size_t p = 0; p < job.loops.size(); ++p) {
      next[p].store(0, std::memory_order_relaxed);
      finished[p].store(0, std::memory_order_relaxed);
    }
  }

  // Claims and runs items until every phase is complete.
  void work(bool caller = false) {
    const SpanStart start = timeline_start();
    const int64_t phases = int64_t(job.loops.size());
    std::function<void()> finish;
    for (;;) {
      const int64_t p = phase.load(std::memory_order_acquire);
      if (p >= phases) break;
      const Loop& loop = job.loops[size_t(p)];
      const int64_t i = next[size_t(p)].fetch_add(1, std::memory_order_relaxed);
      if (i < loop.n) {
        loop.body(i);
        if (finished[size_t(p)].fetch_add(1, std::memory_order_acq_rel) + 1 == loop.n) finish = complete(p + 1);
        continue;
      }
      // Every item of the phase is claimed: wait for the running ones.
      while (phase.load(std::memory_order_acquire) == p) std::this_thread::yield();
    }
    // The runtime may run the next thunks inside `done`, on this thread: the span ends first.
    timeline_record(start, job.name, async, caller);
    if (finish) finish();
  }

  // Phase p - 1 is complete (only its last item's worker gets here); after the last phase,
  // returns `done` for the worker to call.
  std::function<void()> complete(int64_t p) {
    if (p < int64_t(job.loops.size())) {
      phase.store(p, std::memory_order_release);
      return {};
    }
    // Nobody touches the plan or the scratch any more: the scratch goes back to the pool
    // before the runtime hears of the results, so the next call can lease it warm.
    job.keep.clear();
    std::function<void()> d = std::move(done);
    phase.store(p, std::memory_order_release);
    return d;
  }

  Job job;
  std::vector<std::atomic<int64_t>> next, finished;  // per phase: items claimed, items done
  std::atomic<int64_t> phase{0};
  std::function<void()> done;
  const bool async;
};

int64_t widest(const Job& job) {
  int64_t w = 0;
  for (const Loop& l : job.loops) w = std::max(w, l.n);
  return w;
}

}  // namespace

void Job::then(Job other) {
  for (Loop& l : other.loops) loops.push_back(std::move(l));
  for (auto& k : other.keep) keep.push_back(std::move(k));
  flops += other.flops;
}

void run(const Executor& ex, Job job) {
  if (job.loops.empty()) return;
  const int64_t helpers = ex.schedule ? std::min(ex.num_threads, widest(job)) - 1 : 0;
  auto state = std::make_shared<Run>(std::move(job), false);
  for (int64_t h = 0; h < helpers; ++h) ex.schedule([state] { state->work(); });
  state->work(true);  // returns once every phase is complete
}

void run_async(const std::function<void(std::function<void()>)>& schedule, int64_t workers, Job job,
               std::function<void()> done) {
  if (job.loops.empty()) return done();
  const SpanStart start = timeline_start();
  const char* name = job.name;
  const int64_t tasks = std::max<int64_t>(1, std::min(workers, widest(job)));
  auto state = std::make_shared<Run>(std::move(job), true);
  state->done = std::move(done);
  for (int64_t t = 0; t < tasks; ++t) schedule([state] { state->work(); });
  timeline_record(start, name, true, true);
}

// ---------------------------------------------------------------------------------------
// The scratch pool: free buffers, the smallest that fits is taken; none fitting, the
// largest free one is replaced by one of the size asked for. As many buffers as calls
// were ever in flight at once, a few in a training step.

namespace {

struct FreeBuffer {
  char* data;
  size_t cap;
};
struct ScratchPool {
  std::mutex mu;
  std::vector<FreeBuffer> free;
};
// Never destroyed: a worker may give a buffer back while the process exits.
ScratchPool& scratch_pool() {
  static ScratchPool* pool = new ScratchPool;
  return *pool;
}
constexpr size_t kMaxFree = 16;

void give_back(char* data, size_t cap) {
  ScratchPool& pool = scratch_pool();
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    if (pool.free.size() < kMaxFree) {
      pool.free.push_back({data, cap});
      return;
    }
  }
  std::free(data);
}

}  // namespace

std::shared_ptr<char> lease_scratch(size_t bytes) {
  bytes = std::max<size_t>(64, (bytes + 63) / 64 * 64);
  FreeBuffer got{nullptr, 0};
  {
    ScratchPool& pool = scratch_pool();
    std::lock_guard<std::mutex> lock(pool.mu);
    std::vector<FreeBuffer>& pool_free = pool.free;
    size_t best = pool_free.size(), largest = pool_free.size();
    for (size_t i = 0; i < pool_free.size(); ++i) {
      if (pool_free[i].cap >= bytes && (best == pool_free.size() || pool_free[i].cap < pool_free[best].cap)) best = i;
      if (largest == pool_free.size() || pool_free[i].cap > pool_free[largest].cap) largest = i;
    }
    const size_t take = best < pool_free.size() ? best : largest;
    if (take < pool_free.size()) {
      got = pool_free[take];
      pool_free.erase(pool_free.begin() + std::ptrdiff_t(take));
    }
  }
  if (got.cap < bytes) {
    std::free(got.data);
    got = {static_cast<char*>(std::aligned_alloc(64, bytes)), bytes};
    if (!got.data) throw std::bad_alloc();
  }
  const size_t cap = got.cap;
  return std::shared_ptr<char>(got.data, [cap](char* p) { give_back(p, cap); });
}

}  // namespace jb
