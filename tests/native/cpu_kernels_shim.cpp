// A C interface to the CPU kernels (csrc/cpu), for tests/ops/test_fma_build.py, which compiles them with
// other flags (-mfma) into a plain shared library loaded with ctypes. No ATen: parallel_for is a
// serial loop over grain-sized ranges here, which also cuts the work at other places than
// at::parallel_for does.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "cpu/parallel.h"
#include "kernels.h"

namespace distopt {
void parallel_for_impl(int64_t begin, int64_t end, int64_t grain, RangeFn fn, void* ctx) {
  grain = std::max<int64_t>(grain, 1);
  for (int64_t b = begin; b < end; b += grain) fn(ctx, b, std::min(end, b + grain));
}

// The shim's builds leave out cpu/adam_states.cpp, the low-precision-moment loops: they take minutes to
// compile and shim_adam passes fp32 moments only, so adam_cpu never calls them. adam_cpu still names
// them: this stands in, and stops the process loudly if a caller ever does reach it.
void adam_states_cpu(const TensorLists&, const AdamArgs&) {
  std::fputs("cpu_kernels_shim: adam_states_cpu (8-bit/bf16 moments) is not built into the shim\n", stderr);
  std::abort();
}
}  // namespace distopt

namespace {
distopt::TensorList list(void** data, int dtype, int64_t n) {
  distopt::TensorList l;
  l.dtype = static_cast<distopt::DType>(dtype);
  if (data != nullptr) l.data.assign(data, data + n);
  return l;
}
}  // namespace

#define SHIM_API __attribute__((visibility("default")))  // the build hides everything else

extern "C" {

// lists: 6 arrays of n pointers (param, grad, exp_avg, exp_avg_sq, param_out, remainder; nullptr
// arrays for absent lists); dtypes: their distopt::DType values.
SHIM_API void shim_adam(void** lists[6], const int dtypes[6], const int64_t* numel, int64_t n, double lr, double beta1,
               double beta2, double eps, double weight_decay, int adam_w_mode, double step, const float* grad_scale) {
  distopt::TensorLists tl;
  for (int k = 0; k < 6; ++k) tl.lists.push_back(list(lists[k], dtypes[k], n));
  tl.numel.assign(numel, numel + n);
  distopt::AdamArgs args;
  args.hyper.beta1 = beta1;
  args.hyper.beta2 = beta2;
  args.hyper.eps = eps;
  args.hyper.weight_decay = weight_decay;
  args.hyper.adam_w_mode = adam_w_mode != 0;
  args.lr = lr;
  args.step = step;
  args.grad_scale = grad_scale;
  distopt::adam_cpu(tl, args);
}

SHIM_API void shim_scale(void** in, int in_dtype, void** out, int out_dtype, const int64_t* numel, int64_t n,
                const float* scale, float* found_inf) {
  distopt::TensorLists tl;
  tl.lists = {list(in, in_dtype, n), list(out, out_dtype, n)};
  tl.numel.assign(numel, numel + n);
  distopt::ScaleArgs args;
  args.scale = scale;
  args.found_inf_out = found_inf;
  distopt::scale_cpu(tl, args);
}

SHIM_API void shim_l2norm(void** data, int dtype, const int64_t* numel, int64_t n, float* total, float* per_tensor,
                 float* found_inf) {
  distopt::TensorLists tl;
  tl.lists = {list(data, dtype, n)};
  tl.numel.assign(numel, numel + n);
  distopt::l2norm_cpu(tl, total, per_tensor, found_inf);
}

}  // extern "C"
