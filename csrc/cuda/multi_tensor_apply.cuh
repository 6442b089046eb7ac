// Chunked multi-tensor launch: one CUDA block per 64K-element chunk of any tensor in the lists.
//
// Note [Multi-tensor launch metadata]
// A launch covers up to kMaxBlocks chunks drawn from up to kMaxTensors tensors. Their addresses, sizes
// and the block -> (tensor, chunk) map travel in one struct passed by value as a kernel argument:
// reading it costs nothing (it lives in the constant bank) and needs no host-to-device copy, so
// launches stay legal inside CUDA-graph capture. Each op passes only the lists it reads (its depth:
// the fp32 eager Adam update has 4, the capturable one adds a step row), so shallower variants fit
// more tensors in the same bytes. A tensor whose chunks do not all fit continues in the next launch,
// so any number of tensors and chunks is handled; chunk indices are 32-bit, element offsets 64-bit.
//
// Two sizes of metadata (kernel_params.cuh decides which, once per process):
//   * 4 KiB, the kernel-argument limit before CUDA 12.1 (and on older drivers or pre-Volta GPUs):
//     320 blocks and 8-bit tensor slots, the rest for tensor slots: 49 at depth 4.
//   * 32,764 bytes (CUDA >= 12.1 runtime and driver, compute capability >= 7.0): 16-bit slots and as
//     many block entries as tensor slots, so many one-chunk tensors fill both at once. At depth 4
//     (fp32 eager Adam) a launch holds 700 tensors: 10,000 tensors of 4,096 elements take 15 launches
//     instead of 500, each of 700 blocks, more than one full wave (132 SMs x 2 resident 512-thread
//     blocks = 264 on an H100), so no launch leaves SMs idle for lack of blocks. For large tensors a
//     launch is then 460-1465 blocks (depth 7 to 1): at least 1.7 waves, where 320 blocks took two
//     waves to do 1.2 waves of work.
// Both leave kOpArgBytes for the op's own arguments (static_assert below, and tools/gpu_budgets.py
// checks every instantiation's parameter size against its path's limit).
#pragma once

#include <array>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/types.h"
#include "kernel_params.cuh"
#include "launch.cuh"

namespace distopt::cuda {

constexpr int kBlockSize = 512;
// Resident blocks per SM the kernels are compiled for: ptxas caps registers at
// 65536 / (kBlockSize * kMinBlocksPerSM) = 64 per thread, so two blocks overlap their memory traffic.
constexpr int kMinBlocksPerSM = 2;
constexpr int64_t kChunkSize = 65536;
constexpr int kMaxDepth = 11;  // the capturable low-precision-moment update (adam_states_op.cuh)
constexpr int kOpArgBytes = 512;  // room left in the kernel parameters for the op's own arguments

// Launch limits of one metadata size and depth.
struct MetaLimits {
  int tensors;
  int blocks;
};

// 4 KiB: 320 blocks (8-bit slot + 32-bit chunk each), the rest for tensor slots (depth pointers and a
// 64-bit size each) after the 8-byte first_block.
constexpr MetaLimits small_limits(int depth) {
  constexpr int blocks = 320;
  return {(kSmallKernelParamBytes - kOpArgBytes - 8 - blocks * 5) / (8 * depth + 8), blocks};
}

// 32,764 bytes: as many block entries (16-bit slot + 32-bit chunk) as tensor slots; one entry fewer
// where the padding before the 32-bit arrays would not fit (depth 10).
constexpr int large_metadata_bytes(int depth, int n) {
  const int slots_end = (8 * depth + 8 + 2) * n;                   // addresses, numel, block_to_tensor
  const int chunks_end = (slots_end + 3) / 4 * 4 + 4 * n;           // block_to_chunk
  return (chunks_end + 7) / 8 * 8 + 8;                              // first_block
}
constexpr MetaLimits large_limits(int depth) {
  int n = (kLargeKernelParamBytes - kOpArgBytes - 8) / (8 * depth + 8 + 6);
  while (large_metadata_bytes(depth, n) > kLargeKernelParamBytes - kOpArgBytes) --n;
  return {n, n};
}

template <int Depth, bool kLarge>
struct TensorListMetadata {
  static_assert(Depth >= 1 && Depth <= kMaxDepth);
  static constexpr MetaLimits kLimits = kLarge ? large_limits(Depth) : small_limits(Depth);
  static constexpr int kMaxTensors = kLimits.tensors;
  static constexpr int kMaxBlocks = kLimits.blocks;
  using Slot = std::conditional_t<kLarge, uint16_t, uint8_t>;
  static_assert(kMaxTensors <= (1 << (8 * sizeof(Slot))), "block_to_tensor's slots must hold every slot index");

  void* addresses[Depth][kMaxTensors];  // nullptr: the list has no entry for this tensor
  int64_t numel[kMaxTensors];
  Slot block_to_tensor[kMaxBlocks];
  int32_t block_to_chunk[kMaxBlocks];
  // Blocks launched before this launch; first_block + blockIdx.x numbers every chunk of the lists
  // in order (tensor by tensor), which ops use as an output slot.
  int64_t first_block;
};

template <int Depth>
constexpr bool fits_its_limit() {
  return sizeof(TensorListMetadata<Depth, false>) <= kSmallKernelParamBytes - kOpArgBytes &&
         sizeof(TensorListMetadata<Depth, true>) <= kLargeKernelParamBytes - kOpArgBytes;
}
static_assert(fits_its_limit<1>() && fits_its_limit<2>() && fits_its_limit<3>() && fits_its_limit<4>() &&
              fits_its_limit<5>() && fits_its_limit<6>() && fits_its_limit<7>() && fits_its_limit<8>() &&
              fits_its_limit<9>() && fits_its_limit<10>() && fits_its_limit<11>());

// Chunk (tensor slot, chunk index, element range) of the calling block.
template <typename Meta>
struct BlockChunk {
  int slot;
  int64_t start;  // first element of the chunk within the tensor
  int64_t len;    // elements in the chunk

  __device__ explicit BlockChunk(const Meta& meta) {
    slot = meta.block_to_tensor[blockIdx.x];
    start = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * kChunkSize;
    const int64_t left = meta.numel[slot] - start;
    len = left < kChunkSize ? left : kChunkSize;
  }

  // The chunk's first element in row `row`, or nullptr when that row has no entry.
  template <typename T>
  __device__ T* ptr(const Meta& meta, int row) const {
    auto* base = static_cast<T*>(meta.addresses[row][slot]);
    return base == nullptr ? nullptr : base + start;
  }
};

template <typename Meta, typename Op, typename... Args>
__global__ void __launch_bounds__(kBlockSize, kMinBlocksPerSM)
    multi_tensor_kernel(grid_const<Meta> meta, Op op, Args... args) {
  op(meta, args...);
}

// Calls `op(meta, args...)` in one block per chunk of every non-empty tensor, with metadata of the
// given size (see multi_tensor_apply).
template <int Depth, bool kLarge, typename Op, typename... Args>
void multi_tensor_apply_sized(const std::array<const std::vector<void*>*, Depth>& rows,
                              const std::vector<int64_t>& numel, cudaStream_t stream, const char* what, Op op,
                              Args... args) {
  using Meta = TensorListMetadata<Depth, kLarge>;
  using Slot = typename Meta::Slot;
  Meta meta;
  meta.first_block = 0;
  int slot = 0;    // tensor slot being filled
  int blocks = 0;  // blocks queued in this launch

  auto launch = [&]() {
    launch_kernel(what, multi_tensor_kernel<Meta, Op, Args...>, blocks, kBlockSize, 0, stream, meta, op, args...);
    meta.first_block += blocks;
    blocks = 0;
  };

  const int64_t n = static_cast<int64_t>(numel.size());
  for (int64_t t = 0; t < n; ++t) {
    if (numel[t] == 0) continue;
    for (int d = 0; d < Depth; ++d) {
      const bool has_row = rows[d] != nullptr && !rows[d]->empty();
      meta.addresses[d][slot] = has_row ? (*rows[d])[t] : nullptr;
    }
    meta.numel[slot] = numel[t];
    const int64_t chunks = (numel[t] + kChunkSize - 1) / kChunkSize;
    bool slot_reused = false;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_to_tensor[blocks] = static_cast<Slot>(slot);
      meta.block_to_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      const bool last_chunk = c == chunks - 1;
      const bool tensors_full = last_chunk && slot == Meta::kMaxTensors - 1;
      if (blocks == Meta::kMaxBlocks || tensors_full) {
        launch();
        if (last_chunk) {
          slot = 0;
          slot_reused = true;
        } else if (slot != 0) {  // the tensor continues in the next launch, from slot 0
          for (int d = 0; d < Depth; ++d) meta.addresses[d][0] = meta.addresses[d][slot];
          meta.numel[0] = meta.numel[slot];
          slot = 0;
        }
      }
    }
    if (!slot_reused) ++slot;
  }
  if (blocks > 0) launch();
}

// multi_tensor_apply_sized with the metadata size this process supports (kernel_params.cuh). `rows[d]`
// is the d-th list's pointer per tensor (nullptr or an empty vector: absent), `numel` the element
// counts; `op` is the per-block functor, with a `template <typename Meta> operator()(const Meta&,
// args...)` for either metadata type.
template <int Depth, typename Op, typename... Args>
void multi_tensor_apply(const std::array<const std::vector<void*>*, Depth>& rows,
                        const std::vector<int64_t>& numel, cudaStream_t stream, const char* what, Op op,
                        Args... args) {
#if DISTOPT_LARGE_KERNEL_PARAMS_BUILT
  if (large_kernel_params()) {
    multi_tensor_apply_sized<Depth, true>(rows, numel, stream, what, op, args...);
    return;
  }
#endif
  multi_tensor_apply_sized<Depth, false>(rows, numel, stream, what, op, args...);
}

}  // namespace distopt::cuda
