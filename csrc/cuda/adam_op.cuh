// The fused Adam/AdamW update on CUDA as a per-chunk functor (AdamOp) and its launch, shared by the
// eager (adam.cu) and capturable (adam_capturable.cu) translation units, which nvcc compiles in
// parallel: each holds 96 kernel instantiations (48 dtype variants x two metadata sizes).
#pragma once

#include <type_traits>

#include "adam_common.cuh"

namespace distopt {
namespace {

template <typename P, typename G, typename O, bool kRem, bool kCap>
struct AdamOp {
  static_assert(!kRem || std::is_same_v<P, bf16_t>, "remainders pair with bf16 params");
  using Rows = AdamRows<O, kRem, kCap>;  // Note [Adam launch rows]
  static constexpr int kDepth = Rows::kDepth;
  using OutT = std::conditional_t<is_present<O>, O, float>;
  static constexpr int N = vec_elems<P, G, OutT, std::conditional_t<kRem, int16_t, float>>();
  static constexpr int kMomentPack = kVecBytes / sizeof(float);

  template <typename Meta>
  __device__ void operator()(const Meta& meta, const AdamDeviceArgs& a) const {
    if (a.found_inf != nullptr && *a.found_inf != 0.0f) return;  // uniform: every thread returns
    const BlockChunk<Meta> ch(meta);
    P* p = ch.template ptr<P>(meta, 0);
    const G* g = ch.template ptr<const G>(meta, 1);
    float* m = ch.template ptr<float>(meta, 2);
    float* v = ch.template ptr<float>(meta, 3);
    OutT* out = nullptr;  // stays nullptr for entries whose param_out aliases the param
    if constexpr (is_present<O>) out = ch.template ptr<OutT>(meta, Rows::kOutRow);
    int16_t* rem = nullptr;
    if constexpr (kRem) rem = ch.template ptr<int16_t>(meta, Rows::kRemRow);

    // Note [Capturable coefficients once per block] (adam_common.cuh)
    const AdamCoeffs c = block_coeffs<kCap>(meta, ch.slot, Rows::kStepRow, a, 0).c;
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
            float x = load_param<kRem>(rp[h + e], rr[h + e]);
            adam_update(x, to_float(rg[h + e]) * gs, rm[e], rv[e], c);
            store_param<kRem>(x, rp[h + e], rr[h + e]);
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
        float x = load_param<kRem>(p[i], r);
        float mi = m[i], vi = v[i];
        adam_update(x, to_float(g[i]) * gs, mi, vi, c);
        m[i] = mi;
        v[i] = vi;
        P pi;
        store_param<kRem>(x, pi, r);
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
  launch_adam_op<AdamOp, kCap, 0>(tl, args, "adam", {}, a, s);
}

}  // namespace
}  // namespace distopt
