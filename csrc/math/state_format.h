// Adam's low-precision state formats, shared by the CPU loops and the CUDA functors (host and device).
//
// Note [State formats]
// ~~~~~~~~~~~~~~~~~~~~
// A moment (exp_avg or exp_avg_sq) is stored in one of three formats, named by its tensor's dtype:
//   * float32: as is;
//   * bfloat16: the fp32 value rounded to bf16, to nearest even (bf16_bits_from_float) or, with
//     stochastic rounding, up or down with probabilities proportional to the distance
//     (bf16_bits_stochastic, with the random words of Note [Stochastic rounding bits] in philox.h);
//   * uint8 (8-bit blockwise): one code per element and one fp32 absmax per kQuantBlock elements,
//     blocks counted from the tensor's first element. Element x of a block with absmax A is stored
//     as the code whose map value is nearest to y = x * (1 / A) (fp32 products), and read back as
//     map[code] * A. The maps are bitsandbytes' dynamic quantization maps (create_dynamic_map):
//     signed for exp_avg, unsigned for exp_avg_sq (dynamic_map_value).
// The per-element Adam math (adam.h) always runs in fp32 on the values read back; only the stores
// differ. Every function here is a fixed sequence of IEEE fp32 (or integer) operations, so host and
// device give the same bits (Note [Host/device bit-identity] in adam.h).
//
// Where the 8-bit format differs from bitsandbytes' blockwise quantization, and why:
//   * the map's linspace is torch's scalar formula (start + step * k below the middle, end - step *
//     (steps - 1 - k) above): bitsandbytes evaluates torch.linspace, whose vectorised CPU path rounds
//     some points differently, so its own maps differ by one ulp in a few dozen entries between CPUs
//     (they equal these under ATEN_CPU_CAPABILITY=default);
//   * y is x times the fp32 reciprocal of the absmax (bitsandbytes' quantize kernel; its optimizer
//     kernel divides with the approximate __fdividef instead, which the host cannot reproduce);
//   * "nearest" is exact: y is compared with the fp32 midpoints of neighbouring map values and ties
//     go to the code of smaller magnitude (bitsandbytes' binary search settles ties by its search
//     path, and moves a negative exp_avg whose nearest code is 0 to the smallest negative code; here
//     both signs round alike);
//   * a block whose values are all zero has absmax 0 and every code the map's 0 (bitsandbytes
//     divides by zero); a NaN anywhere in a block makes its absmax NaN (the canonical 0x7FC00000), so
//     the whole block reads back as NaN instead of a NaN hiding behind fmaxf; a NaN y gets code 0's
//     place of the map's zero.
#pragma once

#include <cstdint>

#include "../common/types.h"

namespace distopt {

enum class StateFormat : uint8_t { Float32 = 0, BFloat16 = 1, Blockwise8 = 2 };

// Elements per absmax of the 8-bit format.
constexpr int kQuantBlock = 256;
constexpr int kCodes = 256;

constexpr uint32_t kCanonicalNanBits = 0x7fc00000u;

// torch.linspace(0.1, 1.0, steps, dtype=float32)[k] on torch's scalar path.
DISTOPT_HD constexpr float dynamic_map_linspace(int steps, int k) {
  const float start = 0.1f, end = 1.0f;
  const float step = (end - start) / static_cast<float>(steps - 1);
  return k < steps / 2 ? start + step * static_cast<float>(k) : end - step * static_cast<float>(steps - k - 1);
}

// Value of `code` in bitsandbytes' create_dynamic_map(signed=is_signed, max_exponent_bits=7,
// total_bits=8), sorted ascending. Decade d (0..6) holds the means of linspace(0.1, 1, n + 1)
// scaled by 10^(d - 6), n = 2^d (signed, mirrored for the negative half) or 2^(d + 1) (unsigned);
// then 0 and 1.0. Signed: code 127 is 0, 255 is 1.0, 0 is the most negative. Unsigned: code 0 is 0.
DISTOPT_HD constexpr float dynamic_map_value(bool is_signed, int code) {
  if (code == kCodes - 1) return 1.0f;
  int j = 0;  // 1-based rank among the positive means
  bool negative = false;  // the signed map's lower half mirrors the upper (no recursion: none on the GPU)
  if (is_signed) {
    if (code == 127) return 0.0f;
    if (code < 127) {
      negative = true;
      code = 254 - code;
    }
    j = code - 127;  // 1..127: decade d has ranks [2^d, 2^(d+1))
  } else {
    if (code == 0) return 0.0f;
    j = code + 1;  // 2..254: decade d has ranks [2^(d+1), 2^(d+2))
  }
  int lg = 0;  // floor(log2(j))
  while ((j >> (lg + 1)) != 0) ++lg;
  const int d = is_signed ? lg : lg - 1;
  const int n = 1 << lg;  // means in the decade: 2^d (signed) or 2^(d+1) (unsigned)
  const int k = j - n;
  // 10^(d-6) as Python computes it (a double), then cast to fp32 as torch does for a scalar operand.
  // (Selects, not an array: a device function would index an array in local memory.)
  const double scale = d == 0 ? 1e-6 : d == 1 ? 1e-5 : d == 2 ? 1e-4 : d == 3 ? 1e-3 : d == 4 ? 1e-2 : d == 5 ? 1e-1 : 1.0;
  const float mean = (dynamic_map_linspace(n + 1, k) + dynamic_map_linspace(n + 1, k + 1)) / 2.0f;
  const float value = static_cast<float>(scale) * mean;
  return negative ? -value : value;
}

// The decision boundary between codes k and k + 1 (k < 255): the fp32 midpoint of their values.
DISTOPT_HD constexpr float dynamic_map_threshold(bool is_signed, int k) {
  return (dynamic_map_value(is_signed, k) + dynamic_map_value(is_signed, k + 1)) * 0.5f;
}

// The code of the map's 0.
DISTOPT_HD constexpr int zero_code(bool is_signed) { return is_signed ? 127 : 0; }

// The nearest code to y given the 255 thresholds (thr[k] between codes k and k + 1, ascending) and
// thr[255] = +inf: the number of thresholds below y, ties toward zero (a threshold equal to a
// negative y counts as below it). NaN: the map's 0. A binary search of 8 steps: the definition of the
// 8-bit store. The kernels get the same answer from the bucket tables of math/quant_tables.h, which are
// checked against it where the two could differ when they are compiled.
DISTOPT_HD constexpr int quantize_code(float y, const float* thr, bool is_signed) {
  if (y != y) return zero_code(is_signed);
  const bool negative = y < 0.0f;
  int pos = 0;
DISTOPT_UNROLL
  for (int s = 128; s > 0; s >>= 1) {
    const float t = thr[pos + s - 1];
    if (negative ? t <= y : t < y) pos += s;
  }
  return pos;
}

// |x| (the sign bit cleared: exact, NaN stays NaN).
DISTOPT_HD float abs_value(float x) { return bits_float(float_bits(x) & 0x7fffffffu); }

// A block's absmax from the largest |x| of its non-NaN elements and whether any was NaN. The maximum
// is exact and independent of the order of comparisons, so any traversal gives the same bits.
DISTOPT_HD float block_absmax(float max_abs, bool any_nan) {
  return any_nan ? bits_float(kCanonicalNanBits) : max_abs;
}

// The same from one integer maximum of the elements' bits & 0x7fffffff: |x| orders like those bits and
// a NaN's exceed every other value's, so one unsigned maximum (in any order) gives both.
DISTOPT_HD float block_absmax_of_bits(uint32_t max_abs_bits) {
  return block_absmax(bits_float(max_abs_bits), is_nan_bits(max_abs_bits));
}

// The multiplier that maps a block onto [-1, 1]: 1 / absmax, or 0 for an all-zero block (every y is
// then 0, stored as the map's 0, and read back as 0 * 0).
DISTOPT_HD float absmax_inverse(float absmax) { return absmax == 0.0f ? 0.0f : 1.0f / absmax; }

// ---- bf16 stores -------------------------------------------------------------------------------------

// x rounded to bf16 stochastically: the 16 bits below bf16's precision plus 16 random bits, then
// truncated, so x rounds away from zero with probability (dropped bits) / 2^16 and E[result] = x.
// Infinities stay, a value above the largest finite bf16 may become inf (as x + ulp would), NaN
// becomes the canonical 0x7FC0 (Note [16-bit conversions] in common/types.h).
// Only the NaN needs a test: an infinity's low 16 bits are zero, so adding 16 bits below them leaves it.
// bf16_sum_stochastic is the same before the shift: its high half is the result.
DISTOPT_HD uint32_t bf16_sum_stochastic(float x, uint32_t random16) {
  return x != x ? kCanonicalNanBits : float_bits(x) + (random16 & 0xffffu);
}

DISTOPT_HD uint16_t bf16_bits_stochastic(float x, uint32_t random16) {
  return static_cast<uint16_t>(bf16_sum_stochastic(x, random16) >> 16);
}

}  // namespace distopt
