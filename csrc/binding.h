// The thin ATen layer: op implementations that validate at::Tensor arguments, describe them as
// plain TensorLists and call the CPU or CUDA kernels. Registered in registration.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace distopt {

void adam_step_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, at::TensorList param_outs, at::TensorList param_remainders,
                double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                bool adam_w_mode, const std::optional<at::Tensor>& grad_scale,
                const std::optional<at::Tensor>& found_inf, bool maximize);

void adam_step_capturable_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, at::TensorList param_outs,
                           at::TensorList param_remainders, const at::Tensor& lr, double beta1,
                           double beta2, double eps, double weight_decay, at::TensorList steps,
                           bool adam_w_mode, const std::optional<at::Tensor>& grad_scale,
                           const std::optional<at::Tensor>& found_inf, bool maximize);

std::tuple<at::Tensor, at::Tensor> l2norm(at::TensorList tensors,
                                          const std::optional<at::Tensor>& found_inf);

void scale_(at::TensorList inputs, at::TensorList outputs, const at::Tensor& scale,
            const std::optional<at::Tensor>& found_inf);

void cast_copy_(at::TensorList inputs, at::TensorList outputs, const std::optional<at::Tensor>& skip_if);

}  // namespace distopt
