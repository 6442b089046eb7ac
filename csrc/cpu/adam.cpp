// CPU traversal of the fused Adam update: a plain loop over each tensor calling the shared math.
// The loop body has no branches and the lists never overlap (the binding checks aliasing), so the
// compiler vectorizes it; the results stay those of the scalar math (no FMA contraction, IEEE sqrt
// and division; -fno-math-errno only drops sqrtf's errno branch).
#include "../common/dispatch.h"
#include "../kernels.h"

namespace distopt {
namespace {

template <typename P, typename G, typename O, bool kRem>
void adam_tensor(const TensorLists& tl, int64_t i, const AdamCoeffs& c, float grad_scale) {
  const float gf = grad_factor(grad_scale, c);
  auto* p = static_cast<P*>(tl.lists[kParam].data[i]);
  const auto* g = static_cast<const G*>(tl.lists[kGrad].data[i]);
  auto* m = static_cast<float*>(tl.lists[kExpAvg].data[i]);
  auto* v = static_cast<float*>(tl.lists[kExpAvgSq].data[i]);
  O* out = nullptr;
  if constexpr (is_present<O>) out = static_cast<O*>(tl.lists[kParamOut].data[i]);
  int16_t* rem = nullptr;
  if constexpr (kRem) rem = static_cast<int16_t*>(tl.lists[kRemainder].data[i]);

  const int64_t n = tl.numel[i];
#pragma GCC ivdep
  for (int64_t j = 0; j < n; ++j) {
    float pj;
    if constexpr (kRem) {
      pj = join_bf16_remainder(p[j], rem[j]);
    } else {
      pj = to_float(p[j]);
    }
    float mj = m[j], vj = v[j];
    adam_update(pj, to_float(g[j]) * gf, mj, vj, c);
    m[j] = mj;
    v[j] = vj;
    if constexpr (kRem) {
      split_bf16_remainder(pj, p[j], rem[j]);
    } else {
      p[j] = from_float<P>(pj);
    }
    if constexpr (is_present<O>) out[j] = from_float<O>(pj);
  }
}

}  // namespace

void adam_cpu(const TensorLists& tl, const AdamArgs& args) {
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;
  const float grad_scale = args.grad_scale != nullptr ? *args.grad_scale : 1.0f;
  const double lr = args.lr_ptr != nullptr ? static_cast<double>(*args.lr_ptr) : args.lr;
  const bool has_remainder = !tl.lists[kRemainder].empty();

  dispatch_adam(tl.lists[kParam], tl.lists[kGrad], tl.lists[kParamOut], has_remainder,
                [&](auto p_tag, auto g_tag, auto o_tag, auto remainders) {
                  using P = typename decltype(p_tag)::type;
                  using G = typename decltype(g_tag)::type;
                  using O = typename decltype(o_tag)::type;
                  for (int64_t i = 0; i < tl.size(); ++i) {
                    const double step =
                        args.steps.empty() ? args.step
                                           : static_cast<double>(*static_cast<const float*>(args.steps.data[i]));
                    const AdamCoeffs c = adam_coeffs(args.hyper, lr, step);
                    constexpr bool kRem = decltype(remainders)::value;
                    if (is_present<O> && tl.lists[kParamOut].data[i] == nullptr) {
                      adam_tensor<P, G, NoList, kRem>(tl, i, c, grad_scale);  // param_out aliases the param
                    } else {
                      adam_tensor<P, G, O, kRem>(tl, i, c, grad_scale);
                    }
                  }
                });
}

}  // namespace distopt
