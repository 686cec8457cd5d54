// Runs every registered kernel test; prints a pytest-style closing line.
#include <cstdio>

#include "check.h"

int main() {
  int passed = 0, failed = 0;
  for (const auto& t : jbtest::registry()) {
    const int before = jbtest::failures();
    t.fn();
    const bool ok = jbtest::failures() == before;
    std::printf("%-48s %s\n", t.name, ok ? "ok" : "FAILED");
    (ok ? passed : failed)++;
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
