// Fused Adam/AdamW update on CUDA: grad * grad_scale (negated with maximize), moments, bias
// correction, fp32 (or bf16 + int16 remainder) param write and the optional model-precision
// param_out copy, in one pass. The functor is in adam_op.cuh; this file has the eager variants and the
// entry point, adam_capturable.cu the variants that read lr and steps on the device, adam_states.cu
// those with low-precision moments or stochastic rounding.
#include "adam_op.cuh"

namespace distopt {

void adam_cuda(const TensorLists& tl, const AdamArgs& args, void* stream) {
  adam_detail::AdamDeviceArgs a;
  a.hyper = args.hyper;
  a.coeffs = adam_coeffs(args.hyper, args.lr, args.step);
  a.lr = args.lr;
  a.step = args.step;
  a.lr_ptr = args.lr_ptr;
  a.grad_scale = args.grad_scale;
  a.found_inf = args.found_inf;
  auto s = static_cast<cudaStream_t>(stream);
  if (!args.plain_states()) {
    adam_detail::launch_states(tl, args, a, s);
  } else if (args.lr_ptr != nullptr || !args.steps.empty()) {
    adam_detail::launch_capturable(tl, args, a, s);
  } else {
    launch_adam<false>(tl, args, a, s);
  }
}

}  // namespace distopt
