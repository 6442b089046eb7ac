// parallel_for of the CPU kernels (csrc/cpu/parallel.h) on torch's intra-op thread pool, through the
// stable ABI (torch::stable::parallel_for runs at::parallel_for inside libtorch, so no OpenMP here).
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <atomic>

#include "cpu/parallel.h"

namespace distopt {

void parallel_for_impl(int64_t begin, int64_t end, int64_t grain, RangeFn fn, void* ctx) {
  const int64_t n = end - begin;
  const int64_t threads = torch::stable::get_num_threads();
  grain = std::max<int64_t>(grain, 1);
  if (threads <= 1 || n <= grain) {
    fn(ctx, begin, end);
    return;
  }
  // About 8 chunks per thread (at least `grain` long), taken from a shared counter rather than one
  // fixed share per thread: a thread the OS deschedules on a busy machine delays one chunk, not half
  // the work. Inside another parallel region torch runs the whole range on the calling thread, which
  // then takes every chunk.
  const int64_t chunk = std::max(grain, (n + threads * 8 - 1) / (threads * 8));
  const int64_t chunks = (n + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  torch::stable::parallel_for(0, std::min(threads, chunks), 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(ctx, begin + c * chunk, std::min(end, begin + (c + 1) * chunk));
    }
  });
}

}  // namespace distopt
