// The fused Adam/AdamW update on CUDA as a per-chunk functor (AdamOp) and its launch, shared by the
// eager (adam.cu) and capturable (adam_capturable.cu) translation units, which nvcc compiles in
// parallel: each holds 96 kernel instantiations (48 dtype variants x two metadata sizes).
#pragma once

#include <array>
#include <type_traits>
#include <vector>

#include "../common/dispatch.h"
#include "../kernels.h"
#include "multi_tensor_apply.cuh"
#include "vec.cuh"

namespace distopt {
namespace adam_detail {

// The update's arguments as the kernels take them (one type for both translation units).
struct AdamDeviceArgs {
  AdamHyper hyper;           // capturable: the coefficients are computed on the device from these
  AdamCoeffs coeffs;         // eager: precomputed on the host
  double lr;                 // lr when there is no lr_ptr (with per-tensor steps)
  double step;               // step of entries without a step tensor (with a device lr)
  const float* lr_ptr;       // capturable lr
  const float* grad_scale;
  const float* found_inf;
};

// adam_capturable.cu: the capturable variants, in their own translation unit.
void launch_capturable(const TensorLists& tl, const AdamArgs& args, const AdamDeviceArgs& a, cudaStream_t s);
// adam_states.cu: the low-precision-moment variants (adam_states_op.cuh), when !args.plain_states().
void launch_states(const TensorLists& tl, const AdamArgs& args, const AdamDeviceArgs& a, cudaStream_t s);

}  // namespace adam_detail

namespace {

using namespace cuda;
using adam_detail::AdamDeviceArgs;

// Note [Capturable coefficients once per block]
// The capturable variant reads lr and the tensor's step from device memory, so its coefficients
// cannot all come from the host. Thread 0 of each block computes them with adam_coeffs, the very
// function the eager path runs on the host, and shares them through shared memory: one double-precision
// computation per block (~1 us before the first load) instead of one per thread. Eager and capturable
// steps are bit-identical by construction: adam_coeffs uses only IEEE-754 basic operations
// (Note [Bit-identical coefficients] in math/adam.h), never a libm function whose last bit could
// differ between glibc and the CUDA math library.
//
// Metadata rows of a variant: params, grads, exp_avgs, exp_avg_sqs, then param_outs, remainders and
// per-tensor steps only where the variant has them (Note [Multi-tensor launch metadata]: fewer rows,
// more tensors per launch).
template <typename P, typename G, typename O, bool kRem, bool kCap>
struct AdamOp {
  static_assert(!kRem || std::is_same_v<P, bf16_t>, "remainders pair with bf16 params");
  static constexpr int kOutRow = 4;
  static constexpr int kRemRow = kOutRow + (is_present<O> ? 1 : 0);
  static constexpr int kStepRow = kRemRow + (kRem ? 1 : 0);
  static constexpr int kDepth = kStepRow + (kCap ? 1 : 0);
  using OutT = std::conditional_t<is_present<O>, O, float>;
  static constexpr int N = vec_elems<P, G, OutT, std::conditional_t<kRem, int16_t, float>>();
  static constexpr int kMomentPack = kVecBytes / sizeof(float);

  __device__ static float load_param(P p, int16_t r) {
    if constexpr (kRem) {
      return join_bf16_remainder(p, r);
    } else {
      return to_float(p);
    }
  }

  __device__ static void store_param(float x, P& p, int16_t& r) {
    if constexpr (kRem) {
      split_bf16_remainder(x, p, r);
    } else {
      p = from_float<P>(x);
    }
  }

  template <typename Meta>
  __device__ void operator()(const Meta& meta, const AdamDeviceArgs& a) const {
    if (a.found_inf != nullptr && *a.found_inf != 0.0f) return;  // uniform: every thread returns
    const BlockChunk<Meta> ch(meta);
    P* p = ch.template ptr<P>(meta, 0);
    const G* g = ch.template ptr<const G>(meta, 1);
    float* m = ch.template ptr<float>(meta, 2);
    float* v = ch.template ptr<float>(meta, 3);
    OutT* out = nullptr;  // stays nullptr for entries whose param_out aliases the param
    if constexpr (is_present<O>) out = ch.template ptr<OutT>(meta, kOutRow);
    int16_t* rem = nullptr;
    if constexpr (kRem) rem = ch.template ptr<int16_t>(meta, kRemRow);

    AdamCoeffs c = a.coeffs;
    if constexpr (kCap) {  // Note [Capturable coefficients once per block]
      // Only the lr- and step-dependent coefficients go through shared memory: the others are the
      // same for every (lr, step), and read from the kernel parameters they are instruction operands
      // that take no registers (all ten from shared memory spill at the 64-register cap).
      __shared__ float block_coeffs[3];
      if (threadIdx.x == 0) {
        const auto* step_ptr = static_cast<const float*>(meta.addresses[kStepRow][ch.slot]);
        const double lr = a.lr_ptr != nullptr ? static_cast<double>(*a.lr_ptr) : a.lr;
        const double step = step_ptr != nullptr ? static_cast<double>(*step_ptr) : a.step;
        const AdamCoeffs d = adam_coeffs(a.hyper, lr, step);
        block_coeffs[0] = d.decay;
        block_coeffs[1] = d.step_size;
        block_coeffs[2] = d.bc2_sqrt;
      }
      __syncthreads();
      c.decay = block_coeffs[0];
      c.step_size = block_coeffs[1];
      c.bc2_sqrt = block_coeffs[2];
    }
    const float gs = grad_factor(a.grad_scale != nullptr ? *a.grad_scale : 1.0f, c);

    int64_t done = 0;
    const bool aligned = is_aligned(p) && is_aligned(g) && is_aligned(m) && is_aligned(v) &&
                         (out == nullptr || is_aligned(out)) && (rem == nullptr || is_aligned(rem));
    if (aligned) {
      const int64_t packs = ch.len / N;
      // Blocks have kBlockSize threads (multi_tensor_apply): a constant stride, where blockDim.x
      // would hold a register that ptxas spills at the 64-register cap.
      for (int64_t k = threadIdx.x; k < packs; k += kBlockSize) {
        const int64_t i = k * N;
        P rp[N];
        G rg[N];
        int16_t rr[N] = {};
        OutT ro[N];
        load_vec<N>(p + i, rp);
        load_vec<N>(g + i, rg);
        if constexpr (kRem) load_vec<N>(rem + i, rr);
        // The fp32 moments one 16-byte pack at a time: with N = 8 (a 16-bit list) loading all of
        // them at once needs more registers than two resident blocks per SM leave (64).
#pragma unroll
        for (int h = 0; h < N; h += kMomentPack) {
          float rm[kMomentPack], rv[kMomentPack];
          load_vec<kMomentPack>(m + i + h, rm);
          load_vec<kMomentPack>(v + i + h, rv);
#pragma unroll
          for (int e = 0; e < kMomentPack; ++e) {
            float x = load_param(rp[h + e], rr[h + e]);
            adam_update(x, to_float(rg[h + e]) * gs, rm[e], rv[e], c);
            store_param(x, rp[h + e], rr[h + e]);
            ro[h + e] = from_float<OutT>(x);
          }
          store_vec<kMomentPack>(m + i + h, rm);
          store_vec<kMomentPack>(v + i + h, rv);
        }
        store_vec<N>(p + i, rp);
        if constexpr (kRem) store_vec<N>(rem + i, rr);
        if (out != nullptr) store_vec<N>(out + i, ro);
      }
      done = packs * N;
    }
    // Unaligned chunks and the tail: coalesced scalar accesses, N per thread in flight.
    for (int64_t base = done; base < ch.len; base += static_cast<int64_t>(kBlockSize) * N) {
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const int64_t i = base + static_cast<int64_t>(e) * kBlockSize + threadIdx.x;
        if (i >= ch.len) break;
        int16_t r = 0;
        if constexpr (kRem) r = rem[i];
        float x = load_param(p[i], r);
        float mi = m[i], vi = v[i];
        adam_update(x, to_float(g[i]) * gs, mi, vi, c);
        m[i] = mi;
        v[i] = vi;
        P pi;
        store_param(x, pi, r);
        p[i] = pi;
        if constexpr (kRem) rem[i] = r;
        if (out != nullptr) out[i] = from_float<OutT>(x);
      }
    }
  }
};

// Launches the eager (kCap false) or capturable variant of every list dtype combination.
template <bool kCap>
void launch_adam(const TensorLists& tl, const AdamArgs& args, const AdamDeviceArgs& a, cudaStream_t s) {
  auto run = [&](auto op) {
    using Op = decltype(op);
    // The variant's rows (see AdamOp): the four lists every update has, then the optional ones.
    std::array<const std::vector<void*>*, Op::kDepth> rows;
    for (int d = 0; d < 4; ++d) rows[d] = &tl.lists[d].data;
    if constexpr (Op::kOutRow < Op::kRemRow) rows[Op::kOutRow] = &tl.lists[kParamOut].data;
    if constexpr (Op::kRemRow < Op::kStepRow) rows[Op::kRemRow] = &tl.lists[kRemainder].data;
    if constexpr (Op::kStepRow < Op::kDepth) rows[Op::kStepRow] = &args.steps.data;
    cuda::multi_tensor_apply<Op::kDepth>(rows, tl.numel, s, "adam", op, a);
  };
  static_assert(kParam == 0 && kGrad == 1 && kExpAvg == 2 && kExpAvgSq == 3, "AdamOp reads rows 0-3 as these");
  dispatch_adam(tl.lists[kParam], tl.lists[kGrad], tl.lists[kParamOut], !tl.lists[kRemainder].empty(),
                [&](auto p_tag, auto g_tag, auto o_tag, auto remainders) {
                  using P = typename decltype(p_tag)::type;
                  using G = typename decltype(g_tag)::type;
                  using O = typename decltype(o_tag)::type;
                  run(AdamOp<P, G, O, decltype(remainders)::value, kCap>{});
                });
}

}  // namespace
}  // namespace distopt
