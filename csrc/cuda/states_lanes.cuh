// The low-precision Adam update's storage on CUDA (adam_states_op.cuh): a lane's 8 elements of a block
// in registers (the moments in their formats, the param-side lists), and the 8-bit maps in shared memory.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../math/quant_tables.h"
#include "multi_tensor_apply.cuh"
#include "reduce.cuh"
#include "vec.cuh"

namespace distopt {
namespace {

using namespace cuda;

// Note [8-bit maps in shared memory]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each CUDA block copies the maps of its 8-bit moments from device memory (math/quant_tables.h's
// constant tables, cached in L2) into shared memory, 46 KiB within the 48 KiB a block may declare.
// The bucket tables (11 KiB per map) are read once per element and moment at a data-dependent key:
// about 3.4 wavefronts per warp access on random data (32 random words in 32 banks; replicating them
// would not spread them further). The map values are read at a code: a table of 256 values would do
// the same, so each value is stored in several adjacent copies and lane l reads copy l % copies,
// which puts lanes l and l + copies in the same bank only when their codes are equal modulo 32 /
// copies: 16 copies (the signed map, 16 KiB) take at most 2 wavefronts, 8 copies (the unsigned map,
// 8 KiB) about 3. In all 11.9 wavefronts per 32 elements with both moments 8-bit on random data
// (tests/emulation/test_shared_wavefronts.py counts them), against 67.6 for the binary search this
// replaced, whose steps put every lane of a warp in one bank.
constexpr int kSignedCopies = 16;
constexpr int kUnsignedCopies = 8;

struct alignas(16) QuantSmem {
  uint32_t signed_buckets[QuantMap<true>::kBucketWords];
  uint32_t unsigned_buckets[QuantMap<false>::kBucketWords];
  float signed_values[kCodes][kSignedCopies];
  float unsigned_values[kCodes][kUnsignedCopies];
};
static_assert(sizeof(QuantSmem) + 128 <= 48 * 1024, "static shared memory of a block: at most 48 KiB");

// Copies the tables of the 8-bit moments into `s`; the caller's barrier publishes them.
template <typename Map, int kWords, int kCopies>
__device__ __forceinline__ void copy_map(const Map& map, uint32_t (&buckets)[kWords],
                                         float (&values)[kCodes][kCopies]) {
  static_assert(kWords % 4 == 0 && kCopies % 4 == 0, "16-byte copies");
  for (int k = threadIdx.x; k < kWords / 4; k += kBlockSize) {
    reinterpret_cast<uint4*>(buckets)[k] = reinterpret_cast<const uint4*>(map.buckets)[k];
  }
  for (int k = threadIdx.x; k < kCodes * kCopies / 4; k += kBlockSize) {
    const float v = map.values[k / (kCopies / 4)];
    reinterpret_cast<float4*>(values)[k] = float4{v, v, v, v};
  }
}

constexpr int kLane = kQuantBlock / 32;  // a lane's elements of a quantisation block (one warp per block)

// A lane's 8 elements of one moment, as loaded and then as updated, in place: whatever the format, a
// lane holds 9 words of them (the formats are launch arguments, so its registers are the union of all).
struct MomentPack {
  uint32_t w[8];  // as loaded: fp32 the 8 values, bf16 4 words of two, 8-bit the codes in w[6], w[7];
                  // as updated: fp32 and 8-bit the values (quantised once the block's absmax is known),
                  // bf16 4 words of two (and w[4..7] while a pair is formed). Each element is read
                  // before the word it is written to is overwritten.
  float absmax;   // 8-bit: the block's absmax as loaded
};

// A lane's 8 elements of a param-side list (params, remainders, grads, param_outs) in registers, 16-bit
// types two to a word: the vector path holds its loads and results for a whole block, and a 16-bit
// array would take a register per element.
template <typename T>
struct Lanes8 {
  static_assert(sizeof(T) == 4 || sizeof(T) == 2, "32- or 16-bit elements");
  static constexpr int kWords = 8 * static_cast<int>(sizeof(T)) / 4;
  uint32_t w[kWords];

  __device__ void load(const T* p) { load_vec<kWords>(reinterpret_cast<const uint32_t*>(p), w); }
  __device__ void store(T* p) const { store_vec<kWords>(reinterpret_cast<uint32_t*>(p), w); }

  __device__ T get(int e) const {
    if constexpr (sizeof(T) == 4) {
      return bits_as<T>(w[e]);
    } else {
      return bits_as<T>(static_cast<uint16_t>(e % 2 == 0 ? w[e / 2] : w[e / 2] >> 16));
    }
  }
  __device__ void set(int e, T x) {
    if constexpr (sizeof(T) == 4) {
      w[e] = as_bits(x);
    } else {
      const uint32_t h = as_bits(x);
      w[e / 2] = e % 2 == 0 ? with_low_half(w[e / 2], h) : with_high_half(w[e / 2], h);
    }
  }

 private:
  template <typename U, typename B>
  __device__ static U bits_as(B b) {
    if constexpr (std::is_same_v<U, float>) {
      return bits_float(b);
    } else if constexpr (std::is_same_v<U, int16_t>) {
      return static_cast<int16_t>(b);
    } else {
      return U(static_cast<uint16_t>(b), U::from_bits());
    }
  }
  __device__ static uint32_t as_bits(T x) {
    if constexpr (std::is_same_v<T, float>) {
      return float_bits(x);
    } else if constexpr (std::is_same_v<T, int16_t>) {
      return static_cast<uint16_t>(x);
    } else {
      return x.x;
    }
  }
};

// Keeps the compiler from moving the loads above it below it: without it, it defers loads to where
// their values are used (elements 4-7's after elements 0-3 are computed), which saves registers but
// makes a warp wait on memory twice per block. A compiler barrier only: no instruction.
__device__ __forceinline__ void loads_issued() {
#if defined(__CUDA_ARCH__)
  asm volatile("" ::: "memory");
#endif
}

// threadIdx.x, read again where it is called: a value the compiler cannot keep from an earlier read, so
// that a loop after the vector path's does not keep it live (in a register, or spilled) through it.
__device__ __forceinline__ int thread_index_again() {
#if defined(__CUDA_ARCH__)
  unsigned t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return static_cast<int>(t);
#else
  return static_cast<int>(threadIdx.x);
#endif
}

// ---- A lane's moments in their formats ----------------------------------------------------------------

// Loads the lane's 8 elements of a moment (element i on) and, 8-bit, its block's absmax.
__device__ __forceinline__ void load_moment(StateFormat f, const void* base, const float* scales, int qb, int i,
                                            MomentPack& r) {
  if (f == StateFormat::Float32) {
    load_vec<8>(static_cast<const uint32_t*>(base) + i, r.w);
  } else if (f == StateFormat::BFloat16) {
    uint32_t h[kLane / 2];
    load_vec<kLane / 2>(reinterpret_cast<const uint32_t*>(static_cast<const bf16_t*>(base) + i), h);
#pragma unroll
    for (int k = 0; k < kLane / 2; ++k) r.w[k] = h[k];
  } else {
    const uint2 c = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(base) + i);
    r.w[6] = c.x;
    r.w[7] = c.y;
    r.absmax = scales[qb];
  }
}

// Element e of a loaded moment as fp32: bf16 widened, a code read back through the map (lane l reads
// copy l % copies of each value, Note [8-bit maps in shared memory]). Read element by element, where
// the update needs it, so that the packed words, not 8 floats, wait in registers.
template <bool kSigned>
__device__ __forceinline__ float moment_elem(StateFormat f, const MomentPack& r, const QuantSmem& smem, int lane,
                                             int e) {
  if (f == StateFormat::Float32) return bits_float(r.w[e]);
  if (f == StateFormat::BFloat16) return bits_float(e % 2 == 0 ? r.w[e / 2] << 16 : r.w[e / 2] & 0xffff0000u);
  const uint32_t code = (r.w[6 + e / 4] >> (8 * (e % 4))) & 0xffu;
  float value;
  if constexpr (kSigned) {
    value = smem.signed_values[code][lane % kSignedCopies];
  } else {
    value = smem.unsigned_values[code][lane % kUnsignedCopies];
  }
  return value * r.absmax;
}

// Puts element e's updated moment x into the pack, in place of what moment_elem read (its last
// read of the word it writes, for a bf16 pair): fp32 and 8-bit (quantised once the block's absmax is
// known) its bits, bf16 rounded (to nearest, or stochastically with `random`) and packed two to a
// word, so that the random words need not stay live until the store.
__device__ __forceinline__ void put_moment(StateFormat f, MomentPack& r, int e, float x, bool sr, uint32_t random) {
  if (f != StateFormat::BFloat16) {
    r.w[e] = float_bits(x);
    return;
  }
  // A word whose high half is the rounded bf16 (bf16_sum_stochastic's sum, or the bits shifted up).
  const uint32_t high = sr ? bf16_sum_stochastic(x, random) : static_cast<uint32_t>(bf16_bits_from_float(x)) << 16;
  if (e % 2 == 0) {
    r.w[kLane / 2 + e / 2] = high;  // until its pair's odd element has read the word
  } else {
    r.w[e / 2] = pack_high_halves(r.w[kLane / 2 + e / 2], high);
  }
}

// Stores the lane's 8 moment values from put_moment in a non-8-bit format.
__device__ __forceinline__ void store_wide(StateFormat f, void* base, int i, const MomentPack& out) {
  if (f == StateFormat::Float32) {
    store_vec<kLane>(static_cast<uint32_t*>(base) + i, out.w);
  } else {
    uint32_t w[kLane / 2];
#pragma unroll
    for (int k = 0; k < kLane / 2; ++k) w[k] = out.w[k];
    store_vec<kLane / 2>(reinterpret_cast<uint32_t*>(static_cast<bf16_t*>(base) + i), w);
  }
}

// The block's absmax from each lane's largest |x| as bits (block_absmax_of_bits); all 32 lanes call it.
__device__ __forceinline__ float warp_absmax(const MomentPack& x) {
  uint32_t most = 0;
#pragma unroll
  for (int e = 0; e < kLane; ++e) {
    const uint32_t a = x.w[e] & 0x7fffffffu;
    most = a > most ? a : most;
  }
  return block_absmax_of_bits(warp_max(most));
}

// The lane's 8 codes of x * inv, for an ordinary block (quantize_ordinary), as 8 bytes.
__device__ __forceinline__ uint2 codes_of(const MomentPack& x, float inv, const uint32_t* buckets, uint32_t key_min,
                                          bool is_signed) {
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int e = 0; e < kLane; ++e) {
    w[e / 4] |= quantize_ordinary(bits_float(x.w[e]) * inv, buckets, key_min, is_signed) << (8 * (e % 4));
  }
  return uint2{w[0], w[1]};
}


}  // namespace
}  // namespace distopt
