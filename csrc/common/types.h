// Element types and plain tensor-list descriptors shared by the CPU and CUDA kernels.
//
// Kernels never see ATen: the binding layer (binding.cpp) turns at::Tensor lists into these
// descriptors. The 16-bit storage types are c10's header-only Half/BFloat16, so CPU and CUDA
// round exactly as torch does (round-to-nearest-even) and tests can compare bit for bit.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

#if defined(__CUDACC__)
#define DISTOPT_HD __host__ __device__ __forceinline__
#else
#define DISTOPT_HD inline
#endif

namespace distopt {

using half_t = c10::Half;
using bf16_t = c10::BFloat16;

// The element types the kernels accept. Int16 only appears as the remainder half of a
// bf16 + int16 split fp32 master param (see math/adam.h).
enum class DType : uint8_t { Float32, Float16, BFloat16, Int16 };

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
