// A minimal test registry for the C++ kernel tests (no dependencies, sanitizer friendly).
// TEST(name) { ... } registers a test; CHECK(cond) << "context" records a failure.
#pragma once

#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace jbtest {

struct Test {
  const char* name;
  std::function<void()> fn;
};
inline std::vector<Test>& registry() {
  static std::vector<Test> tests;
  return tests;
}
inline int& failures() {
  static int n = 0;
  return n;
}

struct Registrar {
  Registrar(const char* name, std::function<void()> fn) { registry().push_back({name, fn}); }
};

// Collects the streamed context and reports it when the check failed.
class Failure {
 public:
  Failure(const char* file, int line, const char* expr) {
    msg_ << file << ":" << line << ": CHECK(" << expr << ") failed ";
  }
  ~Failure() {
    ++failures();
    std::fprintf(stderr, "%s\n", msg_.str().c_str());
  }
  template <class T>
  Failure& operator<<(const T& v) {
    msg_ << v;
    return *this;
  }

 private:
  std::ostringstream msg_;
};

}  // namespace jbtest

#define TEST(name)                                              \
  static void test_##name();                                    \
  static jbtest::Registrar registrar_##name(#name, test_##name); \
  static void test_##name()

#define CHECK(cond) \
  if (cond) {       \
  } else            \
    jbtest::Failure(__FILE__, __LINE__, #cond)
