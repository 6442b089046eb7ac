// distopt._C_cuda: the CUDA kernels (csrc/cuda) registered for CUDA tensors, launched on torch's current
// stream. A module of its own because the stream comes from libtorch_cuda, which a CPU-only torch lacks:
// distopt._C (the CPU kernels) must load there too. Built on the stable ABI and the Python limited API,
// with the CUDA runtime linked statically (csrc/build_config.py).
//
// Compiled with DISTOPT_EMULATED into distopt._C_emulated instead (csrc/testing/simt, the tests' "cuda-emulated"
// backend): the same kernels, run by the SIMT emulator on CPU tensors, registered as distopt_emulated::*.
#if !defined(DISTOPT_EMULATED)
// torch's C shim declares its CUDA entry points (aoti_torch_get_current_cuda_stream) only under USE_CUDA.
#define USE_CUDA 1
#include <Python.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#endif

#include "binding.h"

namespace distopt {

struct CudaKernels {
  // Runs `launch(stream)` on the current stream of `device`, with `device` current (in the emulator:
  // CPU tensors, no stream).
  template <typename Launch>
  static void on_stream(const Device& device, Launch&& launch) {
#if defined(DISTOPT_EMULATED)
    (void)device;
    launch(nullptr);
#else
    DISTOPT_CHECK(device.type() == torch::headeronly::DeviceType::CUDA, "expected CUDA tensors, got tensors on ",
                  device_name(device));
    const torch::stable::accelerator::DeviceGuard guard(device.index());
    void* stream = nullptr;
    TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device.index(), &stream));
    launch(stream);
#endif
  }
  static void adam(const Device& device, const TensorLists& tl, const AdamArgs& args) {
    on_stream(device, [&](void* stream) { adam_cuda(tl, args, stream); });
  }
  static void l2norm(const Device& device, const TensorLists& tl, float* total, float* per_tensor,
                     float* found_inf) {
    const Tensor workspace =
        torch::stable::empty({l2norm_cuda_workspace_floats(tl)}, torch::headeronly::ScalarType::Float, std::nullopt,
                             device);
    float* scratch = workspace.mutable_data_ptr<float>();
    on_stream(device, [&](void* stream) { l2norm_cuda(tl, total, per_tensor, found_inf, scratch, stream); });
  }
  static void scale(const Device& device, const TensorLists& tl, const ScaleArgs& args) {
    on_stream(device, [&](void* stream) { scale_cuda(tl, args, stream); });
  }
};

}  // namespace distopt

#if defined(DISTOPT_EMULATED)
STABLE_TORCH_LIBRARY_IMPL(distopt_emulated, CPU, m) { distopt::register_impls<distopt::CudaKernels>(m); }
#else
STABLE_TORCH_LIBRARY_IMPL(distopt, CUDA, m) { distopt::register_impls<distopt::CudaKernels>(m); }

// `import distopt._C_cuda` loads this library, running the registration above; the module is empty.
extern "C" PyMODINIT_FUNC PyInit__C_cuda(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C_cuda", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
#endif
