// Jobs run asynchronously (parallel/job.h), as the FFI handlers run them: phases in order,
// every item once, workers that start late or not at all, many calls in flight at once on
// a small pool, the fc passes', jb.brgemm's, attention's and the convolution's results
// bitwise equal to the synchronous path's.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "fixtures.h"
#include "layers/attention/attention.h"
#include "layers/batch_reduce.h"
#include "layers/conv/conv.h"
#include "layers/fc/fc.h"
#include "parallel/job.h"

namespace {

using namespace jb;
using jbtest::Tensor;

// A fixed set of threads taking tasks from a queue, like XLA's intra-op pool.
class QueuePool {
 public:
  explicit QueuePool(int threads) {
    for (int t = 0; t < threads; ++t)
      threads_.emplace_back([this] {
        for (;;) {
          std::function<void()> task;
          {
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
            if (queue_.empty()) return;
            task = std::move(queue_.front());
            queue_.pop_front();
          }
          task();
        }
      });
  }
  ~QueuePool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  void schedule(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// Counts finished jobs; wait() returns when `n` have.
struct Latch {
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;
  std::function<void()> arrive() {
    return [this] {
      std::lock_guard<std::mutex> lock(mu);
      ++done;
      cv.notify_all();
    };
  }
  void wait(int n) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done >= n; });
  }
};

// Starts every job on `pool` at once, in a shuffled order, and waits until all have finished.
void run_all_shuffled(std::vector<Job>& jobs, QueuePool& pool, int64_t threads, std::mt19937& rng) {
  std::shuffle(jobs.begin(), jobs.end(), rng);
  Latch latch;
  for (Job& j : jobs)
    run_async([&](std::function<void()> t) { pool.schedule(std::move(t)); }, threads, std::move(j), latch.arrive());
  latch.wait(int(jobs.size()));
}

TEST(job_phases_in_order_each_item_once_tasks_run_late) {
  // The tasks only run after run_async has returned, in any order: one worker must be able
  // to finish every phase, and a phase's items must all see the one before complete.
  std::vector<std::function<void()>> queued;
  const int64_t sizes[] = {5, 1, 37, 3};
  std::vector<std::atomic<int>> hits(5 + 1 + 37 + 3);
  std::atomic<int> phase_done[4] = {};
  std::atomic<bool> order_ok{true};
  Job job;
  int64_t base = 0;
  for (int p = 0; p < 4; ++p) {
    job.add(sizes[p], [&, p, base](int64_t i) {
      if (p > 0 && phase_done[p - 1].load() != sizes[p - 1]) order_ok = false;
      hits[size_t(base + i)].fetch_add(1);
      phase_done[p].fetch_add(1);
    });
    base += sizes[p];
  }
  int done = 0;
  run_async([&](std::function<void()> t) { queued.push_back(std::move(t)); }, 4, std::move(job), [&] { ++done; });
  CHECK(done == 0) << "finished before any task ran";
  CHECK(queued.size() == 4);
  for (auto it = queued.rbegin(); it != queued.rend(); ++it) (*it)();
  CHECK(done == 1);
  CHECK(order_ok.load());
  for (size_t i = 0; i < hits.size(); ++i) CHECK(hits[i].load() == 1) << "item " << i;
}

TEST(job_empty_finishes_at_once) {
  int done = 0;
  run_async([](std::function<void()>) { CHECK(false) << "nothing to schedule"; }, 2, Job(), [&] { ++done; });
  CHECK(done == 1);
}

// Every fc pass of one layer, each as a job, with its inputs and outputs.
struct FcCase {
  fc::Shape s;
  DType w_dt;
  Tensor x, w, b, y, z, dy, dz, dx, dw, db, wu, mu, bu, mbu;
  FcCase(int64_t n, int64_t c, int64_t k, DType dt, DType w_dt, Activation act, std::mt19937& rng)
      : s{n, c, k, dt, act},
        w_dt(w_dt),
        x(dt, n * c), w(w_dt, c * k), b(DType::f32, k), y(dt, n * k), z(dt, n * k), dy(dt, n * k), dz(dt, n * k),
        dx(dt, n * c), dw(w_dt, c * k), db(DType::f32, k), wu(DType::f32, c * k), mu(DType::f32, c * k),
        bu(DType::f32, k), mbu(DType::f32, k) {
    for (Tensor* t : {&x, &w, &b, &dy, &wu, &mu, &bu, &mbu}) t->fill(rng);
  }
  std::vector<Job> jobs(int64_t threads) {
    const Dispatch dp = dispatch();
    std::vector<Job> out;
    out.push_back(fc::forward_job(threads, dp, s, x.data(), w.data(), w_dt, b.f.data(), y.data(), z.data()));
    if (s.act != Activation::none)
      out.push_back(fc::act_grad_job(threads, dp, s, dy.data(), s.act == Activation::gelu ? z.data() : y.data(),
                                      dz.data()));
    out.push_back(fc::backward_job(threads, dp, s, dy.data(), w.data(), w_dt, dx.data()));
    out.push_back(fc::update_job(threads, dp, s, x.data(), dy.data(), dw.data(), w_dt, db.f.data()));
    out.push_back(fc::update_sgd_job(threads, dp, s, x.data(), dy.data(), {0.01f, 0.9f, 1e-4f, true},
                                     wu.f.data(), mu.f.data(), bu.f.data(), mbu.f.data()));
    return out;
  }
  std::vector<std::vector<uint16_t>> bits() const {
    std::vector<std::vector<uint16_t>> out;
    for (const Tensor* t : {&y, &z, &dz, &dx, &dw, &db, &wu, &mu, &bu, &mbu}) {
      const char* p = t->dt == DType::f32 ? reinterpret_cast<const char*>(t->f.data())
                                          : reinterpret_cast<const char*>(t->h.data());
      const size_t bytes = t->f.size() * dtype_size(t->dt);
      out.emplace_back(reinterpret_cast<const uint16_t*>(p), reinterpret_cast<const uint16_t*>(p + bytes));
    }
    return out;
  }
};

TEST(fc_async_many_overlapping_calls_bitwise_equal_to_sync) {
  std::mt19937 rng(45);
  struct Spec {
    int64_t n, c, k;
    DType dt, w_dt;
    Activation act;
  };
  const Spec specs[] = {{256, 784, 1024, DType::f32, DType::f32, Activation::relu},
                        {64, 1024, 1024, DType::f32, DType::f32, Activation::relu},
                        {37, 200, 130, DType::f32, DType::f32, Activation::gelu},
                        {100, 96, 250, DType::bf16, DType::f32, Activation::tanh},
                        {3000, 64, 48, DType::f32, DType::f32, Activation::none},  // long batch update
                        {12, 33, 10, DType::bf16, DType::bf16, Activation::sigmoid}};
  const int64_t threads = 2;
  jbtest::TestPool sync_pool;
  const Executor ex = sync_pool.executor(threads);
  std::vector<std::vector<std::vector<uint16_t>>> want;
  for (const Spec& sp : specs) {
    std::mt19937 r(uint32_t(sp.n * 7 + sp.c));
    FcCase cs(sp.n, sp.c, sp.k, sp.dt, sp.w_dt, sp.act, r);
    for (Job& j : cs.jobs(threads)) run(ex, std::move(j));
    want.push_back(cs.bits());
  }
  // Every spec three times over, all passes of all of them in flight at once on a
  // two-thread pool (each pass's inputs are ready: the layers' outputs are independent).
  QueuePool pool(2);
  for (int round = 0; round < 3; ++round) {
    std::vector<std::unique_ptr<FcCase>> cases;
    std::vector<Job> jobs;
    for (const Spec& sp : specs)
      for (int copy = 0; copy < 3; ++copy) {
        std::mt19937 r(uint32_t(sp.n * 7 + sp.c));
        cases.push_back(std::make_unique<FcCase>(sp.n, sp.c, sp.k, sp.dt, sp.w_dt, sp.act, r));
      }
    // act_grad reads the forward's y, and the sgd update the same x and dy as the update:
    // the forward and act_grad of a case go in one job, phase after phase.
    for (auto& cs : cases) {
      std::vector<Job> js = cs->jobs(threads);
      Job first = std::move(js[0]);
      size_t rest = 1;
      if (cs->s.act != Activation::none) first.then(std::move(js[rest++]));
      jobs.push_back(std::move(first));
      for (; rest < js.size(); ++rest) jobs.push_back(std::move(js[rest]));
    }
    run_all_shuffled(jobs, pool, threads, rng);
    for (size_t i = 0; i < cases.size(); ++i)
      CHECK(cases[i]->bits() == want[i / 3]) << "spec " << i / 3 << " copy " << i % 3 << " round " << round;
  }
}

// jb.brgemm's op and both attention passes, as jobs: the results of many in flight at once
// on a small pool equal those of the same jobs run one by one, bit for bit.
struct OtherCase {
  DType dt;
  int64_t items = 3, batch = 8, m = 40, k = 64, n = 72;
  attention::Shape as;
  Tensor a, b, c, out, q, kk, v, o, stats, dout, dq, dk, dv;
  std::vector<int64_t> offs, q_offs, kv_offs, st_offs;
  OtherCase(DType dt, bool causal, std::mt19937& rng)
      : dt(dt),
        as{2, 64, 80, 4, 2, 32, dt, 0.17f, causal},
        a(dt, items * batch * m * k), b(dt, items * batch * k * n), c(DType::f32, items * m * n),
        out(DType::f32, items * m * n), q(dt, 2 * 64 * 4 * 32), kk(dt, 2 * 80 * 2 * 32), v(dt, 2 * 80 * 2 * 32),
        o(dt, 2 * 64 * 4 * 32), stats(DType::f32, 2 * 4 * 64 * 2), dout(dt, 2 * 64 * 4 * 32),
        dq(dt, 2 * 64 * 4 * 32), dk(dt, 2 * 80 * 2 * 32), dv(dt, 2 * 80 * 2 * 32) {
    for (Tensor* t : {&a, &b, &c, &q, &kk, &v, &dout}) t->fill(rng);
    for (int64_t l = 0; l < items; ++l) offs.push_back(l * batch * m * k);
    for (int64_t l = 0; l < items; ++l) offs.push_back(l * batch * k * n);
    for (int64_t l = 0; l < items; ++l) offs.push_back(l * m * n);
    q_offs = {0, 64 * 4 * 32}, kv_offs = {0, 80 * 2 * 32}, st_offs = {0, 4 * 64 * 2};
  }
  attention::Inputs inputs() {
    attention::Inputs in;
    in.q = q.data(), in.k = kk.data(), in.v = v.data();
    in.q_offs = q_offs.data(), in.k_offs = kv_offs.data(), in.v_offs = kv_offs.data();
    return in;
  }
  // The op and the forward; then (reading the forward's o and stats) the backward.
  std::vector<Job> jobs(int64_t threads) {
    const Dispatch dp = dispatch();
    batch_reduce::Shape s{items, batch, m, k, n, dt, DType::f32, true, items * batch};
    std::vector<Job> out_jobs;
    out_jobs.push_back(batch_reduce::run_job(threads, dp, s, a.data(), b.data(), c.data(), out.data(),
                                             {offs.data(), offs.data() + items, offs.data() + 2 * items}));
    Job attn = attention::forward_job(threads, dp, as, inputs(), o.data(), stats.f.data());
    attention::Saved saved;
    saved.o = o.data(), saved.dout = dout.data(), saved.stats = stats.f.data();
    saved.o_offs = q_offs.data(), saved.dout_offs = q_offs.data(), saved.stats_offs = st_offs.data();
    attn.then(attention::backward_job(threads, dp, as, inputs(), saved, dq.data(), dk.data(), dv.data(), nullptr));
    out_jobs.push_back(std::move(attn));
    return out_jobs;
  }
  std::vector<std::vector<uint16_t>> bits() const {
    std::vector<std::vector<uint16_t>> res;
    for (const Tensor* t : {&out, &o, &stats, &dq, &dk, &dv}) {
      const char* p = t->dt == DType::f32 ? reinterpret_cast<const char*>(t->f.data())
                                          : reinterpret_cast<const char*>(t->h.data());
      const size_t bytes = t->f.size() * dtype_size(t->dt);
      res.emplace_back(reinterpret_cast<const uint16_t*>(p), reinterpret_cast<const uint16_t*>(p + bytes));
    }
    return res;
  }
};

TEST(brgemm_and_attention_async_bitwise_equal_to_sync) {
  const int64_t threads = 2;
  const std::pair<DType, bool> specs[] = {{DType::f32, false}, {DType::f32, true}, {DType::bf16, false}};
  jbtest::TestPool sync_pool;
  const Executor ex = sync_pool.executor(threads);
  std::vector<std::vector<std::vector<uint16_t>>> want;
  for (const auto& [dt, causal] : specs) {
    std::mt19937 r(uint32_t(int(dt) * 2 + causal));
    OtherCase cs(dt, causal, r);
    for (Job& j : cs.jobs(threads)) run(ex, std::move(j));
    want.push_back(cs.bits());
  }
  QueuePool pool(2);
  std::mt19937 rng(7);
  for (int round = 0; round < 2; ++round) {
    std::vector<std::unique_ptr<OtherCase>> cases;
    std::vector<Job> jobs;
    for (const auto& [dt, causal] : specs)
      for (int copy = 0; copy < 3; ++copy) {
        std::mt19937 r(uint32_t(int(dt) * 2 + causal));
        cases.push_back(std::make_unique<OtherCase>(dt, causal, r));
        for (Job& j : cases.back()->jobs(threads)) jobs.push_back(std::move(j));
      }
    run_all_shuffled(jobs, pool, threads, rng);
    for (size_t i = 0; i < cases.size(); ++i)
      CHECK(cases[i]->bits() == want[i / 3]) << "spec " << i / 3 << " copy " << i % 3 << " round " << round;
  }
}

// The three convolution passes of one layer, as jobs: direct (padded, strided, bf16),
// narrow groups, depthwise and pointwise shapes.
struct ConvCase {
  conv::Shape s;
  DType w_dt;
  Tensor x, w, b, y, z, dy, dx, dw, db;
  ConvCase(const conv::Shape& shape, DType w_dt, std::mt19937& rng)
      : s(shape),
        w_dt(w_dt),
        x(s.dt, s.n * s.h * s.w * s.c), w(w_dt, s.r * s.s * s.cg() * s.k), b(DType::f32, s.k),
        y(s.dt, s.n * s.p() * s.q() * s.k), z(s.dt, s.n * s.p() * s.q() * s.k), dy(s.dt, s.n * s.p() * s.q() * s.k),
        dx(s.dt, s.n * s.h * s.w * s.c), dw(w_dt, s.r * s.s * s.cg() * s.k), db(DType::f32, s.k) {
    for (Tensor* t : {&x, &w, &b, &dy}) t->fill(rng);
  }
  std::vector<Job> jobs(int64_t threads) {
    const Dispatch dp = dispatch();
    std::vector<Job> out;
    out.push_back(conv::forward_job(threads, dp, s, x.data(), w.data(), w_dt, b.f.data(), y.data(),
                                    s.act == Activation::gelu ? z.data() : nullptr));
    out.push_back(conv::backward_job(threads, dp, s, dy.data(), w.data(), w_dt, dx.data()));
    out.push_back(conv::update_job(threads, dp, s, x.data(), dy.data(), dw.data(), w_dt, db.f.data()));
    return out;
  }
  std::vector<std::vector<uint16_t>> bits() const {
    std::vector<std::vector<uint16_t>> res;
    for (const Tensor* t : {&y, &z, &dx, &dw, &db}) {
      const char* p = t->dt == DType::f32 ? reinterpret_cast<const char*>(t->f.data())
                                          : reinterpret_cast<const char*>(t->h.data());
      const size_t bytes = t->f.size() * dtype_size(t->dt);
      res.emplace_back(reinterpret_cast<const uint16_t*>(p), reinterpret_cast<const uint16_t*>(p + bytes));
    }
    return res;
  }
};

conv::Shape conv_shape(int64_t n, int64_t hw, int64_t c, int64_t k, int64_t rs, int64_t stride, int64_t pad,
                       int64_t groups, DType dt, Activation act) {
  conv::Shape s;
  s.n = n, s.h = s.w = hw, s.c = c, s.k = k, s.r = s.s = rs, s.sh = s.sw = stride;
  s.pt = s.pb = s.pl = s.pr = pad;
  s.groups = groups, s.dt = dt, s.act = act;
  return s;
}

TEST(conv_async_overlapping_calls_bitwise_equal_to_sync) {
  const int64_t threads = 2;
  const std::pair<conv::Shape, DType> specs[] = {
      {conv_shape(2, 14, 32, 64, 3, 1, 1, 1, DType::f32, Activation::relu), DType::f32},
      {conv_shape(2, 15, 32, 48, 3, 2, 1, 1, DType::f32, Activation::gelu), DType::f32},  // strided
      {conv_shape(2, 12, 64, 64, 3, 1, 1, 8, DType::f32, Activation::none), DType::f32},  // narrow groups
      {conv_shape(2, 13, 64, 64, 3, 2, 1, 64, DType::f32, Activation::relu), DType::f32},  // depthwise
      {conv_shape(2, 13, 48, 48, 5, 1, 2, 48, DType::bf16, Activation::none), DType::bf16},  // depthwise
      {conv_shape(4, 8, 64, 128, 1, 1, 0, 1, DType::bf16, Activation::tanh), DType::f32},  // pointwise
      {conv_shape(2, 9, 16, 32, 3, 1, 0, 2, DType::bf16, Activation::none), DType::bf16}};
  jbtest::TestPool sync_pool;
  const Executor ex = sync_pool.executor(threads);
  std::vector<std::vector<std::vector<uint16_t>>> want;
  for (size_t i = 0; i < std::size(specs); ++i) {
    std::mt19937 r(uint32_t(i * 11 + 3));
    ConvCase cs(specs[i].first, specs[i].second, r);
    for (Job& j : cs.jobs(threads)) run(ex, std::move(j));
    want.push_back(cs.bits());
  }
  QueuePool pool(2);
  std::mt19937 rng(9);
  for (int round = 0; round < 2; ++round) {
    std::vector<std::unique_ptr<ConvCase>> cases;
    std::vector<Job> jobs;
    for (size_t i = 0; i < std::size(specs); ++i)
      for (int copy = 0; copy < 3; ++copy) {
        std::mt19937 r(uint32_t(i * 11 + 3));
        cases.push_back(std::make_unique<ConvCase>(specs[i].first, specs[i].second, r));
        for (Job& j : cases.back()->jobs(threads)) jobs.push_back(std::move(j));
      }
    run_all_shuffled(jobs, pool, threads, rng);
    for (size_t i = 0; i < cases.size(); ++i)
      CHECK(cases[i]->bits() == want[i / 3]) << "spec " << i / 3 << " copy " << i % 3 << " round " << round;
  }
}

}  // namespace
