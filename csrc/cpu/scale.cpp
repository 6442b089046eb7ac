// CPU scale / cast copy: out = in * scale, optional nonfinite flag, optional skip flag. Vectorised
// loops (isa.h) over element ranges on torch's threads (flat.h); elementwise, so neither the ISA nor
// the thread count changes a bit.
#include <atomic>
#include <type_traits>
#include <vector>

#include "../common/dispatch.h"
#include "../kernels.h"
#include "flat.h"
#include "isa.h"
#include "parallel.h"

namespace distopt {
namespace {

struct ScaleCtx {
  const TensorLists* tl;
  const std::vector<int64_t>* offsets;
  float scale;
  std::atomic<bool>* nonfinite;
};

template <typename I, typename O, bool kScaled>
struct ScaleRange {
  // The smallest fp32 magnitude (bit pattern) that is stored as inf/nan in O: inf itself for fp32;
  // for bf16 0x7f7f8000, halfway between the largest bf16 (0x7f7f) and inf, which rounds to even,
  // that is to inf (0x7f80); for fp16 65520 (0x477ff000), halfway between 65504 (0x7bff) and 65536,
  // again rounded to even, inf (0x7c00). Above inf's pattern lie the NaNs.
  static constexpr uint32_t kNonfiniteFrom = std::is_same_v<O, float>    ? 0x7f800000u
                                             : std::is_same_v<O, bf16_t> ? 0x7f7f8000u
                                                                         : 0x477ff000u;

  // out[j] = in[j] (* scale); returns nonzero if a stored value is inf/nan (catches cast overflow).
  // That is read from the fp32 value, not from the 16-bit one: the loop then stays in 32-bit lanes
  // until the one narrowing store (comparing the narrowed bits made the vectorised loops widen them
  // back and build the output twice, which cost more than the memory traffic on some CPUs).
  static DISTOPT_ALWAYS_INLINE uint32_t piece(const I* __restrict in, O* __restrict out, int64_t n, float scale) {
    uint32_t bad = 0;
    for (int64_t j = 0; j < n; ++j) {
      const float y = kScaled ? to_float(in[j]) * scale : to_float(in[j]);
      const uint32_t magnitude = float_bits(y) & 0x7fffffffu;
      bad |= magnitude >= kNonfiniteFrom;
      // Through the 16-bit pattern: a struct store would keep the loop from vectorising.
      if constexpr (std::is_same_v<O, float>) {
        out[j] = y;
      } else if constexpr (std::is_same_v<O, bf16_t>) {
        reinterpret_cast<uint16_t*>(out)[j] = bf16_bits_from_float(y);
      } else {
        reinterpret_cast<uint16_t*>(out)[j] = half_bits_from_float(y);
      }
    }
    return bad;
  }

  static DISTOPT_ALWAYS_INLINE void run(const ScaleCtx* ctx, int64_t b, int64_t e) {
    const std::vector<int64_t>& offsets = *ctx->offsets;
    uint32_t bad = 0;
    for (int64_t i = tensor_at(offsets, b); b < e; ++i) {
      const int64_t first = offsets[i];
      const int64_t lo = b - first, hi = (e < offsets[i + 1] ? e : offsets[i + 1]) - first;
      b = first + hi;
      if (lo >= hi) continue;
      const auto* in = static_cast<const I*>(ctx->tl->lists[0].data[i]) + lo;
      auto* out = static_cast<O*>(ctx->tl->lists[1].data[i]) + lo;
      bad |= piece(in, out, hi - lo, ctx->scale);
    }
    if (bad != 0) ctx->nonfinite->store(true, std::memory_order_relaxed);
  }
};

}  // namespace

void scale_cpu(const TensorLists& tl, const ScaleArgs& args) {
  if (args.skip_if != nullptr && *args.skip_if != 0.0f) return;
  const std::vector<int64_t> offsets = flat_offsets(tl.numel);
  std::atomic<bool> nonfinite{false};
  const ScaleCtx ctx{&tl, &offsets, args.scale != nullptr ? *args.scale : 1.0f, &nonfinite};
  const CpuIsa isa = cpu_isa();
  dispatch_float(tl.lists[0].dtype, "scale input", [&](auto in_tag) {
    dispatch_float(tl.lists[1].dtype, "scale output", [&](auto out_tag) {
      using I = typename decltype(in_tag)::type;
      using O = typename decltype(out_tag)::type;
      const auto body = [&](auto range) {
        using Range = typename decltype(range)::type;
        parallel_for(0, offsets.back(), kGrainElements,
                     [&](int64_t b, int64_t e) { run_for_isa<Range>(isa, &ctx, b, e); });
      };
      if (args.scale != nullptr) {
        body(Tag<ScaleRange<I, O, true>>{});
      } else {
        body(Tag<ScaleRange<I, O, false>>{});
      }
    });
  });
  if (nonfinite.load() && args.found_inf_out != nullptr) *args.found_inf_out = 1.0f;
}

}  // namespace distopt
