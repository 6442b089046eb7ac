// Per-element math shared by the CPU and CUDA kernels (compiled for host and device).
//
// Everything here is fp32 arithmetic in a fixed order. The order follows torch.optim.AdamW's
// single-tensor path (lerp for the first moment, addcmul for the second, addcdiv for the update) so
// fp32 results stay within a few ulps of torch.
//
// Note [Host/device bit-identity]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The CPU kernels (csrc/cpu) and the CUDA kernels (csrc/cuda) store the same bits for the same
// inputs, whatever the host ISA or thread count, because:
//   1. both evaluate this header's functions, each a fixed sequence of IEEE fp32 operations
//      (+, -, *, / and sqrtf, all correctly rounded to nearest even on both sides: nvcc's defaults
//      -prec-div=true -prec-sqrt=true -ftz=false; the host build never uses -ffast-math);
//   2. no operation is fused or reassociated: nvcc runs with --fmad=false and the host with
//      -ffp-contract=off (csrc/build_config.py), so an FMA host (x86-64-v3, aarch64) does not contract
//      a * b + c either; the host's vector code (SSE2, or AVX2 chosen at run time) is the same
//      operations lane by lane, and tests/test_fma_build.py rebuilds the CPU kernels with -mfma and
//      checks the bits;
//   3. the 16-bit conversions are the functions of Note [16-bit conversions] in common/types.h
//      (round to nearest even, one NaN per format), never c10's or the intrinsics' own casts;
//   4. a traversal only decides which elements a thread handles, never the order of operations
//      within an element, so block, chunk and thread boundaries cannot change a result (the L2 norm
//      is the exception: a sum, compared within NORM_RTOL, see csrc/cpu/l2norm.cpp).
// Not covered: the bits of a NaN that fp32 arithmetic creates or propagates into the fp32 outputs
// (exp_avg, exp_avg_sq, fp32 params): x86 propagates an operand's payload or makes 0xFFC00000, a
// GPU makes 0x7FFFFFFF. Both are NaN; only the 16-bit stores canonicalise them.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../common/types.h"

namespace distopt {

// Hyperparameters that are plain numbers in every variant.
struct AdamHyper {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adam_w_mode = true;  // true: decoupled decay (AdamW); false: L2 added to the gradient (Adam)
  bool maximize = false;    // true: ascend the objective (the gradient is negated, as torch's maximize)
};

// Coefficients of one update, derived once per (lr, step) from AdamHyper.
struct AdamCoeffs {
  float grad_sign;  // -1 with maximize, else 1
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
  float l2;         // Adam mode: g += l2 * p; 0 in AdamW mode
  float decay;      // AdamW mode: p *= 1 - lr * wd; 1 in Adam mode
  float step_size;  // lr / (1 - beta1^step)
  float bc2_sqrt;   // sqrt(1 - beta2^step)
};

// Bias corrections in double, like torch computes them in Python. `step` counts this update (>= 1).
DISTOPT_HD AdamCoeffs adam_coeffs(const AdamHyper& h, double lr, double step) {
  AdamCoeffs c;
  c.grad_sign = h.maximize ? -1.0f : 1.0f;
  c.beta1 = static_cast<float>(h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.eps = static_cast<float>(h.eps);
  c.l2 = h.adam_w_mode ? 0.0f : static_cast<float>(h.weight_decay);
  c.decay = h.adam_w_mode ? static_cast<float>(1.0 - lr * h.weight_decay) : 1.0f;
  c.step_size = static_cast<float>(lr / (1.0 - ::pow(h.beta1, step)));
  c.bc2_sqrt = static_cast<float>(::sqrt(1.0 - ::pow(h.beta2, step)));
  return c;
}

// The factor a traversal multiplies every gradient element by before adam_update: the grad scale,
// negated with maximize. torch's maximize negates the gradient before the L2 term is added; since
// rounding is symmetric in sign, g * -s is exactly -(g * s), so folding the sign into the factor
// gives those bits at no cost per element.
DISTOPT_HD float grad_factor(float grad_scale, const AdamCoeffs& c) { return c.grad_sign * grad_scale; }

// One Adam/AdamW update of a single element; g is already multiplied by grad_factor().
DISTOPT_HD void adam_update(float& p, float g, float& m, float& v, const AdamCoeffs& c) {
  // Unconditional (l2 is 0 in AdamW mode): adding 0 * p leaves g unchanged for any finite param
  // (even a -0 gradient ends as the same moments), and a branch here stops the CPU loop vectorizing.
  g = g + c.l2 * p;
  m = m + c.one_minus_beta1 * (g - m);  // torch.lerp for weight < 0.5
  v = v * c.beta2 + c.one_minus_beta2 * g * g;
  p = p * c.decay;
  const float denom = ::sqrtf(v) / c.bc2_sqrt + c.eps;
  p = p - c.step_size * m / denom;
}

DISTOPT_HD bool is_finite(float x) { return (float_bits(x) & 0x7f800000u) != 0x7f800000u; }

// An fp32 master value stored as a bf16 (its high half, rounded to nearest) plus an int16 low
// half. The bf16 is a usable model param; together they hold the fp32 value bit for bit.
// Split: keep the low 16 bits; if they are >= 0x8000 (negative as int16) the high half was rounded
// up in magnitude, which join undoes. Ties round away from zero (torch's cast rounds them to even).
DISTOPT_HD float join_bf16_remainder(bf16_t hi, int16_t lo) {
  uint32_t hi_bits = hi.x;
  if (lo < 0) hi_bits -= 1;
  return bits_float((hi_bits << 16) | static_cast<uint16_t>(lo));
}

DISTOPT_HD void split_bf16_remainder(float x, bf16_t& hi, int16_t& lo) {
  const uint32_t bits = float_bits(x);
  lo = static_cast<int16_t>(bits & 0xffffu);
  uint32_t hi_bits = bits >> 16;
  if (lo < 0) hi_bits += 1;
  hi = bf16_t(static_cast<uint16_t>(hi_bits), bf16_t::from_bits());
}

// Element load/store with the fp32 compute type: the conversions of Note [16-bit conversions].
DISTOPT_HD float to_float(float x) { return x; }
DISTOPT_HD float to_float(bf16_t x) { return float_from_bf16_bits(x.x); }
DISTOPT_HD float to_float(half_t x) { return float_from_half_bits(x.x); }

template <typename T>
DISTOPT_HD T from_float(float x) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    return bf16_t(bf16_bits_from_float(x), bf16_t::from_bits());
  } else if constexpr (std::is_same_v<T, half_t>) {
    return half_t(half_bits_from_float(x), half_t::from_bits());
  } else {
    static_assert(std::is_same_v<T, float>, "fp32, bf16 or fp16");
    return x;
  }
}

}  // namespace distopt
