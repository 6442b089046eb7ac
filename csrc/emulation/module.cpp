// distopt._C_emulated, the "cuda-emulated" test backend: the CUDA kernels of csrc/cuda compiled as
// host C++ against the SIMT emulator, behind the same binding layer, registered for CPU tensors as
// torch.ops.distopt_emulated.* (registration.cpp). This file adds the emulator's controls and
// counters, and the launch constants the tests size their tensors by.
#include <Python.h>

#include "../cuda/multi_tensor_apply.cuh"
#include "simt.h"

namespace {

PyObject* dim_tuple(dim3 d) { return Py_BuildValue("(III)", d.x, d.y, d.z); }

PyObject* stats(PyObject*, PyObject*) {
  const simt::Stats s = simt::stats();
  return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K}", "launches", s.launches, "blocks", s.blocks, "threads",
                       s.threads, "barriers", s.barriers, "warp_collectives", s.warp_collectives,
                       "shared_accesses", s.shared_accesses);
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

PyObject* constants(PyObject*, PyObject*) {
  using namespace distopt::cuda;
  PyObject* by_depth = PyTuple_New(std::size(kMaxTensorsByDepth));
  if (by_depth == nullptr) return nullptr;
  for (size_t i = 0; i < std::size(kMaxTensorsByDepth); ++i) {
    PyTuple_SET_ITEM(by_depth, static_cast<Py_ssize_t>(i), PyLong_FromLong(kMaxTensorsByDepth[i]));
  }
  return Py_BuildValue("{s:i,s:L,s:i,s:i,s:N}", "block_size", kBlockSize, "chunk_size",
                       static_cast<long long>(kChunkSize), "max_blocks", kMaxBlocks, "max_kernel_arg_bytes",
                       kMaxKernelArgBytes, "max_tensors_by_depth", by_depth);
}

PyMethodDef methods[] = {
    {"stats", stats, METH_NOARGS, "Launches, blocks, threads, barriers, ... since reset_stats()."},
    {"launches", launches, METH_NOARGS, "(kernel, grid, block) of each launch since reset_stats()."},
    {"reset_stats", reset_stats, METH_NOARGS, "Zeroes the counters and the launch log."},
    {"set_seed", set_seed, METH_O, "Seeds the scheduler (0: threads in order, no preemption)."},
    {"seed", seed, METH_NOARGS, "The scheduler's seed ($DISTOPT_SIMT_SEED, else 1, until set_seed)."},
    {"constants", constants, METH_NOARGS, "The launch constants of csrc/cuda/multi_tensor_apply.cuh."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C_emulated", nullptr, -1, methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

extern "C" PyMODINIT_FUNC PyInit__C_emulated(void) { return PyModule_Create(&module_def); }
