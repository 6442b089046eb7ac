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

// Note [Bit-identical coefficients]
// adam_coeffs runs on the host for the eager update (CPU and CUDA kernels alike) and on the device in
// the capturable CUDA kernel (Note [Capturable coefficients once per block] in cuda/adam_op.cuh). Both
// give the same bits because it uses only IEEE-754 basic operations, which every conforming implementation
// rounds the same way (correctly rounded, round to nearest even): double +, -, *, / and sqrt, and
// double -> float conversion. The CUDA build keeps them that way (--fmad=false: no contraction into
// FMAs; double division and sqrt are IEEE by default), as does the host build (-ffp-contract=off;
// x86-64 and aarch64 evaluate doubles in double, FLT_EVAL_METHOD 0). The one non-basic operation,
// beta^step, is pow_by_squaring below: the same multiplications in the same order on both sides,
// where ::pow from glibc and from the CUDA math library may differ in the last bit. (A flush-to-zero
// host mode cannot change the result: a product that underflows only ever meets 1 - x with x tiny.)
// Non-integer steps (only possible in a capturable step tensor, never in the eager op) use ::pow.

// base^n for a whole n >= 0 by binary exponentiation (about 2 log2(n) multiplications). Its relative
// error is about n * 2^-53 (each squaring doubles the error so far), so 1 - beta^n, what the
// coefficients use, is off by at most about 2^-53 * n * beta^n / (1 - beta^n) <= 2^-53 / (1 - beta)
// relative: 1e-13 for beta = 0.999, 1e-12 for 0.9999 -- as good as a correctly rounded pow for small
// steps, and far below fp32's 6e-8 always, so the fp32 coefficients match torch's to the last bit
// except for rare ties at a rounding boundary.
DISTOPT_HD double pow_by_squaring(double base, uint64_t n) {
  double result = 1.0;
  while (n != 0) {
    if (n & 1u) result *= base;
    n >>= 1;
    if (n != 0) base *= base;
  }
  return result;
}

// beta^step: pow_by_squaring for whole steps up to 2^53 (exact in a double), ::pow otherwise.
DISTOPT_HD double bias_pow(double beta, double step) {
  if (step >= 0.0 && step <= 9007199254740992.0) {
    const auto n = static_cast<uint64_t>(step);
    if (static_cast<double>(n) == step) return pow_by_squaring(beta, n);
  }
  return ::pow(beta, step);
}

// Bias corrections in double, like torch computes them in Python. `step` counts this update (>= 1).
// Note [Bit-identical coefficients].
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
  c.step_size = static_cast<float>(lr / (1.0 - bias_pow(h.beta1, step)));
  c.bc2_sqrt = static_cast<float>(::sqrt(1.0 - bias_pow(h.beta2, step)));
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
