// CPU multi-tensor L2 norm: squares in fp32 (as on the GPU), sums in double, nonfinite flag.
#include <cmath>

#include "../common/dispatch.h"
#include "../kernels.h"

namespace distopt {

void l2norm_cpu(const TensorLists& tl, float* total, float* per_tensor, float* found_inf) {
  dispatch_float(tl.lists[0].dtype, "l2norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    double total_sq = 0.0;
    bool nonfinite = false;
    for (int64_t i = 0; i < tl.size(); ++i) {
      const auto* x = static_cast<const T*>(tl.lists[0].data[i]);
      double sq = 0.0;
      for (int64_t j = 0; j < tl.numel[i]; ++j) {
        const float xj = to_float(x[j]);
        nonfinite |= !is_finite(xj);
        sq += static_cast<double>(xj * xj);
      }
      per_tensor[i] = static_cast<float>(std::sqrt(sq));
      total_sq += static_cast<double>(static_cast<float>(sq));
    }
    *total = static_cast<float>(std::sqrt(total_sq));
    if (nonfinite && found_inf != nullptr) *found_inf = 1.0f;
  });
}

}  // namespace distopt
