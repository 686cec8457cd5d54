// The LSTM cell loops. Branch-free inner loops, so that every target vectorizes them.
#include "layers/lstm/cell.h"

#include <cstring>
#include <type_traits>

#include "brgemm/activation.h"
#include "layers/common/target.h"

namespace jb::lstm {

namespace {

// Copies `bytes` from src to dst with non-temporal stores where dst is 16-byte aligned: for
// rows written now and read back only by a later pass (from memory anyway), this skips the
// read-for-ownership of every line and keeps them out of the caches.
JB_INLINE void stream_bytes(void* dst, const void* src, size_t bytes) {
#if defined(JB_X86)
  if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    auto* d = static_cast<__m128i*>(dst);
    auto* q = static_cast<const char*>(src);
    size_t i = 0;
    for (; i + 16 <= bytes; i += 16) _mm_stream_si128(d++, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
    std::memcpy(static_cast<char*>(dst) + i, q + i, bytes - i);
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

// Ty: the compute dtype's storage, Th: the multiply dtype's; kNext: h_t for the next step,
// kSave: the gates saved.
template <class Ty, class Th, bool kNext, bool kSave>
JB_INLINE void forward_rows(const CellForward& a) {
  // fp32 gates are saved as they are: streamed from the tile after each row (below).
  constexpr bool kStream = kSave && std::is_same_v<Ty, float>;
  const int64_t rows = a.rows, cols = a.cols, gs = a.gate_stride, ss = a.saved_gate_stride;
  for (int64_t r = 0; r < rows; ++r) {
    const float* gates = a.gates + r * a.gates_ld;
    const float* c_prev = a.c_prev + r * a.c_ld;
    float* c_next = a.c_next + r * a.c_ld;
    Ty* y = static_cast<Ty*>(a.y) + r * a.y_ld;
    Th* h = kNext ? static_cast<Th*>(a.h_next) + r * a.h_ld : nullptr;
    Ty* saved = kSave ? static_cast<Ty*>(a.saved) + r * a.saved_ld : nullptr;
    // c_t, y and the saved gates go to memory nothing has touched yet: ask for the row two
    // ahead's lines for writing now, so their read-for-ownership overlaps this row's work.
    if (r + 2 < rows) {
      for (int64_t j = 0; j < cols; j += int64_t(64 / sizeof(float))) __builtin_prefetch(c_next + 2 * a.c_ld + j, 1, 3);
      for (int64_t j = 0; j < cols; j += int64_t(64 / sizeof(Ty))) {
        __builtin_prefetch(y + 2 * a.y_ld + j, 1, 3);
        if constexpr (kSave && !kStream)
          for (int q = 0; q < kGates; ++q) __builtin_prefetch(saved + 2 * a.saved_ld + q * ss + j, 1, 3);
      }
    }
    // No loop-carried dependencies: c_t may overwrite c_{t-1} in place, element by element.
#pragma GCC ivdep
    for (int64_t j = 0; j < cols; ++j) {
      const float c = gates[gs + j] * c_prev[j] + gates[j] * gates[2 * gs + j];
      const float hv = gates[3 * gs + j] * tanh_f(c);
      c_next[j] = c;
      y[j] = from_f32<Ty>(hv);
      if constexpr (kNext) h[j] = from_f32<Th>(hv);
      if constexpr (kSave && !kStream)
        for (int q = 0; q < kGates; ++q) saved[q * ss + j] = from_f32<Ty>(gates[q * gs + j]);
    }
    if constexpr (kStream)
      for (int q = 0; q < kGates; ++q) stream_bytes(saved + q * ss, gates + q * gs, size_t(cols) * sizeof(float));
  }
}

template <class Ty, class Th>
struct ForwardLoop {
  static JB_INLINE void run(const CellForward& a) {
    if (a.h_next) a.saved ? forward_rows<Ty, Th, true, true>(a) : forward_rows<Ty, Th, true, false>(a);
    else a.saved ? forward_rows<Ty, Th, false, true>(a) : forward_rows<Ty, Th, false, false>(a);
  }
};

// Tx: the compute dtype's storage, Tk: the multiply dtype's.
template <class Tx, class Tk>
struct BackwardLoop {
  static JB_INLINE void run(const CellBackward& a) {
    // When da and the next step's copy share a dtype, da is streamed from that copy after
    // each row (below) instead of stored element by element.
    constexpr bool kStream = std::is_same_v<Tx, Tk>;
    const int64_t rows = a.rows, cols = a.cols, k = a.gate_cols, gs = a.gate_stride;
    for (int64_t r = 0; r < rows; ++r) {
      const Tx* gates = static_cast<const Tx*>(a.gates) + r * a.gates_ld;
      const float* c = a.c + r * a.c_ld;
      const float* c_prev = a.c_prev + r * a.c_ld;
      const float* dh_rec = a.dh_rec + r * a.c_ld;
      const Tx* dy = static_cast<const Tx*>(a.dy) + r * a.dy_ld;
      float* dc = a.dc + r * a.c_ld;
      Tx* da = static_cast<Tx*>(a.da) + r * a.da_ld;
      Tk* da_next = static_cast<Tk*>(a.da_next) + r * a.da_next_ld;
      float* db = a.db;
      // da goes to memory nothing has read for a long time (T x N x 4K): stored element by
      // element, ask for the row two ahead's lines for writing now (as the forward cell).
      if (!kStream && r + 2 < rows)
        for (int64_t j = 0; j < cols; j += int64_t(64 / sizeof(Tx)))
          for (int q = 0; q < kGates; ++q)
            __builtin_prefetch(static_cast<Tx*>(a.da) + (r + 2) * a.da_ld + q * k + j, 1, 3);
      // Every array is distinct but dc, which is updated element by element in place. No
      // conditions: the vectorizer would make them masked loads, slow from a null array.
#pragma GCC ivdep
      for (int64_t j = 0; j < cols; ++j) {
        const float dh = to_f32(dy[j]) + dh_rec[j];
        const float i = to_f32(gates[j]), f = to_f32(gates[gs + j]), g = to_f32(gates[2 * gs + j]),
                    o = to_f32(gates[3 * gs + j]);
        const float tc = tanh_f(c[j]);
        const float dcur = dc[j] + dh * o * (1.0f - tc * tc);
        const float da_i = dcur * g * i * (1.0f - i);
        const float da_f = dcur * c_prev[j] * f * (1.0f - f);
        const float da_g = dcur * i * (1.0f - g * g);
        const float da_o = dh * tc * o * (1.0f - o);
        dc[j] = dcur * f;
        if constexpr (!kStream) {
          da[j] = from_f32<Tx>(da_i);
          da[k + j] = from_f32<Tx>(da_f);
          da[2 * k + j] = from_f32<Tx>(da_g);
          da[3 * k + j] = from_f32<Tx>(da_o);
        }
        da_next[j] = from_f32<Tk>(da_i);
        da_next[k + j] = from_f32<Tk>(da_f);
        da_next[2 * k + j] = from_f32<Tk>(da_g);
        da_next[3 * k + j] = from_f32<Tk>(da_o);
        db[j] += da_i;
        db[k + j] += da_f;
        db[2 * k + j] += da_g;
        db[3 * k + j] += da_o;
      }
      if constexpr (kStream)
        for (int q = 0; q < kGates; ++q) stream_bytes(da + q * k, da_next + q * k, size_t(cols) * sizeof(Tx));
    }
  }
};

// Tx: the compute dtype's storage, Th: the multiply dtype's.
template <class Tx, class Th>
struct TangentLoop {
  static JB_INLINE void run(const CellTangent& a) {
    const int64_t cols = a.cols, k = a.gate_cols, ps = a.pre_stride, gs = a.gate_stride;
    for (int64_t r = 0; r < a.rows; ++r) {
      float* pre = a.pre + r * a.pre_ld;
      // The pre-activation tangent's other terms, into the tile row (hot in L1).
      const float* tb = a.tb + r * a.tb_ld;
      for (int q = 0; q < kGates; ++q)
        for (int64_t j = 0; j < cols; ++j) pre[q * ps + j] += tb[q * k + j];
      for (const void* piece : a.tp) {
        if (!piece) continue;
        const Tx* tp = static_cast<const Tx*>(piece) + r * a.tp_ld;
        for (int q = 0; q < kGates; ++q)
          for (int64_t j = 0; j < cols; ++j) pre[q * ps + j] += to_f32(tp[q * k + j]);
      }
      const Tx* gates = static_cast<const Tx*>(a.gates) + r * a.gates_ld;
      const float* c = a.c + r * a.c_ld;
      const float* c_prev = a.c_prev + r * a.c_ld;
      float* tc = a.tc + r * a.c_ld;
      Tx* ty = static_cast<Tx*>(a.ty) + r * a.ty_ld;
      Th* th = a.th_next ? static_cast<Th*>(a.th_next) + r * a.th_ld : nullptr;
      // tc is updated element by element in place; every other array is distinct.
#pragma GCC ivdep
      for (int64_t j = 0; j < cols; ++j) {
        const float i = to_f32(gates[j]), f = to_f32(gates[gs + j]), g = to_f32(gates[2 * gs + j]),
                    o = to_f32(gates[3 * gs + j]);
        const float ta_i = pre[j] * i * (1.0f - i);
        const float ta_f = pre[ps + j] * f * (1.0f - f);
        const float ta_g = pre[2 * ps + j] * (1.0f - g * g);
        const float ta_o = pre[3 * ps + j] * o * (1.0f - o);
        const float tcv = ta_f * c_prev[j] + f * tc[j] + ta_i * g + i * ta_g;
        const float tch = tanh_f(c[j]);
        const float thv = ta_o * tch + o * (1.0f - tch * tch) * tcv;
        tc[j] = tcv;
        ty[j] = from_f32<Tx>(thv);
        pre[j] = thv;  // kept for th_next, below (a separate loop: no condition in this one)
      }
      if (th)
        for (int64_t j = 0; j < cols; ++j) th[j] = from_f32<Th>(pre[j]);
    }
  }
};

}  // namespace

CellForwardFn cell_forward(DType dt, DType mul_dt, Isa isa) {
  if (dt == DType::f32) return target::variant<ForwardLoop<float, float>>(isa);
  return mul_dt == DType::f32 ? target::variant<ForwardLoop<uint16_t, float>>(isa)
                              : target::variant<ForwardLoop<uint16_t, uint16_t>>(isa);
}

CellBackwardFn cell_backward(DType dt, DType mul_dt, Isa isa) {
  if (dt == DType::f32) return target::variant<BackwardLoop<float, float>>(isa);
  return mul_dt == DType::f32 ? target::variant<BackwardLoop<uint16_t, float>>(isa)
                              : target::variant<BackwardLoop<uint16_t, uint16_t>>(isa);
}

CellTangentFn cell_tangent(DType dt, DType mul_dt, Isa isa) {
  if (dt == DType::f32) return target::variant<TangentLoop<float, float>>(isa);
  return mul_dt == DType::f32 ? target::variant<TangentLoop<uint16_t, float>>(isa)
                              : target::variant<TangentLoop<uint16_t, uint16_t>>(isa);
}

}  // namespace jb::lstm
