// distopt._C_emulated, the "cuda-emulated" test backend: the CUDA kernels of csrc/cuda compiled as
// host C++ against the SIMT emulator, behind the same binding layer, registered for CPU tensors as
// torch.ops.distopt_emulated.* (registration_cuda.cpp). This file adds the emulator's controls and
// counters, and the launch constants the tests size their tensors by.
#include <Python.h>

#include "../../cuda/multi_tensor_apply.cuh"
#include "simt.h"

namespace {

PyObject* dim_tuple(dim3 d) { return Py_BuildValue("(III)", d.x, d.y, d.z); }

PyObject* stats(PyObject*, PyObject*) {
  const simt::Stats s = simt::stats();
  return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "launches", s.launches, "blocks", s.blocks, "threads",
                       s.threads, "barriers", s.barriers, "warp_collectives", s.warp_collectives,
                       "shared_accesses", s.shared_accesses, "shared_requests", s.shared_requests,
                       "shared_wavefronts", s.shared_wavefronts);
}

PyObject* launches(PyObject*, PyObject*) {
  const std::vector<simt::LaunchRecord> log = simt::launch_log();
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(log.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < log.size(); ++i) {
    PyObject* item = Py_BuildValue("(sNN)", log[i].what.c_str(), dim_tuple(log[i].grid), dim_tuple(log[i].block));
    if (item == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
  }
  return list;
}

PyObject* reset_stats(PyObject*, PyObject*) {
  simt::reset_stats();
  Py_RETURN_NONE;
}

PyObject* set_seed(PyObject*, PyObject* arg) {
  const unsigned long long s = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return nullptr;
  simt::set_seed(s);
  Py_RETURN_NONE;
}

PyObject* seed(PyObject*, PyObject*) { return PyLong_FromUnsignedLongLong(simt::seed()); }

PyObject* set_bank_counting(PyObject*, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  simt::set_bank_counting(on != 0);
  Py_RETURN_NONE;
}

// {"tensors": (by depth 1..7), "blocks": (by depth)} of one metadata size.
template <bool kLarge>
PyObject* limits_dict() {
  using namespace distopt::cuda;
  PyObject* tensors = PyTuple_New(kMaxDepth);
  PyObject* blocks = PyTuple_New(kMaxDepth);
  if (tensors == nullptr || blocks == nullptr) {
    Py_XDECREF(tensors);
    Py_XDECREF(blocks);
    return nullptr;
  }
  for (int d = 1; d <= kMaxDepth; ++d) {
    const MetaLimits l = kLarge ? large_limits(d) : small_limits(d);
    PyTuple_SET_ITEM(tensors, d - 1, PyLong_FromLong(l.tensors));
    PyTuple_SET_ITEM(blocks, d - 1, PyLong_FromLong(l.blocks));
  }
  return Py_BuildValue("{s:N,s:N}", "tensors", tensors, "blocks", blocks);
}

// The launch constants, and the metadata limits of the path the emulated runtime selects now.
PyObject* constants(PyObject*, PyObject*) {
  using namespace distopt::cuda;
  const bool large = large_kernel_params();
  PyObject* active = large ? limits_dict<true>() : limits_dict<false>();
  if (active == nullptr) return nullptr;
  PyObject* by_depth = PyDict_GetItemString(active, "tensors");
  PyObject* blocks = PyDict_GetItemString(active, "blocks");
  PyObject* out = Py_BuildValue("{s:i,s:L,s:O,s:i,s:O,s:O,s:N,s:N}", "block_size", kBlockSize, "chunk_size",
                                static_cast<long long>(kChunkSize), "large_kernel_params", large ? Py_True : Py_False,
                                "max_kernel_arg_bytes", large ? kLargeKernelParamBytes : kSmallKernelParamBytes,
                                "max_tensors_by_depth", by_depth, "max_blocks_by_depth", blocks, "small",
                                limits_dict<false>(), "large", limits_dict<true>());
  Py_DECREF(active);
  return out;
}

PyObject* runtime(PyObject*, PyObject*) {
  const simt::Runtime r = simt::runtime();
  return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:n}", "driver_version", r.driver_version, "runtime_version",
                       r.runtime_version, "cc_major", r.cc_major, "cc_minor", r.cc_minor, "multiprocessors",
                       r.multiprocessors, "max_param_bytes", static_cast<Py_ssize_t>(simt::max_param_bytes()));
}

PyObject* set_runtime(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"driver_version", "runtime_version", "cc_major", "cc_minor", "multiprocessors",
                                   nullptr};
  simt::Runtime r = simt::runtime();
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|iiiii", const_cast<char**>(keywords), &r.driver_version,
                                   &r.runtime_version, &r.cc_major, &r.cc_minor, &r.multiprocessors)) {
    return nullptr;
  }
  simt::set_runtime(r);
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"stats", stats, METH_NOARGS, "Launches, blocks, threads, barriers, ... since reset_stats()."},
    {"launches", launches, METH_NOARGS, "(kernel, grid, block) of each launch since reset_stats()."},
    {"reset_stats", reset_stats, METH_NOARGS, "Zeroes the counters and the launch log."},
    {"set_seed", set_seed, METH_O, "Seeds the scheduler (0: threads in order, no preemption)."},
    {"seed", seed, METH_NOARGS, "The scheduler's seed ($DISTOPT_SIMT_SEED, else 1, until set_seed)."},
    {"set_bank_counting", set_bank_counting, METH_O,
     "Counts shared-memory requests and wavefronts (bank conflicts) from the next launch on."},
    {"constants", constants, METH_NOARGS, "The launch constants of csrc/cuda/multi_tensor_apply.cuh."},
    {"runtime", runtime, METH_NOARGS, "The emulated machine: versions, compute capability, parameter limit."},
    {"set_runtime", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(set_runtime)),
     METH_VARARGS | METH_KEYWORDS, "Sets what the emulated machine reports (keywords as runtime() returns)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C_emulated", nullptr, -1, methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

extern "C" PyMODINIT_FUNC PyInit__C_emulated(void) { return PyModule_Create(&module_def); }
