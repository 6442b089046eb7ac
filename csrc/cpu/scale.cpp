// CPU scale / cast copy: out = in * scale, optional nonfinite flag, optional skip flag.
#include "../common/dispatch.h"
#include "../kernels.h"

namespace distopt {

void scale_cpu(const TensorLists& tl, const ScaleArgs& args) {
  if (args.skip_if != nullptr && *args.skip_if != 0.0f) return;
  const bool scaled = args.scale != nullptr;
  const float scale = scaled ? *args.scale : 1.0f;
  dispatch_float(tl.lists[0].dtype, "scale input", [&](auto in_tag) {
    dispatch_float(tl.lists[1].dtype, "scale output", [&](auto out_tag) {
      using I = typename decltype(in_tag)::type;
      using O = typename decltype(out_tag)::type;
      bool nonfinite = false;
      for (int64_t i = 0; i < tl.size(); ++i) {
        const auto* in = static_cast<const I*>(tl.lists[0].data[i]);
        auto* out = static_cast<O*>(tl.lists[1].data[i]);
        for (int64_t j = 0; j < tl.numel[i]; ++j) {
          const float y = scaled ? to_float(in[j]) * scale : to_float(in[j]);
          const O o = from_float<O>(y);
          nonfinite |= !is_finite(to_float(o));  // the stored value: catches overflow in the cast
          out[j] = o;
        }
      }
      if (nonfinite && args.found_inf_out != nullptr) *args.found_inf_out = 1.0f;
    });
  });
}

}  // namespace distopt
