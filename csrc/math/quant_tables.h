// The 8-bit format's maps as the kernels use them (math/state_format.h defines them): the values, to
// read codes back, and a bucket table that finds the nearest code without a search. Both are constant
// expressions built when the kernels are compiled: the CPU kernels and the CUDA kernels (whose copy
// lives in device memory, and each block's in shared memory) read the same data.
//
// Note [Quantisation by buckets]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// quantize_code (state_format.h) counts the thresholds below y with a binary search: eight dependent
// loads, which a CPU loop cannot hide and which on a GPU fall into one shared-memory bank for most
// steps. Positive floats order like their bit patterns, so |y| is keyed by its top 16 bits (exponent
// and 7 mantissa bits): every key's range of floats holds at most one threshold of either map (checked
// below), so one entry per key gives the count with one load and one add. For key k the entry is
//
//     ((zero code + thresholds below k's floats) << 16) + (0xFFFF - low 16 bits of the threshold
//     inside k's floats, or 0 when there is none) - (k << 16)                           (mod 2^32)
//
// and for |y|'s bits a (key a >> 16), (a + entry) >> 16 = zero code + thresholds below + 1 if a's low
// 16 bits exceed the threshold's: the add's carry out of bit 15 is the comparison. That is the code of
// |y| in the map's upper half; the signed map's lower half mirrors it (254 - that code, at least 0),
// and a negative y is the unsigned map's 0. Keys below key_min hold no threshold and the key of 1.0
// holds all of them, so a clamps into [key_min << 16, kBucketKeyMax << 16]; a block's y = x * (1 /
// absmax) with a finite absmax and inverse is at most 1 + 2^-22 and never NaN, so it needs only the
// lower clamp (quantize_ordinary). Ties go toward zero as in quantize_code (a threshold equal to |y| is not below).
//
// The tables are checked against quantize_code at, just below and just above every threshold (both
// signs) and at the edges, the only places where two exact ways of counting could disagree: static
// assertions, so every compiler that builds the tables proves them (tests/tooling/test_hot_loops.py also
// compares the GPU's copy in the compiled kernels with the host's).
#pragma once

#include <cmath>
#include <cstdint>

#include "state_format.h"

namespace distopt {

constexpr uint32_t kBucketKeyMax = 0x3f80u;  // 1.0f's key: 1.0 and above are past every threshold

// The key below the map's first positive threshold: it and every key below hold no threshold.
constexpr uint32_t bucket_key_min(bool is_signed) {
  return (float_bits_constexpr(dynamic_map_threshold(is_signed, zero_code(is_signed))) >> 16) - 1;
}

template <bool kSigned>
struct QuantMap {
  static constexpr bool kIsSigned = kSigned;
  static constexpr uint32_t kKeyMin = bucket_key_min(kSigned);
  static constexpr int kBuckets = static_cast<int>(kBucketKeyMax - kKeyMin) + 1;
  static constexpr int kBucketWords = (kBuckets + 3) / 4 * 4;  // whole 16-byte packs (copied as such)
  alignas(16) float values[kCodes];                 // the map: dynamic_map_value
  alignas(16) uint32_t buckets[kBucketWords];       // [key - kKeyMin], Note [Quantisation by buckets]
  bool well_formed;  // every key holds at most one threshold, and every threshold has a key
};

template <bool kSigned>
constexpr QuantMap<kSigned> make_quant_map() {
  QuantMap<kSigned> t{};
  for (int c = 0; c < kCodes; ++c) t.values[c] = dynamic_map_value(kSigned, c);
  const int zero = zero_code(kSigned);
  const int positive_thresholds = kCodes - 1 - zero;  // thresholds [zero, 254]
  int below = 0;
  t.well_formed = true;
  for (uint32_t key = QuantMap<kSigned>::kKeyMin; key <= kBucketKeyMax; ++key) {
    uint32_t low_complement = 0;
    int inside = 0;
    while (below + inside < positive_thresholds) {
      const uint32_t bits = float_bits_constexpr(dynamic_map_threshold(kSigned, zero + below + inside));
      if ((bits >> 16) != key) break;
      low_complement = 0xffffu - (bits & 0xffffu);
      ++inside;
    }
    t.well_formed = t.well_formed && inside <= 1;
    t.buckets[key - QuantMap<kSigned>::kKeyMin] =
        (static_cast<uint32_t>(zero + below) << 16) + low_complement - (key << 16);
    below += inside;
  }
  t.well_formed = t.well_formed && below == positive_thresholds;
  return t;
}

// The map's code for |y|'s bits a, already clamped into [key_min << 16, kBucketKeyMax << 16].
DISTOPT_HD constexpr uint32_t bucket_code(uint32_t a, const uint32_t* buckets, uint32_t key_min) {
  return (a + buckets[(a >> 16) - key_min]) >> 16;
}

// The code of y from the code c of |y|: the signed map mirrors its upper half, the unsigned one stores
// negatives as its 0.
DISTOPT_HD constexpr uint32_t signed_code(uint32_t c, bool negative, bool is_signed) {
  if (!is_signed) return negative ? 0u : c;
  const int mirrored = 254 - static_cast<int>(c);  // c <= 255
  return negative ? static_cast<uint32_t>(mirrored > 0 ? mirrored : 0) : c;
}

// The code of y from a = |y|'s bits, at least key_min << 16 and with a key at most kBucketKeyMax.
DISTOPT_HD constexpr uint32_t clamped_code(uint32_t a, bool negative, const uint32_t* buckets, uint32_t key_min,
                                           bool is_signed) {
  return signed_code(bucket_code(a, buckets, key_min), negative, is_signed);
}

// quantize_code(y, the map's thresholds, is_signed) for any y (NaN: the map's 0).
DISTOPT_HD constexpr uint32_t quantize_by_buckets(float y, const uint32_t* buckets, uint32_t key_min,
                                                  bool is_signed) {
  const uint32_t u = float_bits_constexpr(y);
  uint32_t a = u & 0x7fffffffu;
  const bool nan = a > 0x7f800000u;
  a = a < (key_min << 16) ? key_min << 16 : a;
  a = a > (kBucketKeyMax << 16) ? kBucketKeyMax << 16 : a;
  const uint32_t code = clamped_code(a, (u >> 31) != 0, buckets, key_min, is_signed);
  return nan ? static_cast<uint32_t>(zero_code(is_signed)) : code;
}

// The same for a y that is not NaN and below 1.0078125 in magnitude (its key at most 1.0's): what
// x * (1 / absmax) is for every element x of a block whose absmax and its inverse are finite (at most
// 1 + 2^-22: |x| <= absmax and two roundings), the CUDA kernels' fast path. So no NaN test and no upper
// clamp; |y| and the lower clamp are one float maximum, the larger magnitude, as the bits' maximum is
// (the proof below checks the bits' version against quantize_by_buckets).
DISTOPT_HD uint32_t quantize_ordinary(float y, const uint32_t* buckets, uint32_t key_min, bool is_signed) {
  const uint32_t a = float_bits(fmaxf(fabsf(y), bits_float(key_min << 16)));
  return clamped_code(a, y < 0.0f, buckets, key_min, is_signed);
}

// ---- The compile-time proof -------------------------------------------------------------------------

template <bool kSigned>
constexpr bool buckets_agree_with_search(const QuantMap<kSigned>& t) {
  if (!t.well_formed) return false;
  float thr[kCodes]{};
  for (int k = 0; k + 1 < kCodes; ++k) thr[k] = dynamic_map_threshold(kSigned, k);
  thr[kCodes - 1] = bits_float_constexpr(0x7f800000u);
  for (int k = 0; k + 1 < kCodes; ++k) {
    if (!(thr[k] < thr[k + 1])) return false;
  }
  auto agrees = [&](uint32_t bits) {
    const float y = bits_float_constexpr(bits);
    const uint32_t want = static_cast<uint32_t>(quantize_code(y, thr, kSigned));
    if (quantize_by_buckets(y, t.buckets, t.kKeyMin, kSigned) != want) return false;
    const uint32_t a = bits & 0x7fffffffu;  // quantize_ordinary's domain: not NaN, key at most 1.0's
    if (a >= ((kBucketKeyMax + 1) << 16)) return true;
    const uint32_t clamped = a < (t.kKeyMin << 16) ? t.kKeyMin << 16 : a;
    return clamped_code(clamped, (bits >> 31) != 0, t.buckets, t.kKeyMin, kSigned) == want;
  };
  for (int k = 0; k + 1 < kCodes; ++k) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      const uint32_t b = float_bits_constexpr(thr[k]) ^ sign;  // |thr| > 0: its neighbours are b +- 1
      if (!agrees(b) || !agrees(b + 1) || !agrees(b - 1)) return false;
    }
  }
  // Zeros, the ends of the buckets, 1.0 and the other floats of its key, beyond it, infinities, a
  // subnormal, NaNs.
  for (uint32_t b : {0u, 0x80000000u, t.kKeyMin << 16, (t.kKeyMin + 1) << 16, 0x3f800000u, 0xbf800000u,
                     0x3f800001u, 0xbf800002u, 0x3f80ffffu, 0xbf80ffffu, 0x3fc00000u, 0xbfc00000u, 0x7f7fffffu,
                     0xff7fffffu, 0x7f800000u, 0xff800000u, 1u, 0x80000001u, 0x7fc00000u, 0xffc00000u, 0x7f800001u}) {
    if (!agrees(b)) return false;
  }
  return true;
}

// The tables: device memory in the CUDA translation units (one copy each), host memory elsewhere.
#if defined(__CUDACC__)
#define DISTOPT_QUANT_TABLE static __device__ constexpr
#else
#define DISTOPT_QUANT_TABLE inline constexpr
#endif
DISTOPT_QUANT_TABLE QuantMap<true> kSignedQuantMap = make_quant_map<true>();
DISTOPT_QUANT_TABLE QuantMap<false> kUnsignedQuantMap = make_quant_map<false>();
#undef DISTOPT_QUANT_TABLE

static_assert(buckets_agree_with_search(make_quant_map<true>()), "signed bucket table != quantize_code");
static_assert(buckets_agree_with_search(make_quant_map<false>()), "unsigned bucket table != quantize_code");

}  // namespace distopt
