// What the CUDA fused Adam updates share, the fp32-moment one (adam_op.cuh) and the low-precision-moment
// one (adam_states_op.cuh): their arguments, the rows of their launch metadata, the param's load and
// store, the capturable variants' per-block coefficients, and the launch of every dtype combination.
#pragma once

#include <array>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/dispatch.h"
#include "../kernels.h"
#include "../math/philox.h"
#include "multi_tensor_apply.cuh"
#include "vec.cuh"

namespace distopt {
namespace adam_detail {

// The update's arguments as the kernels take them (one type for every translation unit).
struct AdamDeviceArgs {
  AdamHyper hyper;           // capturable: the coefficients are computed on the device from these
  AdamCoeffs coeffs;         // eager: precomputed on the host
  double lr;                 // lr when there is no lr_ptr (with per-tensor steps)
  double step;               // step of entries without a step tensor (with a device lr)
  const float* lr_ptr;       // capturable lr
  const float* grad_scale;
  const float* found_inf;
};

// adam_capturable.cu: the fp32-moment capturable variants, in their own translation unit.
void launch_capturable(const TensorLists& tl, const AdamArgs& args, const AdamDeviceArgs& a, cudaStream_t s);
// adam_states.cu: the low-precision-moment variants (adam_states_op.cuh), when !args.plain_states().
void launch_states(const TensorLists& tl, const AdamArgs& args, const AdamDeviceArgs& a, cudaStream_t s);

}  // namespace adam_detail

namespace {

using namespace cuda;
using adam_detail::AdamDeviceArgs;

// Note [Adam launch rows]
// The metadata rows of a variant: params, grads, exp_avgs, exp_avg_sqs, then param_outs, remainders
// and per-tensor steps only where the variant has them (Note [Multi-tensor launch metadata]: fewer
// rows, more tensors per launch), then kExtra rows of the op's own (the low-precision op's scales and
// stochastic-rounding keys).
template <typename O, bool kRem, bool kCap, int kExtra = 0>
struct AdamRows {
  static constexpr int kOutRow = 4;
  static constexpr int kRemRow = kOutRow + (is_present<O> ? 1 : 0);
  static constexpr int kStepRow = kRemRow + (kRem ? 1 : 0);
  static constexpr int kExtraRow = kStepRow + (kCap ? 1 : 0);
  static constexpr int kDepth = kExtraRow + kExtra;
  static_assert(kParam == 0 && kGrad == 1 && kExpAvg == 2 && kExpAvgSq == 3, "rows 0-3 are these lists");
};

// The stored param as fp32 (bf16 + remainder: the fp32 master), and the fp32 value stored back.
template <bool kRem, typename P>
__device__ __forceinline__ float load_param(P p, int16_t r) {
  if constexpr (kRem) {
    return join_bf16_remainder(p, r);
  } else {
    return to_float(p);
  }
}

template <bool kRem, typename P>
__device__ __forceinline__ void store_param(float x, P& p, int16_t& r) {
  if constexpr (kRem) {
    split_bf16_remainder(x, p, r);
  } else {
    p = from_float<P>(x);
  }
}

// Note [Capturable coefficients once per block]
// The capturable variant reads lr and the tensor's step from device memory, so its coefficients
// cannot all come from the host. Thread 0 of each block computes them with adam_coeffs, the very
// function the eager path runs on the host, and shares them through shared memory: one double-precision
// computation per block (~1 us before the first load) instead of one per thread. Eager and capturable
// steps are bit-identical by construction: adam_coeffs uses only IEEE-754 basic operations
// (Note [Bit-identical coefficients] in math/adam.h), never a libm function whose last bit could
// differ between glibc and the CUDA math library. Only the lr- and step-dependent coefficients go
// through shared memory: the others are the same for every (lr, step), and read from the kernel
// parameters they are instruction operands that take no registers. The step's stochastic-rounding
// counter word comes along (rounding_step, math/philox.h).
struct BlockCoeffs {
  AdamCoeffs c;
  uint32_t step_word;  // the rounding counter's step word
};

// The coefficients of the calling block's tensor; eager: the host's, and `eager_step_word`. Every thread
// calls it (capturable: it has a barrier).
template <bool kCap, typename Meta>
__device__ __forceinline__ BlockCoeffs block_coeffs(const Meta& meta, int slot, int step_row, const AdamDeviceArgs& a,
                                                    uint32_t eager_step_word) {
  BlockCoeffs out{a.coeffs, eager_step_word};
  if constexpr (kCap) {
    __shared__ float shared_coeffs[3];
    __shared__ uint32_t shared_step;
    if (threadIdx.x == 0) {
      const auto* step_ptr = static_cast<const float*>(meta.addresses[step_row][slot]);
      const double lr = a.lr_ptr != nullptr ? static_cast<double>(*a.lr_ptr) : a.lr;
      const double step = step_ptr != nullptr ? static_cast<double>(*step_ptr) : a.step;
      const AdamCoeffs d = adam_coeffs(a.hyper, lr, step);
      shared_coeffs[0] = d.decay;
      shared_coeffs[1] = d.step_size;
      shared_coeffs[2] = d.bc2_sqrt;
      shared_step = rounding_step(step);
    }
    __syncthreads();
    out.c.decay = shared_coeffs[0];
    out.c.step_size = shared_coeffs[1];
    out.c.bc2_sqrt = shared_coeffs[2];
    out.step_word = shared_step;
  }
  return out;
}

// Launches Op<P, G, O, kRem, kCap> for the lists' dtype combination (the one dtype dispatch,
// common/dispatch.h), with the rows of Note [Adam launch rows] and `extra` as the op's own rows.
template <template <typename, typename, typename, bool, bool> class Op, bool kCap, size_t kExtra, typename Args>
void launch_adam_op(const TensorLists& tl, const AdamArgs& args, const char* what,
                    const std::array<const std::vector<void*>*, kExtra>& extra, const Args& a, cudaStream_t s) {
  dispatch_adam(tl.lists[kParam], tl.lists[kGrad], tl.lists[kParamOut], !tl.lists[kRemainder].empty(),
                [&](auto p_tag, auto g_tag, auto o_tag, auto remainders) {
                  using P = typename decltype(p_tag)::type;
                  using G = typename decltype(g_tag)::type;
                  using O = typename decltype(o_tag)::type;
                  using OpT = Op<P, G, O, decltype(remainders)::value, kCap>;
                  using Rows = typename OpT::Rows;
                  static_assert(Rows::kDepth == Rows::kExtraRow + static_cast<int>(kExtra), "extra rows");
                  std::array<const std::vector<void*>*, Rows::kDepth> rows{};
                  for (int d = 0; d < 4; ++d) rows[d] = &tl.lists[d].data;
                  if constexpr (Rows::kOutRow < Rows::kRemRow) rows[Rows::kOutRow] = &tl.lists[kParamOut].data;
                  if constexpr (Rows::kRemRow < Rows::kStepRow) rows[Rows::kRemRow] = &tl.lists[kRemainder].data;
                  if constexpr (Rows::kStepRow < Rows::kExtraRow) rows[Rows::kStepRow] = &args.steps.data;
                  for (size_t k = 0; k < kExtra; ++k) rows[Rows::kExtraRow + k] = extra[k];
                  cuda::multi_tensor_apply<Rows::kDepth>(rows, tl.numel, s, what, OpT{}, a);
                });
}

}  // namespace
}  // namespace distopt
