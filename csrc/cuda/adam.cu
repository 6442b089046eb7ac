// Fused Adam/AdamW update on CUDA: grad * grad_scale (negated with maximize), moments, bias
// correction, fp32 (or bf16 + int16 remainder) param write and the optional model-precision
// param_out copy, in one pass.
#include <type_traits>

#include "../common/dispatch.h"
#include "../kernels.h"
#include "multi_tensor_apply.cuh"
#include "vec.cuh"

namespace distopt {
namespace {

using namespace cuda;

// Metadata rows: the AdamList lists plus one row of per-tensor step scalars (capturable).
constexpr int kStepRow = kNumAdamLists;
constexpr int kDepth = kNumAdamLists + 1;

struct AdamDeviceArgs {
  AdamHyper hyper;
  AdamCoeffs coeffs;         // eager: precomputed on the host
  float lr;                  // eager lr (used with a per-tensor step)
  float step;                // eager step (used with a device lr)
  const float* lr_ptr;       // capturable lr
  const float* grad_scale;
  const float* found_inf;
};

template <typename P, typename G, typename O, bool kRem>
struct AdamOp {
  static_assert(!kRem || std::is_same_v<P, bf16_t>, "remainders pair with bf16 params");
  using Meta = TensorListMetadata<kDepth>;
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

  __device__ void operator()(const Meta& meta, const AdamDeviceArgs& a) const {
    if (a.found_inf != nullptr && *a.found_inf != 0.0f) return;
    const BlockChunk<Meta> ch(meta);
    P* p = ch.template ptr<P>(meta, kParam);
    const G* g = ch.template ptr<const G>(meta, kGrad);
    float* m = ch.template ptr<float>(meta, kExpAvg);
    float* v = ch.template ptr<float>(meta, kExpAvgSq);
    OutT* out = nullptr;  // stays nullptr for entries whose param_out aliases the param
    if constexpr (is_present<O>) out = ch.template ptr<OutT>(meta, kParamOut);
    int16_t* rem = nullptr;
    if constexpr (kRem) rem = ch.template ptr<int16_t>(meta, kRemainder);
    const auto* step_ptr = static_cast<const float*>(meta.addresses[kStepRow][ch.slot]);

    AdamCoeffs c = a.coeffs;
    if (a.lr_ptr != nullptr || step_ptr != nullptr) {
      const double lr = a.lr_ptr != nullptr ? *a.lr_ptr : a.lr;
      const double step = step_ptr != nullptr ? *step_ptr : a.step;
      c = adam_coeffs(a.hyper, lr, step);
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

}  // namespace

void adam_cuda(const TensorLists& tl, const AdamArgs& args, void* stream) {
  AdamDeviceArgs a;
  a.hyper = args.hyper;
  a.coeffs = adam_coeffs(args.hyper, args.lr, args.step);
  a.lr = static_cast<float>(args.lr);
  a.step = static_cast<float>(args.step);
  a.lr_ptr = args.lr_ptr;
  a.grad_scale = args.grad_scale;
  a.found_inf = args.found_inf;

  std::array<const std::vector<void*>*, kDepth> rows;
  for (int d = 0; d < kNumAdamLists; ++d) rows[d] = &tl.lists[d].data;
  rows[kStepRow] = &args.steps.data;
  const bool has_remainder = !tl.lists[kRemainder].empty();
  auto s = static_cast<cudaStream_t>(stream);

  dispatch_adam(tl.lists[kParam], tl.lists[kGrad], tl.lists[kParamOut], has_remainder,
                [&](auto p_tag, auto g_tag, auto o_tag, auto remainders) {
                  using P = typename decltype(p_tag)::type;
                  using G = typename decltype(g_tag)::type;
                  using O = typename decltype(o_tag)::type;
                  cuda::multi_tensor_apply<kDepth>(rows, tl.numel, s, "adam",
                                                   AdamOp<P, G, O, decltype(remainders)::value>{}, a);
                });
}

}  // namespace distopt
