// jax.random.bernoulli's keep-masks, bit for bit, on the cores: threefry2x32 as JAX draws it
// with jax_threefry_partitionable (element i of a row-major array hashes the counter
// (i >> 32, i & 0xffffffff) under the key; its 32 random bits are the two output words
// xor'ed), then uniform's 23 mantissa bits against p. XLA's CPU lowering of the same hash
// runs its rounds as a loop over whole arrays, ~8 ns per element on one core.
#pragma once

#include <cstdint>

#include "brgemm/brgemm.h"

namespace jb::random {

// threefry2x32 (20 rounds) of the counter (hi, lo) under the key (k0, k1): the two words.
void threefry2x32(uint32_t k0, uint32_t k1, uint32_t hi, uint32_t lo, uint32_t out[2]);

// Element i is kept when (bits_i >> 9) < threshold: uniform_i = (bits_i >> 9) * 2^-23 < p.
uint32_t threshold_of(float p);

// keep[i] (0 or 1 bytes) for i in [i0, i0 + n).
void bernoulli_bytes(uint32_t k0, uint32_t k1, uint32_t threshold, int64_t i0, int64_t n, uint8_t* keep, Isa isa);

// Rows [r0, r0 + rows) of a row-major (..., cols) mask as bits: bit j % 8 of byte j / 8 of a
// row of ceil(cols / 8) bytes (jnp.packbits' little order), 0 past cols.
void bernoulli_bits(uint32_t k0, uint32_t k1, uint32_t threshold, int64_t cols, int64_t r0, int64_t rows,
                    uint8_t* bits, Isa isa);

}  // namespace jb::random
