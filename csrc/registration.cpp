// The one place op implementations are registered with the dispatcher, one registration per device
// type, so the dispatcher (not the binding) chooses the kernels. The schemas themselves are defined in
// distopt/ops.py, so the pure-PyTorch fallback and these kernels share them.
#include <Python.h>
#include <torch/library.h>

#include "binding.h"

namespace distopt {
namespace {

template <typename Kernels>
void register_impls(torch::Library& m) {
  m.impl("adam_step_", &adam_step_<Kernels>);
  m.impl("l2norm", &l2norm<Kernels>);
  m.impl("scale_", &scale_<Kernels>);
  m.impl("cast_copy_", &cast_copy_<Kernels>);
}

}  // namespace
}  // namespace distopt

#if defined(DISTOPT_EMULATED)
// distopt._C_emulated (csrc/emulation/module.cpp): the CUDA kernels, run by the SIMT emulator, for
// CPU tensors, under their own namespace (the tests define its schemas from distopt/ops.py's).
TORCH_LIBRARY_IMPL(distopt_emulated, CPU, m) { distopt::register_impls<distopt::CudaKernels>(m); }
#else
TORCH_LIBRARY_IMPL(distopt, CPU, m) { distopt::register_impls<distopt::CpuKernels>(m); }

#if defined(DISTOPT_WITH_CUDA)
TORCH_LIBRARY_IMPL(distopt, CUDA, m) { distopt::register_impls<distopt::CudaKernels>(m); }
#endif

// `import distopt._C` loads this library (running the registrations above); the module is empty.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
#endif
