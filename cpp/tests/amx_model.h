// A software model of the AMX tile unit (palette 1), so that the AMX BRGEMM driver
// (brgemm/amx_driver.h) runs in the tests on any host. It reads and writes exactly the
// bytes the instructions would, so ASan checks the driver's tile addressing, and it throws
// std::logic_error where the hardware faults: an unconfigured tile, shapes TDPBF16PS
// cannot combine, a configuration LDTILECFG refuses.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "brgemm/amx_driver.h"

namespace jbtest {
namespace {  // like the driver it runs: internal linkage

struct AmxModel {
  struct State {
    jb::TileConfig cfg;
    bool configured = false;
    uint8_t tile[8][16][64] = {};
  };
  static State& state() {
    thread_local State s;
    return s;
  }
  static void require(bool ok, const std::string& what) {
    if (!ok) throw std::logic_error("AMX model: " + what);
  }

  static void configure(const jb::TileConfig& cfg) {
    require(cfg.palette == 1, "palette " + std::to_string(cfg.palette) + " (only 1 is modelled)");
    for (int r = 0; r < 16; ++r) {
      const int most_rows = r < 8 ? 16 : 0, most_bytes = r < 8 ? 64 : 0;
      require(cfg.rows[r] <= most_rows && cfg.colsb[r] <= most_bytes,
              "tile " + std::to_string(r) + " is larger than the palette allows");
      require((cfg.rows[r] == 0) == (cfg.colsb[r] == 0), "tile " + std::to_string(r) + " has rows or bytes only");
    }
    State& s = state();
    s.cfg = cfg;
    s.configured = true;
    std::memset(s.tile, 0, sizeof(s.tile));  // LDTILECFG zeroes every tile
  }
  static void release() { state() = State{}; }
  static jb::BrgemmFn rest() { return jb::detail::brgemm_generic(); }

  static void check_tile(int r) {
    const State& s = state();
    require(s.configured && s.cfg.rows[r] > 0, "tile " + std::to_string(r) + " used without a configuration");
  }
  template <int R>
  static void zero() {
    check_tile(R);
    std::memset(state().tile[R], 0, sizeof(state().tile[R]));
  }
  // Rows and bytes past the configured shape read as zero, as on the hardware.
  template <int R>
  static void load(const void* p, int64_t stride) {
    check_tile(R);
    State& s = state();
    std::memset(s.tile[R], 0, sizeof(s.tile[R]));
    for (int i = 0; i < s.cfg.rows[R]; ++i)
      std::memcpy(s.tile[R][i], static_cast<const char*>(p) + i * stride, s.cfg.colsb[R]);
  }
  template <int R>
  static void store(void* p, int64_t stride) {
    check_tile(R);
    const State& s = state();
    for (int i = 0; i < s.cfg.rows[R]; ++i)
      std::memcpy(static_cast<char*>(p) + i * stride, s.tile[R][i], s.cfg.colsb[R]);
  }

  // TDPBF16PS: C[m][n] += A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1], each product added in
  // fp32 in that order; denormal inputs read as zero and denormal sums flush to zero.
  template <int C, int A, int B>
  static void dot() {
    static_assert(C != A && C != B && A != B, "TDPBF16PS takes three distinct tiles");
    check_tile(C), check_tile(A), check_tile(B);
    State& s = state();
    const int m = s.cfg.rows[C], n = s.cfg.colsb[C] / 4, k = s.cfg.colsb[A] / 4;
    require(s.cfg.colsb[C] % 4 == 0 && s.cfg.colsb[A] % 4 == 0, "a tile row of partial elements");
    require(s.cfg.rows[A] == m, "A's rows differ from C's");
    require(s.cfg.rows[B] == k, "B's rows differ from A's k pairs");
    require(s.cfg.colsb[B] == s.cfg.colsb[C], "B's columns differ from C's");
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        float acc = element(s.tile[C][i], j);
        for (int p = 0; p < k; ++p)
          for (int h = 0; h < 2; ++h)
            acc = flush(acc + bf16(s.tile[A][i], 2 * p + h) * bf16(s.tile[B][p], 2 * j + h));
        std::memcpy(s.tile[C][i] + 4 * j, &acc, 4);
      }
  }

 private:
  static float element(const uint8_t* row, int j) {
    float v;
    std::memcpy(&v, row + 4 * j, 4);
    return v;
  }
  static float bf16(const uint8_t* row, int j) {
    uint16_t h;
    std::memcpy(&h, row + 2 * j, 2);
    return (h & 0x7f80u) == 0 ? 0.0f * jb::bf16_to_f32(h) : jb::bf16_to_f32(h);  // signed zero
  }
  static float flush(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return (u & 0x7f800000u) == 0 ? 0.0f * v : v;
  }
};

// The AMX driver on the model; its k remainders run on the portable kernel.
inline jb::BrgemmFn amx_model_kernel() { return &jb::run_amx_bf16<AmxModel>; }

}  // namespace
}  // namespace jbtest
