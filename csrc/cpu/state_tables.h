// The 8-bit format's maps as the CPU kernels use them (math/state_format.h defines them): the values
// for reading codes back, and a bucket table that finds the nearest code without a search.
//
// Note [Quantisation by buckets]
// quantize_code (state_format.h) counts the thresholds below y with a binary search: eight dependent
// loads, which the GPU hides and a CPU loop cannot. Positive floats order like their bit patterns, so
// the CPU kernels key |y| by its top 16 bits (sign, exponent, 7 mantissa bits): every key's range of
// floats holds at most one threshold of either map (checked when the table is built), so a bucket
// entry holding the number of thresholds below its range and the low 16 bits of the threshold inside it
// (0xFFFF: none) gives the count with one load and one compare. The negative half of the signed map
// mirrors the positive half, so the count of |y| serves both signs (ties toward zero, as quantize_code;
// a negative y is the unsigned map's 0).
// The table is built from quantize_code's own thresholds, and the build checks that both give the same
// code at and next to every threshold, where they could differ.
#pragma once

#include <cstdint>
#include <vector>

#include "../math/state_format.h"

namespace distopt {

struct QuantTable {
  bool is_signed;
  float values[kCodes];      // the map
  float thresholds[kCodes];  // quantize_code's: [k] between codes k and k + 1, [255] = +inf
  uint32_t key_min;          // keys (bits >> 16 of |y|) up to it hold no threshold: bucket 0
  uint32_t key_max;          // the key of 1.0 and above: the last bucket (every threshold below)
  std::vector<uint32_t> buckets;  // [key - key_min]: (thresholds below the key's floats) << 16 | the
                                  // low 16 bits of the threshold among them (0xFFFF: none)
  alignas(64) uint8_t value_bytes[4][kCodes];  // byte k of each map value's bits: the map as byte tables
};

// The two maps' tables, built (and checked) once: thread-safe static initialisation.
const QuantTable& quant_table(bool is_signed);

// The nearest code to y (Note [Quantisation by buckets]): quantize_code(y, t.thresholds, signed).
// Branch-free, so a loop of it vectorises (the bucket load becomes a gather).
inline uint8_t quantize_by_buckets(float y, const uint32_t* __restrict buckets, uint32_t key_min, uint32_t key_max,
                                   bool is_signed) {
  const uint32_t u = float_bits(y);
  const uint32_t a = u & 0x7fffffffu;
  uint32_t key = a >> 16;
  key = key < key_min ? key_min : key;
  key = key > key_max ? key_max : key;
  const uint32_t e = buckets[key - key_min];
  const uint32_t below = (e >> 16) + ((a & 0xffffu) > (e & 0xffffu) ? 1u : 0u);
  const bool negative = (u >> 31) != 0;
  const uint32_t neg = 127u - (below < 127u ? below : 127u);
  const uint32_t code = is_signed ? (negative ? neg : 127u + below) : (negative ? 0u : below);
  const bool nan = a > 0x7f800000u;
  return static_cast<uint8_t>(nan ? static_cast<uint32_t>(zero_code(is_signed)) : code);
}

}  // namespace distopt
