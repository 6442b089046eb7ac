// The thin binding layer, on LibTorch's stable ABI (torch/csrc/stable): each op validates its
// torch::stable::Tensor arguments, describes them as plain TensorLists (kernels.h) and calls the kernels
// of one device. The op implementations below are templates over that kernel set, registered once per
// device type (registration_cpu.cpp, registration_cuda.cpp): the dispatcher picks the device from the
// tensors. The checks and conversions they share are in binding.cpp.
//
// How an op's arguments arrive (TORCH_BOX unboxes them from the schema in distopt/ops.py, in order):
//   Tensor / Tensor(a!)           const Tensor&          (written through its data pointer)
//   Tensor[] / Tensor(a!)[]       const Tensors&         (TensorHandles, below)
//   Tensor? / Tensor(a!)?         const OptionalTensor&  (std::optional<torch::stable::Tensor>)
//   float / int / bool            double / int64_t / bool
//   int? / int[]                  std::optional<int64_t> / std::vector<int64_t>
//   -> (Tensor, Tensor)           std::tuple<Tensor, Tensor>
// A new argument is a new parameter at its schema position, checked and described with the helpers
// below; the registrations need no change.
//
// Errors: an invalid argument throws std::invalid_argument (DISTOPT_CHECK) whose message starts with
// kArgumentError ("distopt: "). torch up to 2.14 turns it into Python's ValueError; 2.15 delivers every
// exception of a stable-ABI kernel as RuntimeError, and distopt/ops.py turns those that carry the prefix
// back into ValueError, so callers of distopt.ops see one exception type on every torch. The stable ABI
// has no way to raise TypeError, so a wrong dtype is a ValueError too. Everything is checked before any
// kernel runs: a refused call writes nothing.
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace distopt {

using torch::stable::Device;
using torch::stable::Tensor;
using OptionalTensor = std::optional<Tensor>;

// Note [Tensor lists across the ABI]
// An op's Tensor[] argument arrives as one C handle per tensor, which the op owns. TORCH_BOX's own
// conversion (std::vector<torch::stable::Tensor>) wraps each in a shared_ptr: a heap block, atomic counts
// and a free per tensor, about a sixth of the host time of a call over thousands of small tensors. The
// ops read each tensor's properties once through its handle (RawTensor) and need a torch::stable::Tensor
// only to name a property in an error or to make a new tensor, so they take the handles as they come
// (the ToImpl specialisation below, which TORCH_BOX uses for this type) and release them with the list.
class __attribute__((visibility("hidden"))) TensorHandles {
 public:
  explicit TensorHandles(std::vector<AtenTensorHandle> handles) : handles_(std::move(handles)) {}
  TensorHandles(TensorHandles&& other) noexcept : handles_(std::move(other.handles_)) { other.handles_.clear(); }
  TensorHandles(const TensorHandles&) = delete;
  TensorHandles& operator=(const TensorHandles&) = delete;
  TensorHandles& operator=(TensorHandles&&) = delete;
  ~TensorHandles();

  size_t size() const { return handles_.size(); }
  bool empty() const { return handles_.empty(); }
  AtenTensorHandle handle(size_t i) const { return handles_[i]; }
  // Entry i as a torch::stable::Tensor (a new reference): for errors and new outputs, not per-tensor work.
  Tensor operator[](size_t i) const;

 private:
  std::vector<AtenTensorHandle> handles_;
};
using Tensors = TensorHandles;

// Throws std::invalid_argument (Python: ValueError) with the parts streamed into one message after
// kArgumentError (kernels.h).
template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream msg;
  msg << kArgumentError;
  (msg << ... << parts);
  throw std::invalid_argument(msg.str());
}

#define DISTOPT_CHECK(cond, ...)              \
  do {                                        \
    if (!(cond)) ::distopt::fail(__VA_ARGS__); \
  } while (0)

// For messages: "cpu", "cuda:1", "float32", "[5, 3]".
std::string device_name(const Device& device);
std::string scalar_type_name(torch::headeronly::ScalarType dtype);
std::string shape_string(const Tensor& t);

// A tensor's properties as the C shim reports them, read once per op call (Note [Raw tensor properties]
// in binding.cpp): raw dtype, device and layout codes, sizes and strides borrowed from the tensor.
// Hidden like torch::stable::Tensor (torch's headers hide it), which it points to: GCC warns otherwise.
struct __attribute__((visibility("hidden"))) RawTensor {
  int32_t dtype = 0;
  int32_t device_type = 0;
  int32_t device_index = 0;
  int32_t layout = 0;
  torch::headeronly::IntHeaderOnlyArrayRef sizes;
  torch::headeronly::IntHeaderOnlyArrayRef strides;
  void* data = nullptr;
  AtenTensorHandle handle = nullptr;  // what it was read from (to name its properties in an error)

  int64_t numel() const;
};
RawTensor read_raw(AtenTensorHandle handle);
std::vector<RawTensor> read_raw(const Tensors& list);
// A new reference to the tensor `handle` refers to, as a torch::stable::Tensor (for errors).
Tensor tensor_of(AtenTensorHandle handle);

// Checks a list against the reference list (the op's first) and describes it: same length, one dtype
// of `allowed` ("float": fp32/fp16/bf16, "fp32", "int16" or "state": an Adam moment, fp32, bf16 or uint8
// codes, Note [State formats]), the reference's device, shape and strides, dense. `name` names the list
// in errors; `raw` and `ref` are read_raw(list) and read_raw(reference list).
TensorList describe(const Tensors& list, const std::vector<RawTensor>& raw, const std::vector<RawTensor>& ref,
                    const char* name, const char* allowed);

// numel of each tensor (read_raw's), the TensorLists::numel of lists described against it.
std::vector<int64_t> numels(const std::vector<RawTensor>& list);

// A float32 one-element tensor on `device` as a pointer, or nullptr when absent.
float* scalar_ptr(const OptionalTensor& t, const Device& device, const char* name);

// The value of a one-element CPU tensor of any real dtype (what Tensor.item() gives).
double cpu_scalar(const Tensor& t, const char* name);

// adam_step_'s pieces: the lists (kernels.h's AdamList order, with the 8-bit moments' absmax lists; a moment
// list may be packed, Note [Packed moments] in binding.cpp), the moments' formats (from their dtypes), the
// hyperparameters, lr and steps.
TensorLists describe_adam(const Tensors& params, const Tensors& grads, const Tensors& exp_avgs,
                          const Tensors& exp_avg_sqs, const Tensors& param_outs, const Tensors& param_remainders,
                          const Tensors& exp_avg_scales, const Tensors& exp_avg_sq_scales);
StateFormat state_format(const Tensors& states);
AdamHyper make_hyper(double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode, bool maximize);
void set_lr(AdamArgs& args, const Tensor& lr, const Device& device);
void set_steps(AdamArgs& args, const Tensors& steps, const Tensors& params);
// Stochastic rounding's seed and per-entry keys (Note [Stochastic rounding bits]): with a seed, one param
// id (0 <= id < 2^32) per entry and optionally the offset of each entry's first element within its param
// (>= 0; default 0). With 8-bit moments an offset must be a multiple of kQuantBlock, so that the entry's
// blocks are its param's blocks. Reads args' formats.
void set_rounding(AdamArgs& args, const std::optional<int64_t>& seed, const std::vector<int64_t>& param_ids,
                  const std::vector<int64_t>& param_offsets, size_t count);

// scale_'s and cast_copy_'s lists: inputs and outputs, exact aliasing allowed, partial overlap refused.
TensorLists describe_scale(const Tensors& inputs, const Tensors& outputs, const char* op);

// The kernels of each device behind one interface, so that each op is written once. Defined where they
// are registered: CpuKernels in registration_cpu.cpp (csrc/cpu), CudaKernels in registration_cuda.cpp
// (csrc/cuda on the current stream; in distopt._C_emulated, run by the SIMT emulator on CPU tensors).
//   static void adam(const Device&, const TensorLists&, const AdamArgs&);
//   static void l2norm(const Device&, const TensorLists&, float* total, float* per_tensor, float* found_inf);
//   static void scale(const Device&, const TensorLists&, const ScaleArgs&);

template <typename Kernels>
void adam_step_(const Tensors& params, const Tensors& grads, const Tensors& exp_avgs, const Tensors& exp_avg_sqs,
                const Tensors& param_outs, const Tensors& param_remainders, const Tensor& lr, const Tensors& steps,
                double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode, bool maximize,
                const OptionalTensor& grad_scale, const OptionalTensor& found_inf, const Tensors& exp_avg_scales,
                const Tensors& exp_avg_sq_scales, const std::optional<int64_t>& rounding_seed,
                const std::vector<int64_t>& param_ids, const std::vector<int64_t>& param_offsets) {
  DISTOPT_CHECK(!params.empty(), "adam_step_: expected at least one param");
  const Device device = params[0].device();
  AdamArgs args;
  args.hyper = make_hyper(beta1, beta2, eps, weight_decay, adam_w_mode, maximize);
  const TensorLists tl = describe_adam(params, grads, exp_avgs, exp_avg_sqs, param_outs, param_remainders,
                                       exp_avg_scales, exp_avg_sq_scales);
  args.exp_avg_format = state_format(exp_avgs);
  args.exp_avg_sq_format = state_format(exp_avg_sqs);
  set_rounding(args, rounding_seed, param_ids, param_offsets, params.size());
  set_lr(args, lr, device);
  set_steps(args, steps, params);
  args.grad_scale = scalar_ptr(grad_scale, device, "grad_scale");
  args.found_inf = scalar_ptr(found_inf, device, "found_inf");
  Kernels::adam(device, tl, args);
}

template <typename Kernels>
std::tuple<Tensor, Tensor> l2norm(const Tensors& tensors, const OptionalTensor& found_inf) {
  DISTOPT_CHECK(!tensors.empty(), "l2norm: expected at least one tensor");
  const Device device = tensors[0].device();
  TensorLists tl;
  const std::vector<RawTensor> raw = read_raw(tensors);
  tl.lists = {describe(tensors, raw, raw, "tensors", "float")};
  tl.numel = numels(raw);
  float* flag = scalar_ptr(found_inf, device, "found_inf");
  constexpr auto kFloat = torch::headeronly::ScalarType::Float;
  Tensor total = torch::stable::new_empty(tensors[0], {}, kFloat);
  Tensor per_tensor = torch::stable::new_empty(tensors[0], {static_cast<int64_t>(tensors.size())}, kFloat);
  Kernels::l2norm(device, tl, total.mutable_data_ptr<float>(), per_tensor.mutable_data_ptr<float>(), flag);
  return {total, per_tensor};
}

template <typename Kernels>
void scale_(const Tensors& inputs, const Tensors& outputs, const Tensor& scale, const OptionalTensor& found_inf) {
  const TensorLists tl = describe_scale(inputs, outputs, "scale_");
  const Device device = inputs[0].device();
  ScaleArgs args;
  args.scale = scalar_ptr(scale, device, "scale");
  args.found_inf_out = scalar_ptr(found_inf, device, "found_inf");
  Kernels::scale(device, tl, args);
}

template <typename Kernels>
void cast_copy_(const Tensors& inputs, const Tensors& outputs, const OptionalTensor& skip_if) {
  const TensorLists tl = describe_scale(inputs, outputs, "cast_copy_");
  const Device device = inputs[0].device();
  ScaleArgs args;
  args.skip_if = scalar_ptr(skip_if, device, "skip_if");
  Kernels::scale(device, tl, args);
}

// Registers every op with `Kernels` for the library's dispatch key (STABLE_TORCH_LIBRARY_IMPL).
template <typename Kernels>
void register_impls(torch::stable::detail::StableLibrary& m) {
  m.impl("adam_step_", TORCH_BOX(&adam_step_<Kernels>));
  m.impl("l2norm", TORCH_BOX(&l2norm<Kernels>));
  m.impl("scale_", TORCH_BOX(&scale_<Kernels>));
  m.impl("cast_copy_", TORCH_BOX(&cast_copy_<Kernels>));
}

}  // namespace distopt

// TORCH_BOX unboxes a Tensors parameter through this (Note [Tensor lists across the ABI]); the list's
// conversion, as torch's own for std::vector, with the handles kept as they are.
template <>
struct torch::stable::detail::ToImpl<distopt::TensorHandles> {
  static distopt::TensorHandles call(StableIValue val, uint64_t /*extension_build_version*/, bool /*is_internal*/) {
    auto list = torch::stable::detail::to<StableListHandle>(val);
    std::vector<AtenTensorHandle> handles;
    try {
      size_t size = 0;
      TORCH_ERROR_CODE_CHECK(torch_list_size(list, &size));
      handles.reserve(size);
      for (size_t i = 0; i < size; ++i) {
        StableIValue element;
        TORCH_ERROR_CODE_CHECK(torch_list_get_item(list, i, &element));
        handles.push_back(torch::stable::detail::to<AtenTensorHandle>(element));
      }
    } catch (...) {
      for (AtenTensorHandle h : handles) aoti_torch_delete_tensor_object(h);
      torch_delete_list(list);
      throw;
    }
    TORCH_ERROR_CODE_CHECK(torch_delete_list(list));
    return distopt::TensorHandles(std::move(handles));
  }
};
