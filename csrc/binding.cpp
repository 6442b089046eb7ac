// Argument checks and at::Tensor -> TensorList conversion for every op; see binding.h.
#include "binding.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

#include "kernels.h"

#if defined(DISTOPT_WITH_CUDA) && !defined(DISTOPT_EMULATED)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace distopt {
namespace {

DType to_dtype(at::ScalarType t, const char* what) {
  switch (t) {
    case at::kFloat: return DType::Float32;
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    case at::kShort: return DType::Int16;
    default: TORCH_CHECK_TYPE(false, what, ": unsupported dtype ", t);
  }
}

bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// Checks a list against the reference list (the op's first) and describes it. `allowed` is
// "float" (fp32/fp16/bf16), "fp32" or "int16"; every entry shares one dtype.
TensorList describe(at::TensorList list, at::TensorList ref, const char* name, const char* allowed) {
  TORCH_CHECK_VALUE(list.size() == ref.size(), name, ": expected ", ref.size(), " tensors, got ",
                    list.size());
  TensorList out;
  if (list.empty()) return out;
  const at::ScalarType dtype = list[0].scalar_type();
  const std::string kind(allowed);
  const bool ok = kind == "float" ? is_float_dtype(dtype)
                  : kind == "fp32" ? dtype == at::kFloat
                                   : dtype == at::kShort;
  TORCH_CHECK_TYPE(ok, name, ": expected ", allowed, " tensors, got ", dtype);
  out.dtype = to_dtype(dtype, name);
  out.data.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    const at::Tensor& r = ref[i];
    TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, "[", i, "]: dtype ", t.scalar_type(),
                     " differs from ", name, "[0] (", dtype, "); group tensors by dtype");
    TORCH_CHECK_VALUE(t.device() == r.device(), name, "[", i, "] is on ", t.device(), ", expected ",
                      r.device());
    TORCH_CHECK_VALUE(t.layout() == at::kStrided && !t.is_complex(), name, "[", i,
                      "]: expected a dense real tensor");
    TORCH_CHECK_VALUE(t.sizes() == r.sizes(), name, "[", i, "]: shape ", t.sizes(), " differs from ",
                      r.sizes());
    // Elements are walked in memory order, so every list must share the reference's layout.
    TORCH_CHECK_VALUE(t.is_non_overlapping_and_dense() && t.strides() == r.strides(), name, "[", i,
                      "]: expected a dense tensor with the same strides as its partners");
    out.data.push_back(t.data_ptr());
  }
  return out;
}

// A float32 scalar (numel 1) on `device`, or nullptr when absent.
float* scalar_ptr(const std::optional<at::Tensor>& t, const at::Device& device, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, name, ": expected a float32 tensor, got ",
                   t->scalar_type());
  TORCH_CHECK_VALUE(t->numel() == 1, name, ": expected one element, got ", t->numel());
  TORCH_CHECK_VALUE(t->device() == device, name, " is on ", t->device(), ", expected ", device,
                    " (where the tensors are)");
  return t->data_ptr<float>();
}

std::vector<int64_t> numels(at::TensorList list) {
  std::vector<int64_t> n;
  n.reserve(list.size());
  for (const at::Tensor& t : list) n.push_back(t.numel());
  return n;
}

// Runs `cpu()` or `cuda(stream)` for the device of the op's tensors.
template <typename Cpu, typename Cuda>
void on_device(const at::Device& device, const char* op, Cpu&& cpu, Cuda&& cuda) {
#if defined(DISTOPT_EMULATED)
  // distopt._C_emulated: CPU tensors go to the CUDA kernels, which the SIMT emulator runs.
  (void)cpu;
  if (device.is_cpu()) {
    cuda(nullptr);
    return;
  }
#else
  if (device.is_cpu()) {
    cpu();
    return;
  }
#endif
#if defined(DISTOPT_WITH_CUDA) && !defined(DISTOPT_EMULATED)
  if (device.is_cuda()) {
    const c10::cuda::CUDAGuard guard(device);
    cuda(static_cast<void*>(c10::cuda::getCurrentCUDAStream(device.index()).stream()));
    return;
  }
#else
  (void)cuda;
#endif
  TORCH_CHECK(false, "distopt::", op, ": no kernel for device ", device);
}

void adam_impl(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
               at::TensorList exp_avg_sqs, at::TensorList param_outs, at::TensorList param_remainders,
               AdamArgs& args, at::TensorList steps, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& lr) {
  TORCH_CHECK_VALUE(!params.empty(), "adam_step_: expected at least one param");
  const at::Device device = params[0].device();
  TensorLists tl;
  tl.lists.resize(kNumAdamLists);
  tl.lists[kParam] = describe(params, params, "params", "float");
  tl.lists[kGrad] = describe(grads, params, "grads", "float");
  tl.lists[kExpAvg] = describe(exp_avgs, params, "exp_avgs", "fp32");
  tl.lists[kExpAvgSq] = describe(exp_avg_sqs, params, "exp_avg_sqs", "fp32");
  if (!param_outs.empty()) {
    tl.lists[kParamOut] = describe(param_outs, params, "param_outs", "float");
    for (size_t i = 0; i < params.size(); ++i) {
      // Empty tensors all have data_ptr() == nullptr: nothing to alias, nothing to write.
      if (params[i].numel() > 0 && param_outs[i].data_ptr() == params[i].data_ptr()) {
        TORCH_CHECK_VALUE(param_outs[i].scalar_type() == params[i].scalar_type(), "param_outs[", i,
                          "] aliases params[", i, "] with another dtype");
        tl.lists[kParamOut].data[i] = nullptr;  // aliases the param: nothing more to write
      }
    }
  }
  if (!param_remainders.empty()) {
    tl.lists[kRemainder] = describe(param_remainders, params, "param_remainders", "int16");
    TORCH_CHECK_TYPE(params[0].scalar_type() == at::kBFloat16,
                     "param_remainders pair with bfloat16 params, got ", params[0].scalar_type());
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) continue;
    const void* p = params[i].data_ptr();
    TORCH_CHECK_VALUE(p != exp_avgs[i].data_ptr() && p != exp_avg_sqs[i].data_ptr() &&
                          exp_avgs[i].data_ptr() != exp_avg_sqs[i].data_ptr(),
                      "params[", i, "], exp_avgs[", i, "] and exp_avg_sqs[", i, "] must not alias");
  }
  if (!steps.empty()) {
    TORCH_CHECK_VALUE(steps.size() == params.size(), "steps: expected ", params.size(),
                      " tensors, got ", steps.size());
    args.steps.dtype = DType::Float32;
    for (size_t i = 0; i < steps.size(); ++i) {
      args.steps.data.push_back(scalar_ptr(steps[i], device, "steps[i]"));
    }
  }
  args.lr_ptr = scalar_ptr(lr, device, "lr");
  args.grad_scale = scalar_ptr(grad_scale, device, "grad_scale");
  args.found_inf = scalar_ptr(found_inf, device, "found_inf");
  tl.numel = numels(params);
  on_device(
      device, "adam_step_", [&] { adam_cpu(tl, args); },
      [&](void* stream) {
#if defined(DISTOPT_HAS_CUDA_KERNELS)
        adam_cuda(tl, args, stream);
#endif
        (void)stream;
      });
}

AdamHyper make_hyper(double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode,
                     bool maximize) {
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0 && beta2 >= 0.0 && beta2 < 1.0,
                    "betas must be in [0, 1), got (", beta1, ", ", beta2, ")");
  TORCH_CHECK_VALUE(eps >= 0.0, "eps must be >= 0, got ", eps);
  TORCH_CHECK_VALUE(weight_decay >= 0.0, "weight_decay must be >= 0, got ", weight_decay);
  AdamHyper h;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.adam_w_mode = adam_w_mode;
  h.maximize = maximize;
  return h;
}

void scale_impl(at::TensorList inputs, at::TensorList outputs, ScaleArgs& args, const char* op,
                const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& flag,
                bool flag_is_output) {
  TORCH_CHECK_VALUE(!inputs.empty(), op, ": expected at least one input");
  const at::Device device = inputs[0].device();
  TensorLists tl;
  tl.lists = {describe(inputs, inputs, "inputs", "float"), describe(outputs, inputs, "outputs", "float")};
  for (size_t i = 0; i < inputs.size(); ++i) {
    // Exact aliasing (in place) is fine: each element is read before it is written.
    const auto* in_begin = static_cast<const char*>(inputs[i].data_ptr());
    const auto* out_begin = static_cast<const char*>(outputs[i].data_ptr());
    const auto* in_end = in_begin + inputs[i].nbytes();
    const auto* out_end = out_begin + outputs[i].nbytes();
    const bool overlap = in_begin < out_end && out_begin < in_end;
    TORCH_CHECK_VALUE(!overlap || (in_begin == out_begin && inputs[i].dtype() == outputs[i].dtype()),
                      op, ": outputs[", i, "] partially overlaps inputs[", i, "]");
  }
  tl.numel = numels(inputs);
  args.scale = scalar_ptr(scale, device, "scale");
  float* f = scalar_ptr(flag, device, flag_is_output ? "found_inf" : "skip_if");
  if (flag_is_output) {
    args.found_inf_out = f;
  } else {
    args.skip_if = f;
  }
  on_device(
      device, op, [&] { scale_cpu(tl, args); },
      [&](void* stream) {
#if defined(DISTOPT_HAS_CUDA_KERNELS)
        scale_cuda(tl, args, stream);
#endif
        (void)stream;
      });
}

}  // namespace

void adam_step_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, at::TensorList param_outs, at::TensorList param_remainders,
                double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                bool adam_w_mode, const std::optional<at::Tensor>& grad_scale,
                const std::optional<at::Tensor>& found_inf, bool maximize) {
  TORCH_CHECK_VALUE(lr >= 0.0, "lr must be >= 0, got ", lr);
  TORCH_CHECK_VALUE(step >= 1, "step counts this update and must be >= 1, got ", step);
  AdamArgs args;
  args.hyper = make_hyper(beta1, beta2, eps, weight_decay, adam_w_mode, maximize);
  args.lr = lr;
  args.step = static_cast<double>(step);
  adam_impl(params, grads, exp_avgs, exp_avg_sqs, param_outs, param_remainders, args, {}, grad_scale,
            found_inf, std::nullopt);
}

void adam_step_capturable_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, at::TensorList param_outs,
                           at::TensorList param_remainders, const at::Tensor& lr, double beta1,
                           double beta2, double eps, double weight_decay, at::TensorList steps,
                           bool adam_w_mode, const std::optional<at::Tensor>& grad_scale,
                           const std::optional<at::Tensor>& found_inf, bool maximize) {
  AdamArgs args;
  args.hyper = make_hyper(beta1, beta2, eps, weight_decay, adam_w_mode, maximize);
  TORCH_CHECK_VALUE(steps.size() == params.size(), "steps: expected one step tensor per param (",
                    params.size(), "), got ", steps.size());
  adam_impl(params, grads, exp_avgs, exp_avg_sqs, param_outs, param_remainders, args, steps,
            grad_scale, found_inf, lr);
}

std::tuple<at::Tensor, at::Tensor> l2norm(at::TensorList tensors,
                                          const std::optional<at::Tensor>& found_inf) {
  TORCH_CHECK_VALUE(!tensors.empty(), "l2norm: expected at least one tensor");
  const at::Device device = tensors[0].device();
  TensorLists tl;
  tl.lists = {describe(tensors, tensors, "tensors", "float")};
  tl.numel = numels(tensors);
  const auto opts = tensors[0].options().dtype(at::kFloat);
  at::Tensor total = at::empty({}, opts);
  at::Tensor per_tensor = at::empty({static_cast<int64_t>(tensors.size())}, opts);
  float* flag = scalar_ptr(found_inf, device, "found_inf");
  on_device(
      device, "l2norm",
      [&] { l2norm_cpu(tl, total.data_ptr<float>(), per_tensor.data_ptr<float>(), flag); },
      [&](void* stream) {
#if defined(DISTOPT_HAS_CUDA_KERNELS)
        at::Tensor workspace = at::empty({l2norm_cuda_workspace_floats(tl)}, opts);
        l2norm_cuda(tl, total.data_ptr<float>(), per_tensor.data_ptr<float>(), flag,
                    workspace.data_ptr<float>(), stream);
#endif
        (void)stream;
      });
  return {total, per_tensor};
}

void scale_(at::TensorList inputs, at::TensorList outputs, const at::Tensor& scale,
            const std::optional<at::Tensor>& found_inf) {
  ScaleArgs args;
  scale_impl(inputs, outputs, args, "scale_", scale, found_inf, /*flag_is_output=*/true);
}

void cast_copy_(at::TensorList inputs, at::TensorList outputs, const std::optional<at::Tensor>& skip_if) {
  ScaleArgs args;
  scale_impl(inputs, outputs, args, "cast_copy_", std::nullopt, skip_if, /*flag_is_output=*/false);
}

}  // namespace distopt
