// parallel_for: every item once, with real threads, with a pool that never runs the tasks
// until the call returned (the caller must finish alone), and with a serial executor.
#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

#include "check.h"
#include "parallel/parallel_for.h"

namespace {

using namespace jb;

void expect_each_once(const Executor& ex, int64_t n) {
  std::vector<std::atomic<int>> hits(n);
  parallel_for(ex, n, [&](int64_t i) { hits[i].fetch_add(1); });
  for (int64_t i = 0; i < n; ++i) CHECK(hits[i].load() == 1) << "item " << i << " of " << n;
}

TEST(parallel_for_threads) {
  std::vector<std::thread> threads;
  std::mutex mu;
  Executor ex;
  ex.num_threads = 4;
  ex.schedule = [&](std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu);
    threads.emplace_back(std::move(task));
  };
  for (int64_t n : {0, 1, 2, 3, 100, 1000}) expect_each_once(ex, n);
  for (auto& t : threads) t.join();
}

TEST(parallel_for_busy_pool_caller_finishes_alone) {
  // Tasks are only run after parallel_for has returned: late helpers must find no work
  // and must not touch the (then dead) caller's frame.
  std::vector<std::function<void()>> queued;
  Executor ex;
  ex.num_threads = 8;
  ex.schedule = [&](std::function<void()> task) { queued.push_back(std::move(task)); };
  expect_each_once(ex, 50);
  CHECK(!queued.empty());
  for (auto& task : queued) task();
}

TEST(parallel_for_serial) {
  Executor ex;  // no pool
  expect_each_once(ex, 17);
}

}  // namespace
