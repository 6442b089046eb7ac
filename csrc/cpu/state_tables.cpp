// The 8-bit maps' CPU tables (state_tables.h), built once from math/state_format.h and checked.
#include "state_tables.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace distopt {
namespace {

float next_toward(float x, float to) { return std::nextafter(x, to); }

QuantTable build(bool is_signed) {
  QuantTable t;
  t.is_signed = is_signed;
  for (int c = 0; c < kCodes; ++c) t.values[c] = dynamic_map_value(is_signed, c);
  for (int c = 0; c < kCodes; ++c) {
    for (int b = 0; b < 4; ++b) t.value_bytes[b][c] = static_cast<uint8_t>(float_bits(t.values[c]) >> (8 * b));
  }
  for (int k = 0; k + 1 < kCodes; ++k) t.thresholds[k] = dynamic_map_threshold(is_signed, k);
  t.thresholds[kCodes - 1] = std::numeric_limits<float>::infinity();
  for (int k = 0; k + 1 < kCodes; ++k) {
    if (!(t.thresholds[k] < t.thresholds[k + 1])) throw std::logic_error("dynamic map thresholds not ascending");
  }
  // The positive thresholds (the signed map's negative ones mirror them), ascending.
  const int first = zero_code(is_signed);
  const int count = kCodes - 1 - first;
  t.key_min = (float_bits(t.thresholds[first]) >> 16) - 1;
  t.key_max = float_bits(1.0f) >> 16;
  t.buckets.assign(t.key_max - t.key_min + 1, 0xffffu);
  int below = 0;
  for (uint32_t key = t.key_min; key <= t.key_max; ++key) {
    uint32_t low = 0xffffu;
    int inside = 0;
    while (below + inside < count && (float_bits(t.thresholds[first + below + inside]) >> 16) == key) {
      low = float_bits(t.thresholds[first + below + inside]) & 0xffffu;
      ++inside;
    }
    if (inside > 1) throw std::logic_error("two thresholds share a bucket (Note [Quantisation by buckets])");
    t.buckets[key - t.key_min] = static_cast<uint32_t>(below) << 16 | low;
    below += inside;
  }
  if (below != count) throw std::logic_error("a threshold lies outside the bucket table");
  // The table against the binary search at, just below and just above every threshold (both signs),
  // and at the edges: the only places where two exact methods of counting could disagree.
  auto check = [&](float y) {
    const int want = quantize_code(y, t.thresholds, is_signed);
    const int got = quantize_by_buckets(y, t.buckets.data(), t.key_min, t.key_max, is_signed);
    if (want != got) {
      throw std::logic_error("bucket quantisation differs from quantize_code at " + std::to_string(y));
    }
  };
  const float inf = std::numeric_limits<float>::infinity();
  for (int k = 0; k + 1 < kCodes; ++k) {
    for (float s : {1.0f, -1.0f}) {
      const float x = s * t.thresholds[k];
      check(x);
      check(next_toward(x, inf));
      check(next_toward(x, -inf));
    }
  }
  for (float y : {0.0f, -0.0f, 1.0f, -1.0f, 1.5f, -1.5f, inf, -inf, 1e-30f, -1e-30f, std::nanf("")}) check(y);
  return t;
}

}  // namespace

const QuantTable& quant_table(bool is_signed) {
  static const QuantTable unsigned_table = build(false);
  static const QuantTable signed_table = build(true);
  return is_signed ? signed_table : unsigned_table;
}

}  // namespace distopt
