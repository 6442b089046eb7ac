// parallel_for of the CPU kernels (csrc/cpu/parallel.h) on torch's intra-op thread pool.
#include <ATen/Parallel.h>

#include "cpu/parallel.h"

namespace distopt {

void parallel_for_impl(int64_t begin, int64_t end, int64_t grain, RangeFn fn, void* ctx) {
  // at::parallel_for runs inline when the range is below `grain`, when torch has one thread, or when
  // called from inside another parallel region; otherwise it splits the range over
  // torch.get_num_threads() threads.
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { fn(ctx, b, e); });
}

}  // namespace distopt
