// distopt._C: the CPU kernels (csrc/cpu) registered for CPU tensors. The schemas themselves are defined
// in distopt/ops.py, so the pure-PyTorch fallback and these kernels share them. Built on the stable ABI
// and the Python limited API (one abi3 module for every supported torch and Python).
#include <Python.h>

#include <stdexcept>

#include "binding.h"
#include "cpu/isa.h"

namespace distopt {

struct CpuKernels {
  static void adam(const Device&, const TensorLists& tl, const AdamArgs& args) { adam_cpu(tl, args); }
  static void l2norm(const Device&, const TensorLists& tl, float* total, float* per_tensor, float* found_inf) {
    l2norm_cpu(tl, total, per_tensor, found_inf);
  }
  static void scale(const Device&, const TensorLists& tl, const ScaleArgs& args) { scale_cpu(tl, args); }
};

}  // namespace distopt

STABLE_TORCH_LIBRARY_IMPL(distopt, CPU, m) { distopt::register_impls<distopt::CpuKernels>(m); }

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

PyObject* py_cpu_vbmi(PyObject*, PyObject*) { return PyBool_FromLong(distopt::cpu_vbmi()); }

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
    {"cpu_vbmi", py_cpu_vbmi, METH_NOARGS,
     "Whether the AVX-512 path reads 8-bit moments with AVX512-VBMI now (the CPU has it, DISTOPT_CPU_ISA auto)."},
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
