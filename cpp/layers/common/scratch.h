// Scratch memory of a layer call, owned by the calling thread: one growing buffer per
// thread, so the re-blocked operands of a training step reuse warm pages call after call
// instead of faulting in fresh ones. Only the calling thread allocates (before any work
// item runs); work items write into the regions it hands them, and the caller outlives
// every item.
#pragma once

#include <array>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>

namespace jb {

class Scratch {
 public:
  // Carves regions of the given byte sizes, each 64-byte aligned. The regions stay valid
  // until the same thread asks again.
  template <size_t N>
  static std::array<char*, N> get(const std::array<size_t, N>& bytes) {
    thread_local std::unique_ptr<char, Free> buf;
    thread_local size_t cap = 0;
    size_t total = 0;
    for (size_t b : bytes) total += aligned(b);
    if (total > cap) {
      buf.reset();
      cap = 0;
      char* p = static_cast<char*>(std::aligned_alloc(64, aligned(total ? total : 64)));
      if (!p) throw std::bad_alloc();
      buf.reset(p);
      cap = total;
    }
    std::array<char*, N> out;
    size_t off = 0;
    for (size_t i = 0; i < N; ++i) {
      out[i] = buf.get() + off;
      off += aligned(bytes[i]);
    }
    return out;
  }

  static size_t aligned(size_t bytes) { return (bytes + 63) / 64 * 64; }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
};

}  // namespace jb
