// What the CPU's two fused Adam traversals share, the fp32-state one (adam.cpp) and the low-precision
// one (adam_states.cpp): the call's context (coefficients, eager or per tensor from its step tensor,
// and the grad factor), one tensor's param-side lists, and the Adam loop over a contiguous piece of
// them: the shared per-element math (math/adam.h) with the params' conversions, in a loop the compiler
// vectorises, run on the moment lists themselves or on fp32 buffers of a quantisation block's moments.
// The loop body has no branches and the pointers never overlap (the binding checks aliasing; the
// buffers are the caller's), so its vector code does the scalar math's IEEE operations lane by lane.
#pragma once

#include <cstdint>

#include <vector>

#include "../common/dispatch.h"
#include "../kernels.h"
#include "../math/adam.h"
#include "isa.h"
#include "parallel.h"

namespace distopt {

// Elements [0, n) (pointers already offset); O = NoList: no param_out; rem: the int16 remainders
// when kRem. m and v are fp32, or bf16 (M): read widened and stored rounded to nearest even
// (from_float), the bf16 format's store (Note [State formats]), so bf16 moments need no fp32 buffer.
template <typename P, typename G, typename O, bool kRem, typename M = float>
DISTOPT_ALWAYS_INLINE void adam_piece(P* __restrict p, const G* __restrict g, M* __restrict m, M* __restrict v,
                                      O* __restrict out, int16_t* __restrict rem, int64_t n, const AdamCoeffs c,
                                      const float gf) {
#pragma GCC ivdep
  for (int64_t j = 0; j < n; ++j) {
    float pj;
    if constexpr (kRem) {
      pj = join_bf16_remainder(p[j], rem[j]);
    } else {
      pj = to_float(p[j]);
    }
    float mj = to_float(m[j]), vj = to_float(v[j]);
    adam_update(pj, to_float(g[j]) * gf, mj, vj, c);
    m[j] = from_float<M>(mj);
    v[j] = from_float<M>(vj);
    if constexpr (kRem) {
      split_bf16_remainder(pj, p[j], rem[j]);
    } else {
      p[j] = from_float<P>(pj);
    }
    if constexpr (is_present<O>) out[j] = from_float<O>(pj);
  }
}

// A call's context: its lists, and the coefficients of each tensor (Note [Bit-identical coefficients] in
// math/adam.h: the same function of (lr, step) as the CUDA kernels').
struct AdamCall {
  const TensorLists* tl;
  AdamHyper hyper;
  double lr;                        // the eager lr, or the capturable one read from its tensor
  double step;                      // the eager step
  const std::vector<void*>* steps;  // capturable: per-tensor float32 step scalars (else nullptr)
  AdamCoeffs coeffs;                // of (lr, step)
  float grad_scale;

  explicit AdamCall(const TensorLists& lists, const AdamArgs& args)
      : tl(&lists), hyper(args.hyper), lr(args.lr_ptr != nullptr ? static_cast<double>(*args.lr_ptr) : args.lr),
        step(args.step), steps(args.steps.empty() ? nullptr : &args.steps.data),
        coeffs(adam_coeffs(args.hyper, lr, args.step)),
        grad_scale(args.grad_scale != nullptr ? *args.grad_scale : 1.0f) {}

  // Tensor i's step (its step tensor's, or the eager one).
  double step_of(int64_t i) const {
    return steps != nullptr ? static_cast<double>(*static_cast<const float*>((*steps)[i])) : step;
  }
  // The coefficients of tensor i at step `step_i` (step_of(i)).
  AdamCoeffs coeffs_of(double step_i) const { return steps != nullptr ? adam_coeffs(hyper, lr, step_i) : coeffs; }
};

// Tensor i's param-side lists: params (and remainders), grads, param_outs (nullptr: none, or aliased).
template <typename P, typename G, typename O, bool kRem>
struct ParamLists {
  P* p;
  const G* g;
  int16_t* rem;  // kRem only
  O* out;

  DISTOPT_ALWAYS_INLINE ParamLists(const TensorLists& tl, int64_t i)
      : p(static_cast<P*>(tl.lists[kParam].data[i])), g(static_cast<const G*>(tl.lists[kGrad].data[i])),
        rem(kRem ? static_cast<int16_t*>(tl.lists[kRemainder].data[i]) : nullptr), out(nullptr) {
    if constexpr (is_present<O>) out = static_cast<O*>(tl.lists[kParamOut].data[i]);
  }

  // adam_piece over elements [lo, lo + n) with the moments m, v (fp32 or bf16, already offset).
  template <typename M>
  DISTOPT_ALWAYS_INLINE void update(int64_t lo, int64_t n, M* m, M* v, const AdamCoeffs& c, float gf) const {
    int16_t* r = kRem ? rem + lo : nullptr;
    if constexpr (is_present<O>) {
      if (out != nullptr) {
        adam_piece<P, G, O, kRem, M>(p + lo, g + lo, m, v, out + lo, r, n, c, gf);
        return;
      }
    }
    adam_piece<P, G, NoList, kRem, M>(p + lo, g + lo, m, v, nullptr, r, n, c, gf);
  }
};

// The launch both traversals share: Range<P, G, O, kRem>::run(&ctx, b, e), its types chosen by the
// params', grads' and param_outs' dtypes and whether there are remainders, over [0, total) in pieces of
// `grain` spread over torch's threads, compiled for this CPU's vector ISA. (They differ in what they
// count: adam.cpp elements, adam_states.cpp quantisation blocks.)
template <template <typename, typename, typename, bool> class Range, typename Ctx>
void run_adam_ranges(const TensorLists& tl, const Ctx& ctx, int64_t total, int64_t grain) {
  const CpuIsa isa = cpu_isa();
  dispatch_adam(tl.lists[kParam], tl.lists[kGrad], tl.lists[kParamOut], !tl.lists[kRemainder].empty(),
                [&](auto p_tag, auto g_tag, auto o_tag, auto remainders) {
                  using R = Range<typename decltype(p_tag)::type, typename decltype(g_tag)::type,
                                  typename decltype(o_tag)::type, decltype(remainders)::value>;
                  parallel_for(0, total, grain, [&](int64_t b, int64_t e) { run_for_isa<R>(isa, &ctx, b, e); });
                });
}

}  // namespace distopt
