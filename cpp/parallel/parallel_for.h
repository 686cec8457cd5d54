// parallel_for over a thread pool we do not own (XLA's intra-op pool, through the FFI).
//
// The calling thread claims work items too and can finish all of them alone: it never
// waits for a scheduled helper to *start* (pool threads may all be busy, e.g. running
// other custom calls). It only waits for items a helper has already claimed, which are
// running. The shared state is reference-counted, so a helper that starts after
// everything is done finds no work and leaves without touching the caller's frame.
#pragma once

#include <cstdint>
#include <functional>

namespace jb {

struct Executor {
  // Hands a task to a pool thread; null runs everything on the calling thread.
  std::function<void(std::function<void()>)> schedule;
  int64_t num_threads = 1;  // threads that may run items, the caller included
};

// Calls body(i) for every i in [0, n), each exactly once, possibly concurrently.
void parallel_for(const Executor& ex, int64_t n, const std::function<void(int64_t)>& body);

}  // namespace jb
