#include "parallel/parallel_for.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>

namespace jb {

namespace {

struct Work {
  explicit Work(int64_t n, const std::function<void(int64_t)>* body) : n(n), body(body) {}
  const int64_t n;
  // Valid until `done` reaches n; dereferenced only for a claimed item, i.e. before that.
  const std::function<void(int64_t)>* body;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void drain() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      (*body)(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

}  // namespace

void parallel_for(const Executor& ex, int64_t n, const std::function<void(int64_t)>& body) {
  if (n <= 0) return;
  const int64_t helpers = ex.schedule ? std::min(ex.num_threads, n) - 1 : 0;
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  auto work = std::make_shared<Work>(n, &body);
  for (int64_t h = 0; h < helpers; ++h) ex.schedule([work] { work->drain(); });
  work->drain();
  // Every item is claimed; wait for the ones helpers are still running.
  while (work->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace jb
