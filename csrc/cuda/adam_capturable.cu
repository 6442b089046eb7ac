// The capturable variants of the fused Adam update (adam_op.cuh): lr and per-tensor steps read from
// device memory, coefficients computed once per block (Note [Capturable coefficients once per block]).
#include "adam_op.cuh"

namespace distopt::adam_detail {

void launch_capturable(const TensorLists& tl, const AdamArgs& args, const AdamDeviceArgs& a, cudaStream_t s) {
  launch_adam<true>(tl, args, a, s);
}

}  // namespace distopt::adam_detail
