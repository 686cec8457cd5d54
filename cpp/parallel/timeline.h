// The timeline of a profile: when on, every worker's stretch in a job (thread id, start and
// end in ns of CLOCK_MONOTONIC, the start in CLOCK_REALTIME to line it up with other traces,
// the time spent re-blocking inside it, the job's name, whether it ran asynchronously) is
// recorded, and the calling thread's own, up to a fixed number of spans. Timestamps are
// only recorded, never acted on; off, it costs a relaxed load per stretch and per re-blocking.
#pragma once

#include <cstdint>
#include <vector>

namespace jb {

struct Span {
  int64_t tid, t0, t1, real0;
  int64_t reblock_ns;  // of the stretch, spent re-blocking weights and operands
  const char* name;
  bool async;
  bool caller;  // the calling thread's own stretch (run's caller, run_async's scheduling)
};

void timeline_enable(bool on);
bool timeline_enabled();
std::vector<Span> timeline_take();  // the spans so far, oldest first; clears them

// A stretch: started (when the timeline is on), then recorded.
struct SpanStart {
  int64_t t0 = -1, real0 = 0;
};
SpanStart timeline_start();
void timeline_record(const SpanStart& start, const char* name, bool async, bool caller);

// Times a re-blocking loop into the current worker's span when the timeline is on.
class ReblockTimer {
 public:
  ReblockTimer();
  ~ReblockTimer();

 private:
  int64_t t0_;
};

}  // namespace jb
