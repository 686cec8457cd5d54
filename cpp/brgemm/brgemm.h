// The batch-reduce GEMM: the one building block of every layer in jax_brgemm.
//
//   C = act(beta * C + sum_i A_i @ B_i + bias)
//
// A_i is m x k (row-major, leading dimension lda), B_i is k x n (ldb), C is m x n (ldc).
// The accumulators for a register tile of C stay in registers across the whole batch and
// the whole k loop; they are loaded and stored once. The kernel is chosen once from the
// descriptor (ISA, dtypes, register-tile table) and then called in the hot loop.
//
// bf16 operands: A_i is plain row-major bf16. B_i must be VNNI-2 packed: pairs of
// consecutive k rows interleaved, element (k, j) at b[(k / 2) * ldb + 2 * j + k % 2], with
// ldb >= 2 * n; when k is odd the pad element of the last pair must be zero (pack_vnni2
// does this). Accumulation is always fp32.
#pragma once

#include <cstddef>
#include <cstdint>

namespace jb {

enum class DType : uint8_t { f32, bf16 };
// avx512 = F/BW/VL/DQ + BF16; amx = avx512 + AMX-BF16 tiles (used for bf16 operands).
enum class Isa : uint8_t { generic, avx2, avx512, amx };
enum class Activation : uint8_t { none, relu, gelu, sigmoid, tanh };
// The activations by name, for the Python side (exported by cpp/ffi/module.cc): the one
// place that maps names to codes.
struct ActivationName {
  const char* name;
  Activation act;
};
inline constexpr ActivationName kActivationNames[] = {
    {"none", Activation::none}, {"relu", Activation::relu}, {"gelu", Activation::gelu},
    {"sigmoid", Activation::sigmoid}, {"tanh", Activation::tanh}};

const char* isa_name(Isa isa);

// Every choice that changes numerics or speed by CPU, decided once per process
// (deterministically: CPUID and environment overrides, never a timing), then passed down.
struct Dispatch {
  Isa isa = Isa::generic;
  // The dtype the layers multiply bf16 operands in (accumulation is fp32 either way):
  // bf16 where the CPU's bf16 dot product is at least as fast as its fp32 FMA (AMX tiles;
  // vdpbf16ps on AMD Zen 4), else fp32: bf16 widened exactly (Intel's vdpbf16ps issues at
  // half the FMA rate; AVX2 and the portable path widen anyway).
  DType bf16_multiply = DType::f32;
  // Whether FFI handlers may return before their work is done (JAX_BRGEMM_ASYNC=0: never).
  // Not a numerics choice: the same blocks and kernels run either way.
  bool async_calls = true;
};

// The process's dispatch: the best ISA this CPU supports, lowered by
// JAX_BRGEMM_ISA=amx|avx512|avx2|generic, and the bf16 multiply path, forced by
// JAX_BRGEMM_BF16=dot|fp32 ("auto" or unset: the rule above). Read on first use (the
// extension calls it at import); throws std::invalid_argument for a bad value, every time.
const Dispatch& dispatch();
inline Isa best_isa() { return dispatch().isa; }
// The rule above for a given ISA and override ("", "auto", "dot", "fp32"), for tests.
Dispatch make_dispatch(Isa isa, const char* bf16_override);

// Where the kernel finds matrix i of one operand of the batch: addr[i] (address kind), or
// base + (offs ? offs[i] : i) * scale bytes (offset kinds: scale = element size; stride
// kind: scale = stride in bytes), plus a constant shift in bytes. The kernel walks it
// itself: no per-call address arrays.
struct BatchWalk {
  const void* const* addr = nullptr;
  const char* base = nullptr;
  const int64_t* offs = nullptr;
  int64_t scale = 0;
  int64_t shift = 0;
  const char* at(int64_t i) const {
    return (addr ? static_cast<const char*>(addr[i]) : base + (offs ? offs[i] : i) * scale) + shift;
  }
  // The walk that starts at matrix i.
  BatchWalk from(int64_t i) const {
    BatchWalk w = *this;
    if (addr) w.addr += i;
    else if (offs) w.offs += i;
    else w.base += i * scale;
    return w;
  }
};

struct BrgemmDesc {
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;  // in elements
  DType ab = DType::f32;              // dtype of A and B
  DType c = DType::f32;               // dtype of C
  bool accumulate = false;            // beta = 1 (true) or 0 (false)
  bool bias = false;                  // add an fp32 bias of n values (per column)
  Activation act = Activation::none;  // applied last, on the fp32 tile
  // Static-offsets batch kind (Brgemm::static_offsets): a fixed table of `batch` element
  // offsets per operand, built once by a layer's plan, which owns it for as long as the
  // kernel is used. Null for the other kinds, which take their batch per call.
  const int64_t* static_offs_a = nullptr;
  const int64_t* static_offs_b = nullptr;
  int64_t static_batch = 0;
};

// Executes one whole C block.
using BrgemmFn = void (*)(const BrgemmDesc& d, const BatchWalk& a, const BatchWalk& b,
                          int64_t batch, void* c, const float* bias);

class Brgemm {
 public:
  // Throws std::invalid_argument for sizes or leading dimensions that make no sense.
  explicit Brgemm(const BrgemmDesc& desc, Isa isa = best_isa());
  // Runs fn in place of the ISA's kernel (the tests run the AMX driver on a tile model).
  Brgemm(const BrgemmDesc& desc, Isa isa, BrgemmFn fn);

  // Address-based batch: A_i = a[i], B_i = b[i].
  void addresses(const void* const* a, const void* const* b, int64_t batch, void* c,
                 const float* bias = nullptr) const {
    fn_(desc_, BatchWalk{a}, BatchWalk{b}, batch, c, bias);
  }
  // Stride-based batch: A_i = a + i * stride_a, B_i = b + i * stride_b (elements).
  void strided(const void* a, int64_t stride_a, const void* b, int64_t stride_b,
               int64_t batch, void* c, const float* bias = nullptr) const {
    fn_(desc_, walk(a, nullptr, stride_a), walk(b, nullptr, stride_b), batch, c, bias);
  }
  // Offset-based batch: A_i = a + offs_a[i], B_i = b + offs_b[i] (elements).
  void offsets(const void* a, const int64_t* offs_a, const void* b, const int64_t* offs_b,
               int64_t batch, void* c, const float* bias = nullptr) const {
    fn_(desc_, walk(a, offs_a, 1), walk(b, offs_b, 1), batch, c, bias);
  }
  // Static-offsets batch: the descriptor's own offset tables.
  void static_offsets(const void* a, const void* b, void* c, const float* bias = nullptr) const {
    offsets(a, desc_.static_offs_a, b, desc_.static_offs_b, desc_.static_batch, c, bias);
  }

  const BrgemmDesc& desc() const { return desc_; }
  Isa isa() const { return isa_; }

 private:
  BatchWalk walk(const void* base, const int64_t* offs, int64_t unit) const {
    BatchWalk w;
    w.base = static_cast<const char*>(base);
    w.offs = offs;
    w.scale = unit * int64_t(desc_.ab == DType::f32 ? 4 : 2);
    return w;
  }
  BrgemmDesc desc_;
  Isa isa_;
  BrgemmFn fn_;
};

// Packs a row-major bf16 k x n matrix (leading dimension ld) into the VNNI-2 layout above
// with ldb = 2 * n, zero-padding the last pair when k is odd. dst holds
// ((k + 1) / 2) * 2 * n values.
void pack_vnni2(const uint16_t* src, int64_t k, int64_t n, int64_t ld, uint16_t* dst,
                Isa isa = best_isa());

static inline size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }

// bf16 <-> fp32, round to nearest even, NaN stays NaN. Static: every ISA unit compiles
// its own copy with its own flags, so the linker cannot hand an AVX-512 build of these to
// the portable path.
static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// fp32 or bf16 (uint16_t) element <-> fp32, for loops templated on the storage type.
template <class T>
static inline float to_f32(T v) {
  if constexpr (sizeof(T) == 4) return v;
  else return bf16_to_f32(v);
}
template <class T>
static inline T from_f32(float v) {
  if constexpr (sizeof(T) == 4) return v;
  else return f32_to_bf16(v);
}

namespace detail {
// One entry point per ISA translation unit.
BrgemmFn brgemm_generic();
BrgemmFn brgemm_avx2();
BrgemmFn brgemm_avx512();
BrgemmFn brgemm_amx_bf16();
void pack_vnni2_avx512(const uint16_t* src, int64_t k, int64_t n, int64_t ld, uint16_t* dst);
}  // namespace detail

}  // namespace jb
