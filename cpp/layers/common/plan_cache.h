// Plan once, execute many: a layer's plan (blocking, kernels, offset tables, scratch
// sizes) depends only on shapes, dtypes, the thread count and the dispatch, so it is built
// on a call site's first call and found again on every later one.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace jb {

template <size_t N, class Plan>
class PlanCache {
 public:
  using Key = std::array<int64_t, N>;

  // The plan for `key`, built by build() (which returns a Plan) the first time. Plans are
  // immutable and shared: a caller keeps its shared_ptr for the duration of its call.
  template <class Build>
  std::shared_ptr<const Plan> get(const Key& key, Build&& build) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
    // Bounded: a program that cycles through very many shapes rebuilds, never grows.
    if (plans_.size() >= kMaxPlans) plans_.clear();
    auto plan = std::make_shared<const Plan>(build());
    plans_.emplace(key, plan);
    return plan;
  }

 private:
  static constexpr size_t kMaxPlans = 512;
  std::mutex mu_;
  std::map<Key, std::shared_ptr<const Plan>> plans_;
};

}  // namespace jb
