#include "parallel/timeline.h"

#include <algorithm>
#include <atomic>
#include <ctime>
#include <functional>
#include <thread>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace jb {

namespace {

constexpr size_t kMaxSpans = size_t(1) << 16;
std::atomic<bool> timeline_on{false};
std::atomic<size_t> span_count{0};
Span spans[kMaxSpans];
thread_local int64_t reblock_total = 0;  // ns re-blocking in this thread's current stretch

int64_t now_ns(clockid_t clock) {
  timespec ts;
  clock_gettime(clock, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

int64_t thread_id() {
#if defined(__linux__)
  thread_local const int64_t tid = int64_t(syscall(SYS_gettid));
  return tid;
#else
  return int64_t(std::hash<std::thread::id>()(std::this_thread::get_id()));
#endif
}

}  // namespace

void timeline_enable(bool on) { timeline_on.store(on, std::memory_order_relaxed); }
bool timeline_enabled() { return timeline_on.load(std::memory_order_relaxed); }

std::vector<Span> timeline_take() {
  const size_t n = std::min(span_count.exchange(0), kMaxSpans);
  return std::vector<Span>(spans, spans + n);
}

SpanStart timeline_start() {
  if (!timeline_enabled()) return {};
  reblock_total = 0;
  return {now_ns(CLOCK_MONOTONIC), now_ns(CLOCK_REALTIME)};
}

void timeline_record(const SpanStart& start, const char* name, bool async, bool caller) {
  if (start.t0 < 0) return;
  const size_t s = span_count.fetch_add(1, std::memory_order_relaxed);
  if (s < kMaxSpans)
    spans[s] = {thread_id(), start.t0, now_ns(CLOCK_MONOTONIC), start.real0, reblock_total, name, async, caller};
  reblock_total = 0;
}

ReblockTimer::ReblockTimer() : t0_(timeline_enabled() ? now_ns(CLOCK_MONOTONIC) : -1) {}
ReblockTimer::~ReblockTimer() {
  if (t0_ >= 0) reblock_total += now_ns(CLOCK_MONOTONIC) - t0_;
}

}  // namespace jb
