// Chunked multi-tensor launch: one CUDA block per 64K-element chunk of any tensor in the lists.
//
// Note [Multi-tensor launch metadata]
// A launch covers up to kMaxBlocks chunks drawn from up to kMaxTensors(depth) tensors. Their
// addresses, sizes and the block -> (tensor, chunk) map travel in one struct passed by value as a
// kernel argument: reading it costs nothing (it lives in the constant bank) and needs no
// host-to-device copy, so launches stay legal inside CUDA-graph capture. Kernel arguments were
// limited to 4 KiB before CUDA 12.1 (and still are on older drivers), so every metadata struct is
// sized to fit in 4 KiB with room for the op's own arguments (static_assert below). Deeper lists
// (more pointers per tensor) leave room for fewer tensors. A tensor whose chunks do not all fit
// continues in the next launch, so any number of tensors and chunks is handled; the block map
// uses 8-bit tensor slots and 32-bit chunk indices, element offsets are 64-bit.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "../common/types.h"
#include "launch.cuh"

namespace distopt::cuda {

constexpr int kBlockSize = 512;
// Resident blocks per SM the kernels are compiled for: ptxas caps registers at
// 65536 / (kBlockSize * kMinBlocksPerSM) = 64 per thread, so two blocks overlap their memory traffic.
constexpr int kMinBlocksPerSM = 2;
constexpr int64_t kChunkSize = 65536;
constexpr int kMaxBlocks = 320;
constexpr int kMaxKernelArgBytes = 4096;
constexpr int kMaxTensorsByDepth[] = {110, 64, 48, 36, 30, 24, 20};

template <int Depth>
struct TensorListMetadata {
  static constexpr int kMaxTensors = kMaxTensorsByDepth[Depth - 1];
  static_assert(kMaxTensors <= 256, "block_to_tensor holds 8-bit tensor slots");

  void* addresses[Depth][kMaxTensors];  // nullptr: the list has no entry for this tensor
  int64_t numel[kMaxTensors];
  uint8_t block_to_tensor[kMaxBlocks];
  int32_t block_to_chunk[kMaxBlocks];
  // Blocks launched before this launch; first_block + blockIdx.x numbers every chunk of the lists
  // in order (tensor by tensor), which ops use as an output slot.
  int64_t first_block;
};

// Leave 512 bytes for the op's own arguments.
static_assert(sizeof(TensorListMetadata<1>) <= kMaxKernelArgBytes - 512);
static_assert(sizeof(TensorListMetadata<7>) <= kMaxKernelArgBytes - 512);

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
    multi_tensor_kernel(const Meta meta, Op op, Args... args) {
  op(meta, args...);
}

// Calls `op(meta, args...)` in one block per chunk of every non-empty tensor. `rows[d]` is the d-th
// list's pointer per tensor (nullptr or an empty vector: absent), `numel` the element counts.
template <int Depth, typename Op, typename... Args>
void multi_tensor_apply(const std::array<const std::vector<void*>*, Depth>& rows,
                        const std::vector<int64_t>& numel, cudaStream_t stream, const char* what,
                        Op op, Args... args) {
  using Meta = TensorListMetadata<Depth>;
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
      meta.block_to_tensor[blocks] = static_cast<uint8_t>(slot);
      meta.block_to_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      const bool last_chunk = c == chunks - 1;
      const bool tensors_full = last_chunk && slot == Meta::kMaxTensors - 1;
      if (blocks == kMaxBlocks || tensors_full) {
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

}  // namespace distopt::cuda
