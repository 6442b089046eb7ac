// Probe kernels for tools/hot_loops.py (never part of the build): the shipped fused Adam functors of
// csrc/cuda, compiled with the launch arguments that pick a moment format made compile-time constants,
// so that each kernel's vector loop is the code the shipped kernel runs for that format (its formats
// are warp-uniform launch arguments, branched on around that code). fp32 params and grads, no
// param_outs, eager, 4 KiB metadata. Compiled against a csrc/ given on the include path (-I<csrc>), so
// the same probes read an older tree too (the negative controls in tests/tooling/test_hot_loops.py).
#include "cuda/adam_op.cuh"
#include "cuda/adam_states_op.cuh"

namespace distopt {
namespace {

template <typename P>
using StatesOp = AdamStatesOp<P, float, NoList, false, false>;
template <typename P>
using StatesMeta = cuda::TensorListMetadata<StatesOp<P>::kDepth, false>;
using PlainOp = AdamOp<float, float, NoList, false, false>;

}  // namespace

#define DISTOPT_STATES_PROBE(name, P, M, V, SR)                                                               \
  extern "C" __global__ void __launch_bounds__(cuda::kBlockSize, cuda::kMinBlocksPerSM)                       \
      name(const StatesMeta<P> meta, adam_detail::StatesDeviceArgs a) {                                       \
    a.m_format = StateFormat::M;                                                                              \
    a.v_format = StateFormat::V;                                                                              \
    a.stochastic_rounding = SR;                                                                               \
    StatesOp<P>{}(meta, a);                                                                                   \
  }

DISTOPT_STATES_PROBE(probe_bf16, float, BFloat16, BFloat16, false)
DISTOPT_STATES_PROBE(probe_bf16_sr, float, BFloat16, BFloat16, true)
DISTOPT_STATES_PROBE(probe_8bit, float, Blockwise8, Blockwise8, false)
DISTOPT_STATES_PROBE(probe_bf16_sr_bf16p, bf16_t, BFloat16, BFloat16, true)
DISTOPT_STATES_PROBE(probe_8bit_sr_bf16p, bf16_t, Blockwise8, Blockwise8, true)

// The fp32-moment update, for comparison (its dtypes are its only template arguments).
extern "C" __global__ void __launch_bounds__(cuda::kBlockSize, cuda::kMinBlocksPerSM)
    probe_fp32(const cuda::TensorListMetadata<PlainOp::kDepth, false> meta, adam_detail::AdamDeviceArgs a) {
  PlainOp{}(meta, a);
}

}  // namespace distopt
