// The capturable variants of the fused Adam update with low-precision moments (adam_states_op.cuh): lr
// and per-tensor steps read from device memory, coefficients and the rounding step once per block.
#include "adam_states_op.cuh"

namespace distopt::adam_detail {

void launch_states_capturable(const TensorLists& tl, const AdamArgs& args, const StatesDeviceArgs& a,
                              cudaStream_t s) {
  launch_adam_states<true>(tl, args, a, s);
}

}  // namespace distopt::adam_detail
