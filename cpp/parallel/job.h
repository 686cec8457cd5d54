// A layer call as data: a sequence of parallel loops (phases) whose items are independent,
// a loop starting only once the one before is complete, and what must stay alive until the
// last item is done (the plan, the scratch). Nothing in it refers to the caller's frame, so
// it can run after the call that built it has returned.
//
// Both ways of running it schedule their workers once, up front, and every worker runs the
// same loop: claim the next item of the current phase from an atomic counter; when none is
// left, wait for the items others have claimed (they are running) and go on with the next
// phase. Any one worker can thus finish every phase alone, and nobody ever waits for a task
// that has not started (the pool's threads may all be busy with other custom calls).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "parallel/parallel_for.h"
#include "parallel/timeline.h"

namespace jb {

struct Loop {
  int64_t n = 0;
  std::function<void(int64_t)> body;  // called once for every i in [0, n)
};

struct Job {
  const char* name = "job";  // for the timeline
  std::vector<Loop> loops;
  std::vector<std::shared_ptr<const void>> keep;  // alive until the last item is done
  double flops = 0;  // the work, for deciding whether to split it at all

  void add(int64_t n, std::function<void(int64_t)> body) {
    if (n > 0) loops.push_back({n, std::move(body)});
  }
  // This job's phases, then other's.
  void then(Job other);
};

// Runs the job on the calling thread and ex's helpers; returns when every item is done.
void run(const Executor& ex, Job job);

// Schedules up to `workers` tasks with `schedule` (called only before this returns) and
// returns at once. `done` runs exactly once: on the worker that completes the last item, or
// here when the job is empty.
void run_async(const std::function<void(std::function<void()>)>& schedule, int64_t workers, Job job,
               std::function<void()> done);

// Scratch for a job: a 64-byte aligned buffer leased from a process-wide pool and given
// back when the last owner drops it, so a training step's calls reuse warm pages (as the
// per-thread Scratch does for synchronous calls) even when they outlive their caller.
std::shared_ptr<char> lease_scratch(size_t bytes);

// Carves a leased buffer into regions of the given sizes (64-byte aligned each); the
// buffer goes into job.keep.
template <size_t N>
std::array<char*, N> job_scratch(Job& job, const std::array<size_t, N>& bytes) {
  size_t total = 0;
  for (size_t b : bytes) total += (b + 63) / 64 * 64;
  std::shared_ptr<char> buf = lease_scratch(total);
  std::array<char*, N> out;
  size_t off = 0;
  for (size_t i = 0; i < N; ++i) {
    out[i] = buf.get() + off;
    off += (bytes[i] + 63) / 64 * 64;
  }
  job.keep.push_back(std::move(buf));
  return out;
}

}  // namespace jb
