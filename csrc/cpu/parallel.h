// The CPU kernels' one way to use threads, free of ATen: parallel_for over an index range.
//
// Implemented in the binding layer (csrc/parallel.cpp) with torch's stable parallel_for, so the kernels
// run on torch's intra-op thread pool and honour torch.set_num_threads(). The kernels only ever split work
// into disjoint index ranges whose results do not depend on where the ranges begin and end.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

namespace distopt {

// Calls body(ctx, b, e) for disjoint ranges [b, e) covering [begin, end), possibly in parallel, each
// at least `grain` long (but the last); returns when all calls have. Must not be given a body that
// throws.
using RangeFn = void (*)(void* ctx, int64_t b, int64_t e);
void parallel_for_impl(int64_t begin, int64_t end, int64_t grain, RangeFn fn, void* ctx);

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, F&& body) {
  if (begin >= end) return;
  using Body = std::remove_reference_t<F>;
  parallel_for_impl(
      begin, end, grain, [](void* ctx, int64_t b, int64_t e) { (*static_cast<Body*>(ctx))(b, e); },
      const_cast<void*>(static_cast<const void*>(&body)));
}

}  // namespace distopt
