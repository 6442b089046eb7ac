// The thin ATen layer: op implementations that validate at::Tensor arguments, describe them as
// plain TensorLists and call the kernels of one device. Registered in registration.cpp: the
// dispatcher picks the device (CPU or CUDA) from the tensors, each registration names its kernels.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace distopt {

// Which kernels an op implementation calls: `CpuKernels` (csrc/cpu) or `CudaKernels` (csrc/cuda,
// on a CUDA device; in distopt._C_emulated, run by the SIMT emulator on CPU tensors).
struct CpuKernels;
struct CudaKernels;

template <typename Kernels>
void adam_step_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, at::TensorList param_outs, at::TensorList param_remainders,
                const at::Tensor& lr, at::TensorList steps, double beta1, double beta2, double eps,
                double weight_decay, bool adam_w_mode, bool maximize,
                const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales, std::optional<int64_t> rounding_seed,
                at::IntArrayRef param_ids, at::IntArrayRef param_offsets);

template <typename Kernels>
std::tuple<at::Tensor, at::Tensor> l2norm(at::TensorList tensors, const std::optional<at::Tensor>& found_inf);

template <typename Kernels>
void scale_(at::TensorList inputs, at::TensorList outputs, const at::Tensor& scale,
            const std::optional<at::Tensor>& found_inf);

template <typename Kernels>
void cast_copy_(at::TensorList inputs, at::TensorList outputs, const std::optional<at::Tensor>& skip_if);

}  // namespace distopt
