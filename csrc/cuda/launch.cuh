// The one way the CUDA kernels are launched (no `<<<...>>>` anywhere else), so that the same launch
// sites build with nvcc and, as host C++, with the SIMT emulator (csrc/testing/simt/simt.h), which
// runs each launch on the CPU and checks it (tests/ops/test_ops_*.py, backend "cuda-emulated").
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>

namespace distopt::cuda {

// The type of a large by-value kernel parameter (the launch metadata): `const T` on the GPU, where
// parameters sit in the constant bank and are read in place; a const reference to the launch's one
// copy under the emulator, where each of a block's threads would otherwise copy up to 32 KiB onto its
// fiber stack (10,000 one-chunk tensors: 160 GB of copies). The parameter size the emulator checks is
// the value's either way.
#if defined(DISTOPT_SIMT_EMULATION)
template <typename T>
using grid_const = const T&;
#else
template <typename T>
using grid_const = const T;
#endif

// Throws if the last launch failed (kernels run asynchronously: later faults surface elsewhere).
inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": CUDA launch failed: " + cudaGetErrorString(err));
  }
}

// kernel<<<grid, block, shared_bytes, stream>>>(args...), then check_launch(what). `what` names the
// kernel in error messages (the emulator's too).
template <typename... KernelArgs, typename... Args>
void launch_kernel(const char* what, void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t shared_bytes,
                   cudaStream_t stream, Args&&... args) {
#if defined(DISTOPT_SIMT_EMULATION)
  ::simt::launch_kernel(what, kernel, grid, block, shared_bytes, stream, std::forward<Args>(args)...);
#else
  kernel<<<grid, block, shared_bytes, stream>>>(std::forward<Args>(args)...);
#endif
  check_launch(what);
}

}  // namespace distopt::cuda
