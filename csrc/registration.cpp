// The one place op implementations are registered with the dispatcher, one registration per device
// type, so the dispatcher (not the binding) chooses the kernels. The schemas themselves are defined in
// distopt/ops.py, so the pure-PyTorch fallback and these kernels share them.
#include <Python.h>
#include <torch/library.h>

#include <stdexcept>

#include "binding.h"
#if !defined(DISTOPT_EMULATED)
#include "cpu/isa.h"
#endif

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

// `import distopt._C` loads this library (running the registrations above). The module itself only
// reports the CPU kernels' vector ISA (csrc/cpu/isa.h), for the tests and the benchmarks.
namespace {

PyObject* py_cpu_isa(PyObject*, PyObject*) {
  try {
    return PyUnicode_FromString(distopt::cpu_isa_name(distopt::cpu_isa()));
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
}

PyObject* py_best_cpu_isa(PyObject*, PyObject*) {
  return PyUnicode_FromString(distopt::cpu_isa_name(distopt::best_cpu_isa()));
}

PyObject* py_cpu_isa_runs(PyObject*, PyObject*) {
  PyObject* runs = PyDict_New();
  for (distopt::CpuIsa isa : {distopt::CpuIsa::Baseline, distopt::CpuIsa::Avx2, distopt::CpuIsa::Avx512}) {
    PyObject* n = PyLong_FromLongLong(distopt::cpu_isa_runs(isa));
    if (runs == nullptr || n == nullptr || PyDict_SetItemString(runs, distopt::cpu_isa_name(isa), n) != 0) {
      Py_XDECREF(n);
      Py_XDECREF(runs);
      return nullptr;
    }
    Py_DECREF(n);
  }
  return runs;
}

PyMethodDef methods[] = {
    {"cpu_isa", py_cpu_isa, METH_NOARGS,
     "The vector ISA the CPU kernels run with now: DISTOPT_CPU_ISA if set, else the best this CPU has."},
    {"best_cpu_isa", py_best_cpu_isa, METH_NOARGS, "The best vector ISA path this CPU and build support."},
    {"cpu_isa_runs", py_cpu_isa_runs, METH_NOARGS,
     "{isa: number of kernel ranges its compiled copy has run since the library was loaded}"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
#endif
