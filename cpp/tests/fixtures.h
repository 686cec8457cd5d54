// What the layer tests share: a thread pool that gives every task its own thread, and a
// tensor kept as fp32 values plus its storage in the dtype under test.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "brgemm/brgemm.h"
#include "check.h"
#include "parallel/parallel_for.h"

namespace jbtest {

// A pool for tests: every scheduled task gets its own thread, joined at the end.
struct TestPool {
  std::mutex mu;
  std::vector<std::thread> threads;
  jb::Executor executor(int64_t n) {
    jb::Executor ex;
    ex.num_threads = n;
    if (n > 1)
      ex.schedule = [this](std::function<void()> task) {
        std::lock_guard<std::mutex> lock(mu);
        threads.emplace_back(std::move(task));
      };
    return ex;
  }
  ~TestPool() {
    for (auto& t : threads) t.join();
  }
};

// f holds the values as stored (bf16-rounded for bf16), h the bf16 storage.
struct Tensor {
  jb::DType dt;
  std::vector<float> f;
  std::vector<uint16_t> h;
  Tensor(jb::DType dt, int64_t size)
      : dt(dt), f(size_t(size)), h(dt == jb::DType::bf16 ? size_t(size) : 0) {}
  void* data() { return dt == jb::DType::f32 ? static_cast<void*>(f.data()) : h.data(); }
  void fill(std::mt19937& rng, float scale = 1.0f) {
    std::uniform_real_distribution<float> u(-scale, scale);
    for (size_t i = 0; i < f.size(); ++i) set(i, u(rng));
  }
  void set(size_t i, float v) {
    if (dt == jb::DType::bf16) {
      h[i] = jb::f32_to_bf16(v);
      f[i] = jb::bf16_to_f32(h[i]);
    } else {
      f[i] = v;
    }
  }
  float get(size_t i) const { return dt == jb::DType::f32 ? f[i] : jb::bf16_to_f32(h[i]); }
};

// The activations in double precision (gelu tanh-approximated, as the kernels').
inline double act_ref(jb::Activation a, double z) {
  switch (a) {
    case jb::Activation::relu: return z > 0 ? z : 0;
    case jb::Activation::sigmoid: return 1 / (1 + std::exp(-z));
    case jb::Activation::tanh: return std::tanh(z);
    case jb::Activation::gelu: return 0.5 * z * (1 + std::tanh(0.7978845608028654 * (z + 0.044715 * z * z * z)));
    default: return z;
  }
}

// |got - want| <= tol * (1 + |want|), reporting the first few mismatches.
inline bool close(const Tensor& got, const std::vector<double>& want, double tol, const std::string& what) {
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = got.get(i);
    if (!(std::fabs(g - want[i]) <= tol * (1 + std::fabs(want[i]))))
      if (bad++ < 3) CHECK(false) << what << "[" << i << "] = " << g << ", want " << want[i];
  }
  return bad == 0;
}

// --- fp32 from bf16 products (emulation) ---------------------------------------------

// Part p of v: what parts 0 .. p - 1 leave, rounded to bf16 (ops/emulation.py's split).
inline double part(float v, int p) {
  float rest = v;
  for (int q = 0; q < p; ++q) rest -= jb::bf16_to_f32(jb::f32_to_bf16(rest));
  return jb::bf16_to_f32(jb::f32_to_bf16(rest));
}

// The (part of A, part of B) products summed for 1, 3 and 6 products.
inline std::vector<std::pair<int, int>> terms_of(int64_t products) {
  if (products == 1) return {{0, 0}};
  if (products == 3) return {{0, 1}, {1, 0}, {0, 0}};
  return {{1, 1}, {0, 2}, {2, 0}, {0, 1}, {1, 0}, {0, 0}};
}

// out[i, j] = sum_t sum_q part(a[i, q]) part(b[q, j]), a (rows x depth, element (i, q) at
// a[i * as + q * aq]) and b (depth x cols, at b[q * bq + j * bs]), in double.
inline std::vector<double> part_products(int64_t products, const float* a, int64_t as, int64_t aq, const float* b,
                                  int64_t bq, int64_t bs, int64_t rows, int64_t depth, int64_t cols) {
  std::vector<double> out(size_t(rows * cols), 0.0);
  for (auto [ta, tb] : terms_of(products)) {
    std::vector<double> pa(size_t(rows * depth)), pb(size_t(depth * cols));
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t q = 0; q < depth; ++q) pa[size_t(i * depth + q)] = part(a[i * as + q * aq], ta);
    for (int64_t q = 0; q < depth; ++q)
      for (int64_t j = 0; j < cols; ++j) pb[size_t(q * cols + j)] = part(b[q * bq + j * bs], tb);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t q = 0; q < depth; ++q)
        for (int64_t j = 0; j < cols; ++j) out[size_t(i * cols + j)] += pa[size_t(i * depth + q)] * pb[size_t(q * cols + j)];
  }
  return out;
}

}  // namespace jbtest
