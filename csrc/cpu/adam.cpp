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
  AdamCall call;
  const std::vector<int64_t>* offsets;
};

template <typename P, typename G, typename O, bool kRem>
struct AdamRange {
  // The flat elements [b, e) (see flat.h).
  static DISTOPT_ALWAYS_INLINE void run(const AdamCtx* ctx, int64_t b, int64_t e) {
    const AdamCall& call = ctx->call;
    const TensorLists& tl = *call.tl;
    const std::vector<int64_t>& offsets = *ctx->offsets;
    for (int64_t i = tensor_at(offsets, b); b < e; ++i) {
      const int64_t first = offsets[i];
      const int64_t lo = b - first, hi = (e < offsets[i + 1] ? e : offsets[i + 1]) - first;
      b = first + hi;
      if (lo >= hi) continue;  // an empty tensor
      const AdamCoeffs c = call.coeffs_of(call.step_of(i));
      auto* m = static_cast<float*>(tl.lists[kExpAvg].data[i]) + lo;
      auto* v = static_cast<float*>(tl.lists[kExpAvgSq].data[i]) + lo;
      ParamLists<P, G, O, kRem>(tl, i).update(lo, hi - lo, m, v, c, grad_factor(call.grad_scale, c));
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
  const std::vector<int64_t> offsets = flat_offsets(tl.numel);
  const AdamCtx ctx{AdamCall(tl, args), &offsets};
  run_adam_ranges<AdamRange>(tl, ctx, offsets.back(), kGrainElements);
}

}  // namespace distopt
