// CPU traversal of the fused Adam update with fp32 moments: the loop of adam_loop.h, compiled for each
// vector ISA (isa.h), spread over torch's threads by element ranges (flat.h). Its vector code does the
// scalar math's IEEE operations lane by lane (no FMA contraction, IEEE sqrt and division;
// -fno-math-errno only drops sqrtf's errno branch), so neither the ISA nor the thread count changes a
// bit (Note [Host/device bit-identity] in math/adam.h). Low-precision moments and stochastic rounding:
// adam_states.cpp.
#include <vector>

#include "../common/dispatch.h"
#include "../kernels.h"
#include "adam_loop.h"
#include "flat.h"
#include "isa.h"
#include "parallel.h"

namespace distopt {
namespace {

struct AdamCtx {
  const TensorLists* tl;
  const std::vector<int64_t>* offsets;
  AdamCoeffs coeffs;  // eager: the coefficients of every tensor
  AdamHyper hyper;
  double lr;
  const std::vector<void*>* steps;  // capturable: per-tensor float32 step scalars (else nullptr)
  float grad_scale;
};

template <typename P, typename G, typename O, bool kRem>
struct AdamRange {
  // The flat elements [b, e) (see flat.h).
  static DISTOPT_ALWAYS_INLINE void run(const AdamCtx* ctx, int64_t b, int64_t e) {
    const TensorLists& tl = *ctx->tl;
    const std::vector<int64_t>& offsets = *ctx->offsets;
    for (int64_t i = tensor_at(offsets, b); b < e; ++i) {
      const int64_t first = offsets[i];
      const int64_t lo = b - first, hi = (e < offsets[i + 1] ? e : offsets[i + 1]) - first;
      b = first + hi;
      if (lo >= hi) continue;  // an empty tensor
      AdamCoeffs c = ctx->coeffs;
      if (ctx->steps != nullptr) {
        c = adam_coeffs(ctx->hyper, ctx->lr, static_cast<double>(*static_cast<const float*>((*ctx->steps)[i])));
      }
      const float gf = grad_factor(ctx->grad_scale, c);
      auto* p = static_cast<P*>(tl.lists[kParam].data[i]) + lo;
      const auto* g = static_cast<const G*>(tl.lists[kGrad].data[i]) + lo;
      auto* m = static_cast<float*>(tl.lists[kExpAvg].data[i]) + lo;
      auto* v = static_cast<float*>(tl.lists[kExpAvgSq].data[i]) + lo;
      int16_t* rem = nullptr;
      if constexpr (kRem) rem = static_cast<int16_t*>(tl.lists[kRemainder].data[i]) + lo;
      if constexpr (is_present<O>) {
        auto* out = static_cast<O*>(tl.lists[kParamOut].data[i]);
        if (out != nullptr) {
          adam_piece<P, G, O, kRem>(p, g, m, v, out + lo, rem, hi - lo, c, gf);
          continue;
        }
      }
      // No param_outs, or this entry's param_out is the param itself.
      adam_piece<P, G, NoList, kRem>(p, g, m, v, nullptr, rem, hi - lo, c, gf);
    }
  }
};

}  // namespace

void adam_cpu(const TensorLists& tl, const AdamArgs& args) {
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;
  if (!args.plain_states()) {
    adam_states_cpu(tl, args);
    return;
  }
  AdamCtx ctx;
  ctx.tl = &tl;
  const std::vector<int64_t> offsets = flat_offsets(tl.numel);
  ctx.offsets = &offsets;
  ctx.hyper = args.hyper;
  ctx.lr = args.lr_ptr != nullptr ? static_cast<double>(*args.lr_ptr) : args.lr;
  ctx.steps = args.steps.empty() ? nullptr : &args.steps.data;
  ctx.coeffs = adam_coeffs(args.hyper, ctx.lr, args.step);
  ctx.grad_scale = args.grad_scale != nullptr ? *args.grad_scale : 1.0f;
  const bool has_remainder = !tl.lists[kRemainder].empty();
  const CpuIsa isa = cpu_isa();

  dispatch_adam(tl.lists[kParam], tl.lists[kGrad], tl.lists[kParamOut], has_remainder,
                [&](auto p_tag, auto g_tag, auto o_tag, auto remainders) {
                  using Range = AdamRange<typename decltype(p_tag)::type, typename decltype(g_tag)::type,
                                          typename decltype(o_tag)::type, decltype(remainders)::value>;
                  parallel_for(0, offsets.back(), kGrainElements, [&](int64_t b, int64_t e) {
                    run_for_isa<Range>(isa, static_cast<const AdamCtx*>(&ctx), b, e);
                  });
                });
}

}  // namespace distopt
