// Argument checks and at::Tensor -> TensorList conversion for every op; see binding.h.
#include "binding.h"

#include <ATen/ops/empty.h>
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
    case at::kByte: return DType::UInt8;
    default: TORCH_CHECK_TYPE(false, what, ": unsupported dtype ", t);
  }
}

bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// Checks a list against the reference list (the op's first) and describes it. `allowed` is
// "float" (fp32/fp16/bf16), "fp32", "int16" or "state" (an Adam moment: fp32, bf16 or uint8 codes,
// Note [State formats]); every entry shares one dtype.
TensorList describe(at::TensorList list, at::TensorList ref, const char* name, const char* allowed) {
  TORCH_CHECK_VALUE(list.size() == ref.size(), name, ": expected ", ref.size(), " tensors, got ",
                    list.size());
  TensorList out;
  if (list.empty()) return out;
  const at::ScalarType dtype = list[0].scalar_type();
  const std::string kind(allowed);
  const bool ok = kind == "float"   ? is_float_dtype(dtype)
                  : kind == "fp32"  ? dtype == at::kFloat
                  : kind == "state" ? (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kByte)
                                    : dtype == at::kShort;
  TORCH_CHECK_TYPE(ok, name, ": expected ", kind == "state" ? "fp32, bf16 or uint8 (8-bit blockwise)" : allowed,
                   " tensors, got ", dtype);
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

}  // namespace

// The kernels of each device behind one interface, so each op is written once (a template) and
// registered per device type (registration.cpp). distopt._C_emulated has only the CUDA ones.
#if !defined(DISTOPT_EMULATED)
struct CpuKernels {
  static void adam(const at::Device&, const TensorLists& tl, const AdamArgs& args) { adam_cpu(tl, args); }
  static void l2norm(const at::Device&, const TensorLists& tl, float* total, float* per_tensor, float* found_inf) {
    l2norm_cpu(tl, total, per_tensor, found_inf);
  }
  static void scale(const at::Device&, const TensorLists& tl, const ScaleArgs& args) { scale_cpu(tl, args); }
};
#endif

#if defined(DISTOPT_HAS_CUDA_KERNELS)
struct CudaKernels {
  // Runs `launch(stream)` on the current stream of `device` (in the emulator: CPU tensors, no stream).
  template <typename Launch>
  static void on_stream(const at::Device& device, Launch&& launch) {
#if defined(DISTOPT_EMULATED)
    (void)device;
    launch(nullptr);
#else
    TORCH_CHECK_VALUE(device.is_cuda(), "expected CUDA tensors, got tensors on ", device);
    const c10::cuda::CUDAGuard guard(device);
    launch(static_cast<void*>(c10::cuda::getCurrentCUDAStream(device.index()).stream()));
#endif
  }
  static void adam(const at::Device& device, const TensorLists& tl, const AdamArgs& args) {
    on_stream(device, [&](void* stream) { adam_cuda(tl, args, stream); });
  }
  static void l2norm(const at::Device& device, const TensorLists& tl, float* total, float* per_tensor,
                     float* found_inf) {
    const at::Tensor workspace =
        at::empty({l2norm_cuda_workspace_floats(tl)}, at::TensorOptions().dtype(at::kFloat).device(device));
    on_stream(device, [&](void* stream) {
      l2norm_cuda(tl, total, per_tensor, found_inf, workspace.data_ptr<float>(), stream);
    });
  }
  static void scale(const at::Device& device, const TensorLists& tl, const ScaleArgs& args) {
    on_stream(device, [&](void* stream) { scale_cuda(tl, args, stream); });
  }
};
#endif

namespace {

// lr: on the CPU it is read now (an eager step); on the params' device the kernel reads it (a
// capturable step: no host sync; a captured graph replays with the value it holds then).
void set_lr(AdamArgs& args, const at::Tensor& lr, const at::Device& device) {
  if (!lr.is_cpu()) {
    args.lr_ptr = scalar_ptr(lr, device, "lr");
    return;
  }
  TORCH_CHECK_VALUE(lr.numel() == 1, "lr: expected one element, got ", lr.numel());
  args.lr = lr.item<double>();
  TORCH_CHECK_VALUE(args.lr >= 0.0, "lr must be >= 0, got ", args.lr);
}

// steps count this update (>= 1): one for every entry, or one per entry. A single step on the CPU is
// read now (an eager step); otherwise they are float32 scalars on the params' device, read by the
// kernel (the same tensor may appear for many entries).
void set_steps(AdamArgs& args, at::TensorList steps, size_t count, const at::Device& device) {
  TORCH_CHECK_VALUE(steps.size() == 1 || steps.size() == count,
                    "steps: expected one step tensor, or one per param (", count, "), got ", steps.size());
  if (steps.size() == 1 && steps[0].is_cpu()) {
    TORCH_CHECK_VALUE(steps[0].numel() == 1, "steps[0]: expected one element, got ", steps[0].numel());
    args.step = steps[0].item<double>();
    TORCH_CHECK_VALUE(args.step >= 1.0, "step counts this update and must be >= 1, got ", args.step);
    return;
  }
  args.steps.dtype = DType::Float32;
  args.steps.data.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    args.steps.data.push_back(scalar_ptr(steps[steps.size() == 1 ? 0 : i], device, "steps[i]"));
  }
}

StateFormat state_format(at::TensorList states) {
  if (states.empty() || states[0].scalar_type() == at::kFloat) return StateFormat::Float32;
  return states[0].scalar_type() == at::kBFloat16 ? StateFormat::BFloat16 : StateFormat::Blockwise8;
}

// The absmax list of an 8-bit moment list (one fp32 per kQuantBlock elements of each entry, contiguous,
// beside its codes); empty for the other formats.
TensorList describe_scales(at::TensorList scales, at::TensorList states, const char* name, const char* states_name) {
  const bool quantized = state_format(states) == StateFormat::Blockwise8;
  if (!quantized) {
    TORCH_CHECK_VALUE(scales.empty(), name, ": only 8-bit (uint8) ", states_name, " have scales, got ",
                      scales.size(), " tensors for ", states.empty() ? "none" : c10::toString(states[0].scalar_type()));
    return TensorList{};
  }
  TORCH_CHECK_VALUE(scales.size() == states.size(), name, ": expected one absmax tensor per entry of ", states_name,
                    " (", states.size(), "), got ", scales.size());
  TensorList out;
  out.dtype = DType::Float32;
  for (size_t i = 0; i < scales.size(); ++i) {
    const at::Tensor& t = scales[i];
    const int64_t blocks = (states[i].numel() + kQuantBlock - 1) / kQuantBlock;
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, "[", i, "]: expected float32, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.device() == states[i].device(), name, "[", i, "] is on ", t.device(), ", expected ",
                      states[i].device());
    TORCH_CHECK_VALUE(t.numel() == blocks && t.is_contiguous(), name, "[", i, "]: expected ", blocks,
                      " contiguous elements (one per ", kQuantBlock, " of ", states_name, "[", i, "]), got ",
                      t.numel());
    TORCH_CHECK_VALUE(blocks == 0 || t.data_ptr() != states[i].data_ptr(), name, "[", i, "] must not alias ",
                      states_name, "[", i, "]");
    out.data.push_back(t.data_ptr());
  }
  return out;
}

// Checks and describes the lists of an adam_step_ call (see kernels.h for their roles).
TensorLists describe_adam(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, at::TensorList param_outs, at::TensorList param_remainders,
                          at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales) {
  TensorLists tl;
  tl.lists.resize(kNumAdamLists);
  tl.lists[kParam] = describe(params, params, "params", "float");
  tl.lists[kGrad] = describe(grads, params, "grads", "float");
  tl.lists[kExpAvg] = describe(exp_avgs, params, "exp_avgs", "state");
  tl.lists[kExpAvgSq] = describe(exp_avg_sqs, params, "exp_avg_sqs", "state");
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
  tl.lists[kExpAvgScale] = describe_scales(exp_avg_scales, exp_avgs, "exp_avg_scales", "exp_avgs");
  tl.lists[kExpAvgSqScale] = describe_scales(exp_avg_sq_scales, exp_avg_sqs, "exp_avg_sq_scales", "exp_avg_sqs");
  for (size_t i = 0; i < exp_avg_scales.size() && i < exp_avg_sq_scales.size(); ++i) {
    TORCH_CHECK_VALUE(exp_avg_scales[i].numel() == 0 || exp_avg_scales[i].data_ptr() != exp_avg_sq_scales[i].data_ptr(),
                      "exp_avg_scales[", i, "] and exp_avg_sq_scales[", i, "] must not alias");
  }
  tl.numel = numels(params);
  return tl;
}

// Stochastic rounding's seed and per-entry keys (Note [Stochastic rounding bits]): with a seed, one
// param id (0 <= id < 2^32) per entry and optionally the offset of each entry's first element within
// its param (>= 0; default 0). With 8-bit moments an offset must be a multiple of kQuantBlock, so the
// entry's blocks are its param's blocks. Reads args' formats.
void set_rounding(AdamArgs& args, std::optional<int64_t> seed, at::IntArrayRef param_ids,
                  at::IntArrayRef param_offsets, size_t count) {
  TORCH_CHECK_VALUE(param_ids.empty() || param_ids.size() == count, "param_ids: expected one id per param (",
                    count, "), got ", param_ids.size());
  TORCH_CHECK_VALUE(param_offsets.empty() || param_offsets.size() == count,
                    "param_offsets: expected one offset per param (", count, "), got ", param_offsets.size());
  const bool blockwise =
      args.exp_avg_format == StateFormat::Blockwise8 || args.exp_avg_sq_format == StateFormat::Blockwise8;
  for (size_t i = 0; i < param_offsets.size(); ++i) {
    TORCH_CHECK_VALUE(param_offsets[i] >= 0, "param_offsets[", i, "] must be >= 0, got ", param_offsets[i]);
    TORCH_CHECK_VALUE(!blockwise || param_offsets[i] % kQuantBlock == 0, "param_offsets[", i, "] = ",
                      param_offsets[i], ": with 8-bit moments an entry must start at a multiple of ", kQuantBlock,
                      " elements of its param (its quantisation blocks are the param's)");
  }
  if (!seed.has_value()) return;
  TORCH_CHECK_VALUE(param_ids.size() == count, "stochastic rounding (a rounding seed) needs param_ids: one id per param (",
                    count, "), got ", param_ids.size());
  args.stochastic_rounding = true;
  args.seed = static_cast<uint64_t>(*seed);
  for (size_t i = 0; i < count; ++i) {
    TORCH_CHECK_VALUE(param_ids[i] >= 0 && param_ids[i] <= 0xffffffffLL, "param_ids[", i,
                      "] must be in [0, 2^32), got ", param_ids[i]);
    args.param_ids.push_back(static_cast<uint32_t>(param_ids[i]));
  }
  for (const int64_t offset : param_offsets) args.param_offsets.push_back(static_cast<uint64_t>(offset));
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

// Checks and describes the lists of a scale_/cast_copy_ call.
TensorLists describe_scale(at::TensorList inputs, at::TensorList outputs, const char* op) {
  TORCH_CHECK_VALUE(!inputs.empty(), op, ": expected at least one input");
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
  return tl;
}

}  // namespace

template <typename Kernels>
void adam_step_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, at::TensorList param_outs, at::TensorList param_remainders,
                const at::Tensor& lr, at::TensorList steps, double beta1, double beta2, double eps,
                double weight_decay, bool adam_w_mode, bool maximize,
                const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales, std::optional<int64_t> rounding_seed,
                at::IntArrayRef param_ids, at::IntArrayRef param_offsets) {
  TORCH_CHECK_VALUE(!params.empty(), "adam_step_: expected at least one param");
  const at::Device device = params[0].device();
  AdamArgs args;
  args.hyper = make_hyper(beta1, beta2, eps, weight_decay, adam_w_mode, maximize);
  const TensorLists tl = describe_adam(params, grads, exp_avgs, exp_avg_sqs, param_outs, param_remainders,
                                       exp_avg_scales, exp_avg_sq_scales);
  args.exp_avg_format = state_format(exp_avgs);
  args.exp_avg_sq_format = state_format(exp_avg_sqs);
  set_rounding(args, rounding_seed, param_ids, param_offsets, params.size());
  set_lr(args, lr, device);
  set_steps(args, steps, params.size(), device);
  args.grad_scale = scalar_ptr(grad_scale, device, "grad_scale");
  args.found_inf = scalar_ptr(found_inf, device, "found_inf");
  Kernels::adam(device, tl, args);
}

template <typename Kernels>
std::tuple<at::Tensor, at::Tensor> l2norm(at::TensorList tensors, const std::optional<at::Tensor>& found_inf) {
  TORCH_CHECK_VALUE(!tensors.empty(), "l2norm: expected at least one tensor");
  const at::Device device = tensors[0].device();
  TensorLists tl;
  tl.lists = {describe(tensors, tensors, "tensors", "float")};
  tl.numel = numels(tensors);
  const auto opts = tensors[0].options().dtype(at::kFloat);
  at::Tensor total = at::empty({}, opts);
  at::Tensor per_tensor = at::empty({static_cast<int64_t>(tensors.size())}, opts);
  float* flag = scalar_ptr(found_inf, device, "found_inf");
  Kernels::l2norm(device, tl, total.data_ptr<float>(), per_tensor.data_ptr<float>(), flag);
  return {total, per_tensor};
}

template <typename Kernels>
void scale_(at::TensorList inputs, at::TensorList outputs, const at::Tensor& scale,
            const std::optional<at::Tensor>& found_inf) {
  const TensorLists tl = describe_scale(inputs, outputs, "scale_");
  const at::Device device = inputs[0].device();
  ScaleArgs args;
  args.scale = scalar_ptr(scale, device, "scale");
  args.found_inf_out = scalar_ptr(found_inf, device, "found_inf");
  Kernels::scale(device, tl, args);
}

template <typename Kernels>
void cast_copy_(at::TensorList inputs, at::TensorList outputs, const std::optional<at::Tensor>& skip_if) {
  const TensorLists tl = describe_scale(inputs, outputs, "cast_copy_");
  const at::Device device = inputs[0].device();
  ScaleArgs args;
  args.skip_if = scalar_ptr(skip_if, device, "skip_if");
  Kernels::scale(device, tl, args);
}

// The instantiations registration.cpp registers.
#define DISTOPT_INSTANTIATE(Kernels)                                                                      \
  template void adam_step_<Kernels>(at::TensorList, at::TensorList, at::TensorList, at::TensorList,      \
                                    at::TensorList, at::TensorList, const at::Tensor&, at::TensorList,    \
                                    double, double, double, double, bool, bool,                           \
                                    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,   \
                                    at::TensorList, at::TensorList, std::optional<int64_t>,               \
                                    at::IntArrayRef, at::IntArrayRef);                                    \
  template std::tuple<at::Tensor, at::Tensor> l2norm<Kernels>(at::TensorList,                             \
                                                              const std::optional<at::Tensor>&);          \
  template void scale_<Kernels>(at::TensorList, at::TensorList, const at::Tensor&,                       \
                                const std::optional<at::Tensor>&);                                        \
  template void cast_copy_<Kernels>(at::TensorList, at::TensorList, const std::optional<at::Tensor>&);

#if !defined(DISTOPT_EMULATED)
DISTOPT_INSTANTIATE(CpuKernels)
#endif
#if defined(DISTOPT_HAS_CUDA_KERNELS)
DISTOPT_INSTANTIATE(CudaKernels)
#endif

}  // namespace distopt
