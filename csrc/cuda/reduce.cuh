// Block-wide sum (warp shuffles, then one warp over the per-warp partials) and warp-wide maximum.
#pragma once

#include <cstdint>

#include "multi_tensor_apply.cuh"

namespace distopt::cuda {

// Sum of `x` over the block; the result is valid in thread 0. All threads must call it.
template <typename T>
__device__ T block_sum(T x) {
  constexpr int kWarps = kBlockSize / 32;
  __shared__ T warp_sums[kWarps];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_down_sync(0xffffffffu, x, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < static_cast<int>(blockDim.x / 32) ? warp_sums[lane] : T(0);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) x += __shfl_down_sync(0xffffffffu, x, offset);
  }
  __syncthreads();  // warp_sums may be reused by a following call
  return x;
}

// The largest of the warp's 32 values, in every lane; all 32 lanes call it. One REDUX instruction from
// sm_80 on (the emulator has it too), shuffles before.
__device__ __forceinline__ uint32_t warp_max(uint32_t x) {
#if defined(DISTOPT_SIMT_EMULATION) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
  return __reduce_max_sync(0xffffffffu, x);
#else
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const uint32_t o = __shfl_xor_sync(0xffffffffu, x, offset);
    x = o > x ? o : x;
  }
  return x;
#endif
}

}  // namespace distopt::cuda
