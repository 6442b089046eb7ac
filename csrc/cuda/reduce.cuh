// Block-wide sum: warp shuffles, then one warp over the per-warp partials.
#pragma once

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

}  // namespace distopt::cuda
