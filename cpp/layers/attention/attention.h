// Scaled dot-product attention as loops around the batch-reduce GEMM (flash-style):
//
//   forward   per query block and key chunk: S = Q K^T, x = scale * S + bias (masked -> a
//             large negative), online softmax (running row max m and sum l, fp32),
//             O += Z V with Z = P * D (D: the dropout's keep / keep_prob, 1 without it);
//             O / l at the end. The T x S matrix is never stored: a block keeps a rows x
//             chunk tile, and saves (m, l) per row for the backward.
//   backward  per query block and key chunk, P recomputed from (m, l):
//             dZ = dO V^T, dS = P * (dZ * D - rowsum(dO * O)) (0 where masked),
//             dQ += scale dS K, dK += scale dS^T Q, dV += Z^T dO. (rowsum(dO * O) is
//             rowsum(P * dZ * D) with dropout too: O's row is Z's row times V.)
//
// Layouts are jax.nn.dot_product_attention's: q, o (T, N, H) and k, v (S, K, H) per item,
// K key/value heads shared by N / K query heads each (grouped-query attention). Work items
// are (item, kv head) panels: a panel's K and V are re-blocked once into the layouts the
// kernel reads and its query blocks (every head of the group) run against them; panels are
// split into groups of query blocks only when there are too few to keep the threads busy.
// The backward computes dQ, dK and dV in one pass per panel, so P and dP are recomputed
// once, and dK, dV are owned by their panel (split panels sum their parts afterwards).
//
// dtype `dt` (fp32 or bf16) is that of q, k, v, o, dO and the gradients; bf16 operands are
// multiplied in the dispatch's bf16 multiply dtype with fp32 accumulation; the softmax and
// every statistic are fp32. fp32 operands may ask for their products to be emulated from
// bf16 ones (Shape::products).
#pragma once

#include <cstdint>

#include "brgemm/brgemm.h"
#include "parallel/job.h"
#include "parallel/parallel_for.h"

namespace jb::attention {

struct Shape {
  int64_t items = 0;       // batch (and any vmapped dims), folded
  int64_t t = 0, s = 0;    // query and key lengths
  int64_t heads = 0;       // N, query heads
  int64_t kv_heads = 0;    // K, dividing N
  int64_t h = 0;           // head dim
  DType dt = DType::f32;
  float scale = 1.0f;
  bool causal = false;  // query i attends to keys j <= i (jax's tril mask)
  // fp32 only: every product from this many bf16 products of the operands' parts (1, 3 or
  // 6: layers/common/emulation.h; P and dS are split where they are made), 0: exact.
  int64_t products = 0;
};

// An optional operand broadcast to (items, N, T, S): element (item, n, i, j) at
// data + offs[item] + n * sn + i * st + j * ss (elements; a stride is 0 where the operand
// has size 1). Null data: absent.
struct Broadcast {
  const void* data = nullptr;
  const int64_t* offs = nullptr;
  int64_t sn = 0, st = 0, ss = 0;
};

// The inputs of both passes. q and o (items, T, N, H), k and v (items, S, K, H): element
// offsets of each item's first element (operands may be broadcast over items). bias is fp32,
// mask one byte per element (non-zero: attend). keep, the dropout's, is bits: key j of a row
// is bit j % 8 of the row's byte j / 8 (set: kept, its weight times keep_scale = 1 /
// keep_prob; clear: dropped), rows ceil(S / 8) bytes long; its strides count bytes and ss is
// unused.
struct Inputs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const int64_t* q_offs = nullptr;
  const int64_t* k_offs = nullptr;
  const int64_t* v_offs = nullptr;
  Broadcast bias, mask, keep;
  float keep_scale = 1.0f;
};

// What the forward saves for the backward, and the backward's extra inputs (dt, or fp32 for
// the statistics; offsets like Inputs').
struct Saved {
  const void* o = nullptr;
  const void* dout = nullptr;
  const float* stats = nullptr;  // (items, N, T, 2): the row max m and sum l
  const int64_t* o_offs = nullptr;
  const int64_t* dout_offs = nullptr;
  const int64_t* stats_offs = nullptr;
};

// The tangents of the inputs (forward mode), as an Inputs: tq, tk, tv in q, k, v (offsets per
// item), tbias in bias (the bias's strides, its own offsets; no data: none); mask and keep
// unread.
using Tangents = Inputs;

// The block sizes: query rows per block and keys per chunk (a multiple of 32, clamped).
// Tests force small ones to run the online softmax over many chunks and edge blocks.
struct Blocks {
  int64_t rows = 0, keys = 0;
};

// The logits of masked-out keys: jax's large negative (-0.7 x the largest float), so that a
// fully masked row has uniform weights over every key, as in jax.
inline constexpr float kMasked = -0.7f * 3.40282347e38f;

// Each pass is also a Job (parallel/job.h) for `threads` workers, which the FFI handlers
// run asynchronously: same blocks, same bits. Its operands (and the offset arrays Inputs
// and Saved point to) must outlive the job.

// o (items, T, N, H) in dt and stats (items, N, T, 2) fp32, both dense.
Job forward_job(int64_t threads, const Dispatch& dp, const Shape& s, const Inputs& in, void* o, float* stats,
                const Blocks* force = nullptr);
void forward(const Executor& ex, const Dispatch& dp, const Shape& s, const Inputs& in, void* o,
             float* stats, const Blocks* force = nullptr);

// dq (items, T, N, H), dk and dv (items, S, K, H) in dt, dense; dbias (items, N, T, S) fp32
// when not null: dS before the scale, i.e. the gradient of a bias of that full shape.
Job backward_job(int64_t threads, const Dispatch& dp, const Shape& s, const Inputs& in, const Saved& saved,
                 void* dq, void* dk, void* dv, float* dbias, const Blocks* force = nullptr);
void backward(const Executor& ex, const Dispatch& dp, const Shape& s, const Inputs& in,
              const Saved& saved, void* dq, void* dk, void* dv, float* dbias,
              const Blocks* force = nullptr);

// The forward-mode tangent of o, to (items, T, N, H) in dt, dense, from the forward's o and
// stats (Saved; dout unread): per query block and key chunk, tS = scale (tQ K^T + Q tK^T) +
// tbias and P from the statistics; to = Z tV + (Z * tS) V - c * O with Z = P * D and c the
// row's sum of P * tS (O = Z V, so the softmax's tangent P * (tS - c) needs no second sweep).
// Products are exact (Shape::products must be 0).
Job tangent_job(int64_t threads, const Dispatch& dp, const Shape& s, const Inputs& in, const Saved& saved,
                const Tangents& tin, void* to, const Blocks* force = nullptr);
void tangent(const Executor& ex, const Dispatch& dp, const Shape& s, const Inputs& in, const Saved& saved,
             const Tangents& tin, void* to, const Blocks* force = nullptr);

}  // namespace jb::attention
