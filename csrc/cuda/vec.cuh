// 16-byte vector loads and stores of N consecutive elements, with the alignment test that gates them.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "../common/types.h"

namespace distopt::cuda {

constexpr int kVecBytes = 16;

// Elements each thread handles per step: enough for one 16-byte access of the narrowest type
// (4 for all-fp32, 8 when any list is 16-bit); wider lists then issue several 16-byte accesses.
template <typename... Ts>
constexpr int vec_elems() {
  size_t narrowest = 4;
  for (size_t size : {sizeof(Ts)...}) narrowest = size < narrowest ? size : narrowest;
  return kVecBytes / static_cast<int>(narrowest);
}

__device__ __forceinline__ bool is_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % kVecBytes == 0;
}

template <typename T>
struct alignas(kVecBytes) Pack {
  static constexpr int kN = kVecBytes / sizeof(T);
  T v[kN];
};

// p must be 16-byte aligned; N * sizeof(T) a multiple of 16.
template <int N, typename T>
__device__ __forceinline__ void load_vec(const T* p, T (&out)[N]) {
  constexpr int kPer = Pack<T>::kN;
  static_assert(N % kPer == 0, "N elements must fill whole 16-byte packs");
#pragma unroll
  for (int k = 0; k < N / kPer; ++k) {
    const Pack<T> pack = reinterpret_cast<const Pack<T>*>(p)[k];
#pragma unroll
    for (int e = 0; e < kPer; ++e) out[k * kPer + e] = pack.v[e];
  }
}

template <int N, typename T>
__device__ __forceinline__ void store_vec(T* p, const T (&in)[N]) {
  constexpr int kPer = Pack<T>::kN;
  static_assert(N % kPer == 0, "N elements must fill whole 16-byte packs");
#pragma unroll
  for (int k = 0; k < N / kPer; ++k) {
    Pack<T> pack;
#pragma unroll
    for (int e = 0; e < kPer; ++e) pack.v[e] = in[k * kPer + e];
    reinterpret_cast<Pack<T>*>(p)[k] = pack;
  }
}

}  // namespace distopt::cuda
