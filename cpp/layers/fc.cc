// The fully-connected layer's three passes: loops around the BRGEMM kernel, nothing else.
//
//   forward, backward  a work item re-blocks one weight panel (a K-block of w, or a C-block
//                      of w^T) into L2 and computes the output blocks of its group of
//                      N-blocks with it: one BRGEMM call each, batch-reducing over the
//                      blocks of the reduced dimension, epilogue (bias, activation) fused.
//   update             the transposed input and the blocked gradient are shared by all
//                      items, so a first parallel loop re-blocks them; then every
//                      (C-block, K-block) item owns its block of dw and reduces over the
//                      whole batch in one BRGEMM call.
//
// Kernels are built once per pass (a full block and its edge variants), outside the hot
// loop; scratch is allocated by the calling thread before any item runs.
#include "layers/fc.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "layers/eltwise.h"
#include "layers/reblock.h"

namespace jb::fc {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// ---------------------------------------------------------------------------------------
// Scratch: one growing buffer per calling thread, so the re-blocked operands of a training
// step reuse warm pages call after call instead of faulting in fresh ones each time.
// Helpers write into the caller's buffer; the caller outlives every item it hands out.

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};

class Scratch {
 public:
  // Carves `count` regions of the given byte sizes, each 64-byte aligned.
  template <size_t N>
  static std::array<char*, N> get(const std::array<size_t, N>& bytes) {
    thread_local std::unique_ptr<char, FreeDeleter> buf;
    thread_local size_t cap = 0;
    size_t total = 0;
    for (size_t b : bytes) total += (b + 63) / 64 * 64;
    if (total > cap) {
      buf.reset();
      cap = 0;
      char* p = static_cast<char*>(std::aligned_alloc(64, std::max<size_t>(total, 64)));
      if (!p) throw std::bad_alloc();
      buf.reset(p);
      cap = total;
    }
    std::array<char*, N> out;
    size_t off = 0;
    for (size_t i = 0; i < N; ++i) {
      out[i] = buf.get() + off;
      off += (bytes[i] + 63) / 64 * 64;
    }
    return out;
  }
};

// ---------------------------------------------------------------------------------------
// Element access: fp32 or bf16 storage, fp32 arithmetic.

template <class T>
inline float to_f32(T v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return bf16_to_f32(v);
}

// Calls f with a value of the storage type of `t` (float or uint16_t), to instantiate
// the templated loops for both dtypes.
template <class F>
void with_type(DType t, F&& f) {
  if (t == DType::f32) f(float{});
  else f(uint16_t{});
}

// Element `i` of a matrix of dtype t.
inline const void* at(const void* p, DType t, int64_t i) {
  return static_cast<const char*>(p) + i * int64_t(dtype_size(t));
}


// The A operand of the forward and backward, an activation matrix (rows x cols): read in
// place when the kernel can, else copied once (in row chunks, the work items of a parallel
// loop): widened from bf16 for fp32 multiplies, and with rows padded by a cache line when
// their stride is a multiple of 4 KiB (the rows of a register tile would all fall in one
// L1 set and evict each other).
class AOperand {
 public:
  AOperand(DType from, DType to, int64_t rows, int64_t cols)
      : from_(from), to_(to), rows_(rows), cols_(cols) {
    const int64_t es = int64_t(dtype_size(to));
    ld_ = cols * es % 4096 == 0 ? cols + 64 / es : cols;
    copy_ = from != to || ld_ != cols;
    chunk_ = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, cols));
  }
  bool copied() const { return copy_; }
  int64_t ld() const { return ld_; }
  size_t bytes() const { return copy_ ? size_t(rows_ * ld_) * dtype_size(to_) : 0; }
  int64_t items() const { return copy_ ? ceil_div(rows_, chunk_) : 0; }
  void run(int64_t i, const void* src, char* dst) const {
    const int64_t r1 = std::min(rows_, (i + 1) * chunk_);
    for (int64_t r = i * chunk_; r < r1; ++r) {
      const char* s = static_cast<const char*>(src) + r * cols_ * int64_t(dtype_size(from_));
      char* d = dst + r * ld_ * int64_t(dtype_size(to_));
      if (from_ == to_) {
        std::memcpy(d, s, size_t(cols_) * dtype_size(to_));
      } else {  // bf16 -> fp32
        const uint16_t* sh = reinterpret_cast<const uint16_t*>(s);
        float* df = reinterpret_cast<float*>(d);
        for (int64_t j = 0; j < cols_; ++j) df[j] = bf16_to_f32(sh[j]);
      }
    }
  }

 private:
  DType from_, to_;
  int64_t rows_, cols_, ld_, chunk_;
  bool copy_;
};

// Whether this CPU multiplies bf16 pairs (vdpbf16ps and friends) slower than it does fp32
// FMAs, measured once per ISA on an L1-resident problem with the kernel itself. On some
// AVX512-BF16 CPUs the bf16 dot product issues at half the FMA rate: bf16 operands are
// then better widened to fp32 (exact, and accumulation is fp32 either way).
bool bf16_dot_is_slower(Isa isa) {
  static std::atomic<int> cached[4] = {-1, -1, -1, -1};  // one per Isa (generic, avx2, avx512, amx)
  std::atomic<int>& slot = cached[int(isa)];
  const int known = slot.load(std::memory_order_relaxed);
  if (known >= 0) return known == 1;
  constexpr int64_t M = 12, N = 64, K = 128;
  std::vector<float> a(M * K, 0.5f), b(K * N, 0.25f), c(M * N);
  std::vector<uint16_t> a16(M * K, f32_to_bf16(0.5f)), b16(K * N, f32_to_bf16(0.25f));
  BrgemmDesc d;
  d.m = M;
  d.n = N;
  d.k = K;
  d.lda = K;
  d.ldc = N;
  d.ldb = N;
  const Brgemm f32(d, isa);
  d.ab = DType::bf16;
  d.ldb = 2 * N;
  const Brgemm b16k(d, isa);
  auto best = [&](const Brgemm& k, const void* pa, const void* pb) {
    double t = 1e30;
    for (int round = 0; round < 5; ++round) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int rep = 0; rep < 20; ++rep) k.strided(pa, 0, pb, 0, 1, c.data());
      t = std::min(t, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return t;
  };
  double tf = 1e30, tb = 1e30;
  for (int round = 0; round < 3; ++round) {  // interleaved: noise hits both alike
    tf = std::min(tf, best(f32, a.data(), b.data()));
    tb = std::min(tb, best(b16k, a16.data(), b16.data()));
  }
  const bool slower = tb > 1.15 * tf;
  slot.store(slower ? 1 : 0, std::memory_order_relaxed);
  return slower;
}

// Work items of the forward and backward: a weight panel (re-blocked by the item) and a
// group of consecutive N-blocks computed with it. One group per panel when there are
// enough panels to keep every thread busy; otherwise the N-blocks are split into as many
// groups as needed (each re-blocking its own copy of the small panel).
struct Groups {
  Groups(int64_t panels, int64_t nblocks, int64_t threads) : panels_(panels), nblocks_(nblocks) {
    const int64_t want = 4 * std::max<int64_t>(1, threads);
    groups_ = std::max<int64_t>(1, std::min(nblocks, ceil_div(want, panels)));
    per_ = ceil_div(nblocks, groups_);
    groups_ = ceil_div(nblocks, per_);
    concurrency = std::max<int64_t>(1, std::min(std::max<int64_t>(1, threads), items()));
  }
  int64_t items() const { return panels_ * groups_; }
  int64_t panel(int64_t i) const { return i / groups_; }  // panel-major: neighbours share it
  int64_t first(int64_t i) const { return i % groups_ * per_; }
  int64_t last(int64_t i) const { return std::min(nblocks_, first(i) + per_); }
  int64_t concurrency;  // items that can run at once: one panel buffer each

 private:
  int64_t panels_, nblocks_, groups_, per_;
};

// Panel buffers for the items running at once (at most one per thread): an item leases a
// free one for its duration. Carved from the caller's scratch up front, so no worker ever
// allocates (an exception there could not be reported).
class PanelPool {
 public:
  PanelPool(char* base, size_t bytes, int64_t count)
      : base_(base), bytes_((bytes + 63) / 64 * 64), busy_(size_t(count)) {}
  class Lease {
   public:
    explicit Lease(PanelPool& pool) : pool_(pool) {
      for (size_t i = 0;; i = (i + 1) % pool_.busy_.size()) {
        bool expected = false;
        if (pool_.busy_[i].compare_exchange_strong(expected, true, std::memory_order_acquire)) {
          slot_ = i;
          break;
        }
      }
      data = pool_.base_ + slot_ * pool_.bytes_;
    }
    ~Lease() { pool_.busy_[slot_].store(false, std::memory_order_release); }
    char* data;

   private:
    PanelPool& pool_;
    size_t slot_ = 0;
  };

 private:
  char* base_;
  size_t bytes_;
  std::vector<std::atomic<bool>> busy_;
};

// ---------------------------------------------------------------------------------------
// Kernels for a grid of m x n output blocks of bm x bn: the full block and its edge
// variants, built once before the parallel loop (the constructor may throw).

class BlockKernels {
 public:
  BlockKernels(BrgemmDesc d, int64_t m, int64_t n, int64_t bm, int64_t bn)
      : bm_(bm), bn_(bn) {
    const int64_t em = m % bm, en = n % bn;
    const Isa isa = best_isa();
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) {
        if ((i && !em) || (j && !en)) continue;
        d.m = i ? em : bm;
        d.n = j ? en : bn;
        k_[i][j].emplace(d, isa);
      }
  }
  const Brgemm& operator()(int64_t rows, int64_t cols) const {
    return *k_[rows != bm_][cols != bn_];
  }

 private:
  int64_t bm_, bn_;
  std::optional<Brgemm> k_[2][2];
};

// ---------------------------------------------------------------------------------------
// Blocking heuristics.

constexpr int64_t kRowQuantum = 12;  // a multiple of every ISA's register-tile height
constexpr int64_t kMaxRows = 96;
// Output block width. Weight panels are this wide: 512 contiguous bytes per fp32 row pack
// about 1.5x faster than 256 (measured); the update writes its dw in longer row pieces.
constexpr int64_t kCols = 128;
constexpr int64_t kItemsPerThread = 8;

// Rows per output block: whole register tiles, at most kMaxRows, and fine enough that
// the threads get kItemsPerThread items each when the other dimension has few blocks.
int64_t split_rows(int64_t m, int64_t col_blocks, int64_t threads) {
  if (m <= kRowQuantum) return m;
  int64_t nb = ceil_div(m, kMaxRows);
  int64_t rows = round_up(ceil_div(m, nb), kRowQuantum);
  while (rows > kRowQuantum && ceil_div(m, rows) * col_blocks < kItemsPerThread * threads) {
    ++nb;
    rows = round_up(ceil_div(m, nb), kRowQuantum);
  }
  return std::min(rows, m);
}

// A block of the reduced dimension that divides it (the kernel's batch elements must all
// be full); even sizes first for bf16 so VNNI pairs never straddle blocks. Falls back to
// the whole dimension (one batch element) when nothing in range divides it.
int64_t reduction_block(int64_t size, bool even) {
  constexpr int64_t kTarget = 256, kMin = 32;
  if (size <= kTarget) return size;
  for (int pass = even ? 0 : 1; pass < 2; ++pass)
    for (int64_t d = kTarget; d >= kMin; --d)
      if (size % d == 0 && (pass == 1 || d % 2 == 0)) return d;
  return size;
}

Blocking normalized(Blocking b, int64_t rows, int64_t cols) {
  b.rows = std::max<int64_t>(1, std::min(b.rows, rows));
  b.cols = std::max<int64_t>(1, std::min(b.cols, cols));
  return b;
}

}  // namespace

DType multiply_dtype(DType dt) {
  if (dt == DType::f32) return DType::f32;
  const char* env = std::getenv("JAX_BRGEMM_FC_BF16");
  const std::string mode = env ? env : "";
  if (mode == "dot") return DType::bf16;
  if (mode == "fp32") return DType::f32;
  if (!mode.empty() && mode != "auto")
    throw std::invalid_argument("JAX_BRGEMM_FC_BF16=" + mode + " is not one of auto, dot, fp32");
  return bf16_dot_is_slower(best_isa()) ? DType::f32 : DType::bf16;
}

Saved saved_for(Activation act) {
  switch (act) {
    case Activation::none: return Saved::none;
    case Activation::gelu: return Saved::preactivation;
    default: return Saved::output;
  }
}

// Forward (N x K output, reducing C) and backward (N x C output, reducing K) block alike.
static Blocking activation_blocking(const Shape& s, int64_t out_cols, int64_t reduced,
                                    int64_t threads) {
  Blocking b;
  b.cols = std::min(out_cols, kCols);
  // Too few rows to split: narrower panels, so that every thread still gets several items.
  if (s.n <= kRowQuantum && ceil_div(out_cols, b.cols) < kItemsPerThread * threads)
    b.cols = std::min(out_cols, kCols / 2);
  b.rows = split_rows(s.n, ceil_div(out_cols, b.cols), threads);
  b.red = reduction_block(reduced, multiply_dtype(s.dt) == DType::bf16);
  return b;
}

Blocking forward_blocking(const Shape& s, int64_t threads) {
  return activation_blocking(s, s.k, s.c, threads);
}

Blocking backward_blocking(const Shape& s, int64_t threads) {
  return activation_blocking(s, s.c, s.k, threads);
}

Blocking update_blocking(const Shape& s, int64_t threads) {
  Blocking b;
  b.cols = std::min(s.k, kCols);
  b.rows = split_rows(s.c, ceil_div(s.k, b.cols), threads);
  // The batch is padded with zeros to whole blocks (both operands are re-blocked), so the
  // block only needs to be even for bf16 VNNI pairs; as equal as possible otherwise.
  const int64_t nb = ceil_div(s.n, 64);
  b.red = round_up(ceil_div(s.n, nb), multiply_dtype(s.dt) == DType::bf16 ? 2 : 1);
  return b;
}

// ---------------------------------------------------------------------------------------
// The skeleton the forward and the backward share: an N x `out_cols` output reducing over
// `reduced`. The A operand is an activation matrix (N x reduced), read in place or copied
// once (AOperand). Work items are a weight panel of `cols` output columns, re-blocked by
// the item into a leased buffer (reduced / red blocks of red x cols), and the group of
// N-blocks computed with it.

namespace {

class PanelPass {
 public:
  PanelPass(const Executor& ex, const Shape& s, Blocking chosen, int64_t out_cols, int64_t reduced,
            const void* a_src, bool bias, Activation act)
      : b(fixed(chosen, s.n, out_cols, reduced)),
        kd(multiply_dtype(s.dt)),
        vnni(kd == DType::bf16),
        ks(dtype_size(kd)),
        blk(reblock::block_elems(b.red, b.cols, vnni)),
        n_(s.n),
        out_cols_(out_cols),
        rblk_(reduced / b.red),
        aop_(s.dt, kd, s.n, reduced),
        kernels_(desc(s.dt, out_cols, bias, act), s.n, out_cols, b.rows, b.cols),
        groups_(ceil_div(out_cols, b.cols), ceil_div(s.n, b.rows), ex.num_threads),
        panel_bytes_((size_t(rblk_ * blk) * ks + 63) / 64 * 64),
        buf_(Scratch::get<2>({aop_.bytes(), panel_bytes_ * size_t(groups_.concurrency)})),
        a_(aop_.copied() ? buf_[0] : static_cast<const char*>(a_src)),
        panels_(buf_[1], panel_bytes_, groups_.concurrency) {
    if (aop_.copied()) parallel_for(ex, aop_.items(), [&](int64_t i) { aop_.run(i, a_src, buf_[0]); });
  }

  // For every item: pack(c0, cols, r, dst) re-blocks reduction block r of the panel of output
  // columns [c0, c0 + cols) into dst; then tile(n0, rows, c0, cols, multiply) computes each
  // output block, where multiply(out, bias) is its BRGEMM call.
  template <class Pack, class Tile>
  void run(const Executor& ex, Pack&& pack, Tile&& tile) {
    parallel_for(ex, groups_.items(), [&](int64_t i) {
      const int64_t c0 = groups_.panel(i) * b.cols, cols = std::min(b.cols, out_cols_ - c0);
      const PanelPool::Lease panel(panels_);
      for (int64_t r = 0; r < rblk_; ++r) pack(c0, cols, r, panel.data + r * blk * ks);
      for (int64_t nb = groups_.first(i); nb < groups_.last(i); ++nb) {
        const int64_t n0 = nb * b.rows, rows = std::min(b.rows, n_ - n0);
        tile(n0, rows, c0, cols, [&](void* out, const float* bias) {
          kernels_(rows, cols).strided(a_ + n0 * aop_.ld() * ks, b.red, panel.data, blk, rblk_, out, bias);
        });
      }
    });
  }

  const Blocking b;  // the block of the reduced dimension divides it
  const DType kd;    // the multiply dtype
  const bool vnni;
  const size_t ks;    // bytes of a kd element
  const int64_t blk;  // elements of one re-blocked reduction block

 private:
  static Blocking fixed(Blocking b, int64_t n, int64_t out_cols, int64_t reduced) {
    b = normalized(b, n, out_cols);
    if (b.red <= 0 || reduced % b.red) b.red = reduced;
    return b;
  }
  BrgemmDesc desc(DType out_dt, int64_t out_cols, bool bias, Activation act) const {
    BrgemmDesc d;
    d.k = b.red;
    d.lda = aop_.ld();
    d.ldb = vnni ? 2 * b.cols : b.cols;
    d.ldc = out_cols;
    d.ab = kd;
    d.c = out_dt;
    d.bias = bias;
    d.act = act;
    return d;
  }

  const int64_t n_, out_cols_, rblk_;
  const AOperand aop_;
  const BlockKernels kernels_;
  const Groups groups_;
  const size_t panel_bytes_;
  const std::array<char*, 2> buf_;
  const char* const a_;
  PanelPool panels_;
};

}  // namespace

// ---------------------------------------------------------------------------------------
// Forward: y[n, k] = act(sum_c x[n, c] w[c, k] + b[k]).
// Work items: a K-block of the weights (the paper's [Kb][Cb][bc][bk] panel, VNNI pairs for
// bf16, cast on the way) re-blocked into L2 by the item itself, then every (N-block,
// K-block) output tile of its group of N-blocks: one BRGEMM over the C-blocks each, bias and
// activation in the epilogue. x is the A operand, in place (lda = C) unless AOperand copies
// it. Re-blocking inside the item keeps the panel in cache for its reuse across the
// N-blocks instead of a separate pass through memory.

void forward(const Executor& ex, const Shape& s, const void* x, const void* w, DType w_dt,
             const float* bias, void* y, void* z, const Blocking* force) {
  if (s.n <= 0 || s.k <= 0) return;
  const bool gelu = s.act == Activation::gelu;
  PanelPass pass(ex, s, force ? *force : forward_blocking(s, ex.num_threads), s.k, s.c, x,
                 bias != nullptr, gelu ? Activation::none : s.act);
  const Blocking& b = pass.b;
  const size_t es = dtype_size(s.dt);
  char* out = static_cast<char*>(gelu ? z : y);
  pass.run(
      ex,
      [&](int64_t k0, int64_t cols, int64_t cb, char* dst) {
        reblock::pack(at(w, w_dt, cb * b.red * s.k + k0), w_dt, s.k, false, b.red, cols, b.red,
                      b.cols, pass.kd, pass.vnni, dst);
      },
      [&](int64_t n0, int64_t rows, int64_t k0, int64_t cols, auto&& multiply) {
        multiply(out + (n0 * s.k + k0) * es, bias ? bias + k0 : nullptr);
        if (gelu)  // the tile is still in L1: y = gelu(z) costs no memory traffic
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t off = (n0 + r) * s.k + k0;
            eltwise::activate(Activation::gelu, s.dt, at(z, s.dt, off), static_cast<char*>(y) + off * es, cols);
          }
      });
}

// ---------------------------------------------------------------------------------------
// dz = dy * act'(saved): element-wise, in chunks.

void act_grad(const Executor& ex, const Shape& s, const void* dy, const void* saved, void* dz) {
  const int64_t total = s.n * s.k;
  if (total <= 0) return;
  const int64_t chunk = std::max<int64_t>(4096, ceil_div(total, 8 * ex.num_threads));
  const int64_t es = int64_t(dtype_size(s.dt));
  parallel_for(ex, ceil_div(total, chunk), [&](int64_t i) {
    const int64_t a = i * chunk, count = std::min(chunk, total - a);
    eltwise::act_grad(s.act, s.dt, at(dy, s.dt, a), saved ? at(saved, s.dt, a) : nullptr,
                      static_cast<char*>(dz) + a * es, count);
  });
}

// ---------------------------------------------------------------------------------------
// Backward by data: dx[n, c] = sum_k dz[n, k] w[c, k].
// The forward's skeleton with the roles of C and K swapped: an item re-blocks a C-block of
// w transposed ([Cb][Kb][bk][bc], VNNI pairs of k) and computes the (N-block, C-block) tiles
// of dx of its group, batch-reducing over the K-blocks. dz is the A operand (see AOperand).

void backward(const Executor& ex, const Shape& s, const void* dz, const void* w, DType w_dt,
              void* dx, const Blocking* force) {
  if (s.n <= 0 || s.c <= 0) return;
  PanelPass pass(ex, s, force ? *force : backward_blocking(s, ex.num_threads), s.c, s.k, dz,
                 false, Activation::none);
  const Blocking& b = pass.b;
  const size_t es = dtype_size(s.dt);
  pass.run(
      ex,
      [&](int64_t c0, int64_t cols, int64_t kb, char* dst) {
        reblock::pack(at(w, w_dt, c0 * s.k + kb * b.red), w_dt, s.k, true, b.red, cols, b.red,
                      b.cols, pass.kd, pass.vnni, dst);
      },
      [&](int64_t n0, int64_t, int64_t c0, int64_t, auto&& multiply) {
        multiply(static_cast<char*>(dx) + (n0 * s.c + c0) * es, nullptr);
      });
}

// ---------------------------------------------------------------------------------------
// Weight update: dw[c, k] = sum_n x[n, c] dz[n, k], db[k] = sum_n dz[n, k].
// Items: (C-block, K-block) tiles of dw, each owned by one item, so the reduction over the
// batch happens inside one BRGEMM call (batch: the N-blocks) and needs no synchronization.
// x is transposed to [Cb][Nb][bc][bn] (A blocks), dz re-blocked to [Kb][Nb][bn][bk] (VNNI
// pairs of n for bf16); both zero-padded to whole N-blocks. db is summed while dz is
// re-blocked, by the item that owns the K-block.

void update(const Executor& ex, const Shape& s, const void* x, const void* dz, void* dw,
            DType dw_dt, float* db, const Blocking* force) {
  if (s.c <= 0 || s.k <= 0) return;
  if (s.n <= 0) {  // an empty batch: zero gradients
    std::memset(dw, 0, size_t(s.c * s.k) * dtype_size(dw_dt));
    if (db) std::memset(db, 0, size_t(s.k) * sizeof(float));
    return;
  }
  Blocking b = normalized(force ? *force : update_blocking(s, ex.num_threads), s.c, s.k);
  const DType kd = multiply_dtype(s.dt);
  const bool vnni = kd == DType::bf16;
  if (b.red <= 0) b.red = s.n;
  if (vnni) b.red = round_up(b.red, 2);
  const size_t ks = dtype_size(kd);
  const int64_t cblk = ceil_div(s.c, b.rows), kblk = ceil_div(s.k, b.cols);
  const int64_t nblk = ceil_div(s.n, b.red);
  const int64_t blk_a = b.rows * b.red, blk_b = reblock::block_elems(b.red, b.cols, vnni);

  // dw is stored straight from the register tiles, with plain stores: inside a training
  // step the optimizer reads it next, from cache. (Non-temporal stores measured 1.4-2.5x
  // slower there: the optimizer then reads dw back from memory.)
  const size_t ws = dtype_size(dw_dt);
  BrgemmDesc d;
  d.k = b.red;
  d.lda = b.red;
  d.ldb = vnni ? 2 * b.cols : b.cols;
  d.ldc = s.k;
  d.ab = kd;
  d.c = dw_dt;
  const BlockKernels kernels(d, s.c, s.k, b.rows, b.cols);

  const auto buf = Scratch::get<2>({size_t(cblk * nblk * blk_a) * ks, size_t(kblk * nblk * blk_b) * ks});
  char* xt = buf[0];
  char* dzb = buf[1];
  parallel_for(ex, cblk * nblk + kblk, [&](int64_t i) {
    if (i < cblk * nblk) {  // x^T block (cb, nb)
      const int64_t cb = i / nblk, nb = i % nblk;
      const int64_t c0 = cb * b.rows, n0 = nb * b.red;
      reblock::pack(at(x, s.dt, n0 * s.c + c0), s.dt, s.c, true, std::min(b.rows, s.c - c0),
                    std::min(b.red, s.n - n0), b.rows, b.red, kd, false, xt + i * blk_a * ks);
      return;
    }
    const int64_t kb = i - cblk * nblk, k0 = kb * b.cols;  // dz column panel kb
    const int64_t cols = std::min(b.cols, s.k - k0);
    for (int64_t nb = 0; nb < nblk; ++nb) {
      const int64_t n0 = nb * b.red;
      reblock::pack(at(dz, s.dt, n0 * s.k + k0), s.dt, s.k, false, std::min(b.red, s.n - n0), cols,
                    b.red, b.cols, kd, vnni, dzb + (kb * nblk + nb) * blk_b * ks);
    }
    if (db)
      with_type(s.dt, [&](auto ts) {
        using T = decltype(ts);
        constexpr int64_t kChunk = 64;  // columns summed at once, on the stack: no allocation
        for (int64_t j0 = 0; j0 < cols; j0 += kChunk) {
          const int64_t width = std::min(kChunk, cols - j0);
          const T* src = static_cast<const T*>(dz) + k0 + j0;
          float acc[kChunk] = {};
          for (int64_t n = 0; n < s.n; ++n)
            for (int64_t j = 0; j < width; ++j) acc[j] += to_f32(src[n * s.k + j]);
          std::memcpy(db + k0 + j0, acc, size_t(width) * sizeof(float));
        }
      });
  });

  parallel_for(ex, cblk * kblk, [&](int64_t i) {
    const int64_t cb = i / kblk, kb = i % kblk;  // C-block major: an x^T panel is reused
    const int64_t c0 = cb * b.rows, k0 = kb * b.cols;
    const int64_t rows = std::min(b.rows, s.c - c0), cols = std::min(b.cols, s.k - k0);
    kernels(rows, cols).strided(xt + cb * nblk * blk_a * ks, blk_a, dzb + kb * nblk * blk_b * ks,
                                blk_b, nblk, static_cast<char*>(dw) + (c0 * s.k + k0) * ws);
  });
}

}  // namespace jb::fc
