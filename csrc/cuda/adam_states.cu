// The eager variants of the fused Adam update with low-precision moments or stochastic rounding
// (adam_states_op.cuh) and their entry point; adam_states_capturable.cu has the capturable ones.
#include "adam_states_op.cuh"

namespace distopt::adam_detail {

void launch_states(const TensorLists& tl, const AdamArgs& args, const AdamDeviceArgs& a, cudaStream_t s) {
  StatesDeviceArgs sa;
  sa.adam = a;
  sa.keys = philox_keys(args.seed);
  sa.step_word = rounding_step(args.step);
  sa.m_format = args.exp_avg_format;
  sa.v_format = args.exp_avg_sq_format;
  sa.stochastic_rounding = args.stochastic_rounding;
  if (args.lr_ptr != nullptr || !args.steps.empty()) {
    launch_states_capturable(tl, args, sa, s);
  } else {
    launch_adam_states<false>(tl, args, sa, s);
  }
}

}  // namespace distopt::adam_detail
