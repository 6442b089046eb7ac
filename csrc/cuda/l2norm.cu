// Multi-tensor L2 norm on CUDA: per-tensor and total norms in fp32 plus the nonfinite flag.
//
// Pass 1 (multi_tensor_apply): each block squares and sums one chunk into its own slot of a
// workspace (no atomics, so the result is deterministic and identical under graph replay) and
// raises found_inf if any element is inf/nan. Pass 2: one block per tensor sums that tensor's
// slots in double. Pass 3: one block sums the per-tensor squares into the total.
#include <algorithm>
#include <cmath>

#include "../common/dispatch.h"
#include "../kernels.h"
#include "multi_tensor_apply.cuh"
#include "reduce.cuh"
#include "vec.cuh"

namespace distopt {
namespace {

using namespace cuda;

int64_t num_chunks(int64_t numel) { return (numel + kChunkSize - 1) / kChunkSize; }

template <typename T>
struct L2NormOp {
  static constexpr int N = vec_elems<T>();

  template <typename Meta>
  __device__ void operator()(const Meta& meta, float* chunk_sq, float* found_inf) const {
    const BlockChunk<Meta> ch(meta);
    const T* x = ch.template ptr<const T>(meta, 0);
    float acc[N] = {};  // N independent sums keep the adds pipelined
    bool nonfinite = false;
    int64_t done = 0;
    if (is_aligned(x)) {
      const int64_t packs = ch.len / N;
      for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
        T r[N];
        load_vec<N>(x + k * N, r);
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const float f = to_float(r[e]);
          nonfinite |= !is_finite(f);
          acc[e] += f * f;
        }
      }
      done = packs * N;
    }
    for (int64_t i = done + threadIdx.x; i < ch.len; i += blockDim.x) {
      const float f = to_float(x[i]);
      nonfinite |= !is_finite(f);
      acc[0] += f * f;
    }
    float sum = 0.0f;
#pragma unroll
    for (int e = 0; e < N; ++e) sum += acc[e];
    sum = block_sum(sum);
    const bool any_nonfinite = __syncthreads_or(nonfinite);
    if (threadIdx.x == 0) {
      chunk_sq[meta.first_block + blockIdx.x] = sum;
      if (any_nonfinite && found_inf != nullptr) *found_inf = 1.0f;
    }
  }
};

// Chunk-slot ranges of up to kTensors - 1 tensors per launch (kernel argument, see the Note in
// multi_tensor_apply.cuh): 399 with 4 KiB of parameters, 3999 with 32 KiB.
template <bool kLarge>
struct CleanupMeta {
  static constexpr int kTensors = kLarge ? 4000 : 400;
  int64_t first_slot[kTensors];
  int32_t first_tensor;
};
static_assert(sizeof(CleanupMeta<false>) <= kSmallKernelParamBytes - kOpArgBytes);
static_assert(sizeof(CleanupMeta<true>) <= kLargeKernelParamBytes - kOpArgBytes);

template <typename Meta>
__global__ void __launch_bounds__(kBlockSize)
    l2norm_per_tensor(grid_const<Meta> meta, const float* chunk_sq, float* tensor_sq, float* per_tensor) {
  const int t = blockIdx.x;
  const int64_t begin = meta.first_slot[t];
  const int64_t end = meta.first_slot[t + 1];
  double s = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) s += chunk_sq[i];
  s = block_sum(s);
  if (threadIdx.x == 0) {
    tensor_sq[meta.first_tensor + t] = static_cast<float>(s);
    per_tensor[meta.first_tensor + t] = static_cast<float>(::sqrt(s));
  }
}

// Pass 2: the per-tensor sums, kTensors - 1 tensors per launch.
template <bool kLarge>
void l2norm_cleanup(const TensorLists& tl, float* workspace, float* tensor_sq, float* per_tensor, cudaStream_t s) {
  using Meta = CleanupMeta<kLarge>;
  const int64_t n = tl.size();
  int64_t slot = 0;
  for (int64_t first = 0; first < n; first += Meta::kTensors - 1) {
    const int64_t count = std::min<int64_t>(Meta::kTensors - 1, n - first);
    Meta meta;
    meta.first_tensor = static_cast<int32_t>(first);
    for (int64_t t = 0; t < count; ++t) {
      meta.first_slot[t] = slot;
      slot += num_chunks(tl.numel[first + t]);
    }
    meta.first_slot[count] = slot;
    launch_kernel("l2norm per-tensor", l2norm_per_tensor<Meta>, static_cast<unsigned>(count), kBlockSize, 0, s, meta,
                  workspace, tensor_sq, per_tensor);
  }
}

__global__ void __launch_bounds__(kBlockSize)
    l2norm_total(const float* tensor_sq, int64_t n, float* total) {
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += tensor_sq[i];
  s = block_sum(s);
  if (threadIdx.x == 0) *total = static_cast<float>(::sqrt(s));
}

}  // namespace

// Workspace layout: one float per chunk (its sum of squares), then one per tensor (its square).
int64_t l2norm_cuda_workspace_floats(const TensorLists& tl) {
  int64_t chunks = 0;
  for (int64_t n : tl.numel) chunks += num_chunks(n);
  return chunks + tl.size();
}

void l2norm_cuda(const TensorLists& tl, float* total, float* per_tensor, float* found_inf,
                 float* workspace, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  std::array<const std::vector<void*>*, 1> rows = {&tl.lists[0].data};
  dispatch_float(tl.lists[0].dtype, "l2norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    multi_tensor_apply<1>(rows, tl.numel, s, "l2norm", L2NormOp<T>{}, workspace, found_inf);
  });

  const int64_t n = tl.size();
  float* tensor_sq = workspace + (l2norm_cuda_workspace_floats(tl) - n);
#if DISTOPT_LARGE_KERNEL_PARAMS_BUILT
  if (large_kernel_params()) {
    l2norm_cleanup<true>(tl, workspace, tensor_sq, per_tensor, s);
  } else
#endif
  {
    l2norm_cleanup<false>(tl, workspace, tensor_sq, per_tensor, s);
  }
  launch_kernel("l2norm total", l2norm_total, 1, kBlockSize, 0, s, tensor_sq, n, total);
}

}  // namespace distopt
