// The CPU fused Adam loop over one contiguous piece of a tensor's lists: the shared per-element math
// (math/adam.h) with the params' conversions, in a loop the compiler vectorises. Used by the fp32-state
// traversal (adam.cpp) on the lists themselves and by the low-precision one (adam_states.cpp) on fp32
// buffers of a quantisation block's moments. The loop body has no branches and the pointers never
// overlap (the binding checks aliasing; the buffers are the caller's), so its vector code does the
// scalar math's IEEE operations lane by lane.
#pragma once

#include <cstdint>

#include "../common/dispatch.h"
#include "../math/adam.h"
#include "isa.h"

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

}  // namespace distopt
