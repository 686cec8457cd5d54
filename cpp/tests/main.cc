// Runs every registered kernel test; prints a pytest-style closing line.
#include <cstdio>
#include <cstring>

#include "check.h"

// Optional argument: run only the tests whose name contains it.
int main(int argc, char** argv) {
  int passed = 0, failed = 0;
  for (const auto& t : jbtest::registry()) {
    if (argc > 1 && !std::strstr(t.name, argv[1])) continue;
    const int before = jbtest::failures();
    t.fn();
    const bool ok = jbtest::failures() == before;
    std::printf("%-48s %s\n", t.name, ok ? "ok" : "FAILED");
    (ok ? passed : failed)++;
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
