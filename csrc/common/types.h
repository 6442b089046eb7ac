// Element types, their conversions to and from fp32, and plain tensor-list descriptors shared by
// the CPU and CUDA kernels.
//
// Kernels never see ATen: the binding layer (binding.cpp) turns torch::stable::Tensor lists into these
// descriptors. The 16-bit storage types are torch's header-only c10::Half/BFloat16 (torch/headeronly:
// no libtorch symbol; layout only: the kernels convert with the functions below, not with c10's casts,
// see the Note there).
#pragma once

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__CUDACC__)
#define DISTOPT_HD __host__ __device__ __forceinline__
#else
#define DISTOPT_HD inline
#endif

// `#pragma unroll` for the device compiler only (host compilers warn about it, and unroll on their own).
#if defined(__CUDA_ARCH__)
#define DISTOPT_UNROLL _Pragma("unroll")
#else
#define DISTOPT_UNROLL
#endif

namespace distopt {

using half_t = c10::Half;
using bf16_t = c10::BFloat16;

DISTOPT_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

DISTOPT_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

// The high halves of a and b as one word (a's low): a byte permute on the device.
DISTOPT_HD uint32_t pack_high_halves(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, 0x7632);
#else
  return (a >> 16) | (b & 0xffff0000u);
#endif
}

// A word with its low (or high) half replaced by h's low half: one byte permute on the device.
DISTOPT_HD uint32_t with_low_half(uint32_t w, uint32_t h) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(h, w, 0x7610);
#else
  return (w & 0xffff0000u) | (h & 0xffffu);
#endif
}

DISTOPT_HD uint32_t with_high_half(uint32_t w, uint32_t h) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(w, h, 0x5410);
#else
  return (w & 0xffffu) | (h << 16);
#endif
}

// float_bits and bits_float in constant expressions (the tables of math/quant_tables.h, built when the
// kernels are compiled): __builtin_bit_cast is constexpr in GCC >= 11, Clang and nvcc, C++17 included.
constexpr uint32_t float_bits_constexpr(float x) { return __builtin_bit_cast(uint32_t, x); }
constexpr float bits_float_constexpr(uint32_t u) { return __builtin_bit_cast(float, u); }

// Note [16-bit conversions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Every fp32 <-> bf16/fp16 conversion of the kernels, host and device, goes through these four
// functions, so both sides store the same bits:
//   * fp32 -> 16 bit rounds to nearest, ties to even (IEEE 754's default), overflowing to +-inf;
//   * any NaN becomes the format's default quiet NaN, sign and payload dropped: 0x7FC0 (bf16),
//     0x7E00 (fp16). c10's host casts write 0x7FC0 and sign | 0x7E00 (or, built with -mf16c, the
//     truncated payload), the device intrinsics 0x7FFF: left to them the two sides would differ;
//   * 16 bit -> fp32 is exact (NaN payloads kept, shifted into place), done with integer operations
//     and one exact int -> float conversion, the same code on both sides.
// On the host the fp32 -> 16-bit conversions are branch-free integer/fp32 code the compiler
// vectorises (bf16: c10's rounding; fp16: c10's fp16_ieee_from_fp32_value, which relies on IEEE fp32
// adds and multiplies without FMA contraction or flush-to-zero); on the device they are the IEEE
// round-to-nearest cvt instructions plus the NaN select, so the two give the same bits by the IEEE
// definition of rounding. tests/ops/test_cpu_kernels.py checks the host code against torch's casts.

DISTOPT_HD bool is_nan_bits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

DISTOPT_HD uint16_t bf16_bits_from_float(float x) {
  const uint32_t u = float_bits(x);
#if defined(__CUDA_ARCH__)
  const uint16_t r = __bfloat16_as_ushort(__float2bfloat16_rn(x));
#else
  const uint16_t r = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
  return is_nan_bits(u) ? uint16_t{0x7fc0} : r;
}

DISTOPT_HD float float_from_bf16_bits(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

DISTOPT_HD uint16_t half_bits_from_float(float x) {
  const uint32_t w = float_bits(x);
#if defined(__CUDA_ARCH__)
  const uint16_t r = __half_as_ushort(__float2half_rn(x));
#else
  // c10::detail::fp16_ieee_from_fp32_value's portable branch: scaling by 2^112 then 2^-110 rounds the
  // magnitude to fp16's precision (and overflows to inf), adding 2^(e+...) aligns the rounding point.
  const float scaled = bits_float(w & 0x7fffffffu) * bits_float(239u << 23) * bits_float(17u << 23);
  const uint32_t shl1_w = w + w;
  uint32_t bias = shl1_w & 0xff000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  const uint32_t bits = float_bits(bits_float((bias >> 1) + 0x07800000u) + scaled);
  const uint32_t nonsign = ((bits >> 13) & 0x00007c00u) + (bits & 0x00000fffu);
  const uint16_t r = static_cast<uint16_t>(((w & 0x80000000u) >> 16) | nonsign);
#endif
  return is_nan_bits(w) ? uint16_t{0x7e00} : r;
}

DISTOPT_HD float float_from_half_bits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;  // exponent and mantissa
  // Normal: rebias the exponent (127 - 15 = 112). Inf/NaN: exponent all ones, mantissa kept.
  // Subnormal (and zero): mantissa * 2^-24, both steps exact.
  const uint32_t normal = em >= 0x7c00u ? (0x7f800000u | ((em & 0x3ffu) << 13)) : ((em << 13) + (112u << 23));
  const uint32_t subnormal = float_bits(static_cast<float>(static_cast<int32_t>(em)) * bits_float(103u << 23));
  return bits_float(sign | (em < 0x0400u ? subnormal : normal));
}

// The element types the kernels accept. Int16 only appears as the remainder half of a
// bf16 + int16 split fp32 master param (see math/adam.h), UInt8 as 8-bit moment codes
// (math/state_format.h).
enum class DType : uint8_t { Float32, Float16, BFloat16, Int16, UInt8 };

// torch's name of a kernel dtype ("float32", ...): the one dtype naming, which the binding layer's
// messages use too (binding.cpp's scalar_type_name).
constexpr const char* dtype_name(DType d) {
  switch (d) {
    case DType::Float32: return "float32";
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Int16: return "int16";
    case DType::UInt8: return "uint8";
  }
  return "unknown";
}

// A list of same-dtype tensors: one data pointer each (nullptr = "absent for this entry") and a
// shared element count list owned by the caller (TensorLists::numel).
struct TensorList {
  DType dtype = DType::Float32;
  std::vector<void*> data;

  bool empty() const { return data.empty(); }
};

// `depth` lists of equal length whose i-th entries all have numel[i] elements, walked together.
struct TensorLists {
  std::vector<TensorList> lists;
  std::vector<int64_t> numel;

  int64_t size() const { return static_cast<int64_t>(numel.size()); }
};

}  // namespace distopt
