// How many bytes of kernel parameters this process may pass: 4 KiB, or 32,764 bytes where the CUDA
// runtime, the driver and the GPU all support it (Note [Multi-tensor launch metadata]).
//
// Large kernel parameters need (CUDA 12.1 release; PyTorch's MultiTensorApply.cuh checks the same):
//   * a toolkit >= 12.1 at build time (CUDART_VERSION): older nvcc rejects such kernels;
//   * a runtime and a driver >= 12.1 at run time: minor-version compatibility lets a 12.x build run on
//     an older 12.0 driver, which fails these launches;
//   * compute capability >= 7.0 (Volta), whose code nvcc cannot even produce for such a kernel below.
// The run-time part is decided once, at the first launch (on the then current device, which the
// binding layer sets to the tensors' device), and cached: a process never mixes the two sizes of
// metadata. A process with GPUs both below and above Volta is not supported.
#pragma once

#include <cuda_runtime.h>

namespace distopt::cuda {

constexpr int kSmallKernelParamBytes = 4096;
constexpr int kLargeKernelParamBytes = 32764;

#if defined(DISTOPT_SIMT_EMULATION) || (defined(CUDART_VERSION) && CUDART_VERSION >= 12010)
#define DISTOPT_LARGE_KERNEL_PARAMS_BUILT 1
#else
#define DISTOPT_LARGE_KERNEL_PARAMS_BUILT 0
#endif

#if DISTOPT_LARGE_KERNEL_PARAMS_BUILT && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
#error "distopt's CUDA kernels need compute capability >= 7.0 (large kernel parameters); drop older archs from TORCH_CUDA_ARCH_LIST"
#endif

// Asks the runtime (the emulator's, in the emulated build) whether it supports large parameters.
inline bool query_large_kernel_params() {
  int driver = 0, runtime = 0, device = 0, major = 0;
  const bool ok = cudaDriverGetVersion(&driver) == cudaSuccess && cudaRuntimeGetVersion(&runtime) == cudaSuccess &&
                  cudaGetDevice(&device) == cudaSuccess &&
                  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess;
  if (!ok) {
    (void)cudaGetLastError();  // a failed query must not surface as the next launch's error
    return false;
  }
  return driver >= 12010 && runtime >= 12010 && major >= 7;
}

// Whether multi_tensor_apply uses the 32,764-byte metadata.
inline bool large_kernel_params() {
#if !DISTOPT_LARGE_KERNEL_PARAMS_BUILT
  return false;
#elif defined(DISTOPT_SIMT_EMULATION)
  // The emulated runtime's versions are a test setting (simt::set_runtime), each value standing for
  // another machine: ask every time.
  return query_large_kernel_params();
#else
  static const bool large = query_large_kernel_params();
  return large;
#endif
}

}  // namespace distopt::cuda
