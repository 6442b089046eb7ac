// out = in * scale on CUDA, with the nonfinite flag, and the cast copy that honours a skip flag.
#include <type_traits>

#include "../common/dispatch.h"
#include "../kernels.h"
#include "multi_tensor_apply.cuh"
#include "vec.cuh"

namespace distopt {
namespace {

using namespace cuda;

template <typename I, typename O>
struct ScaleOp {
  static constexpr int N = vec_elems<I, O>();

  __device__ static O convert(I x, float scale, bool scaled, bool& nonfinite) {
    const float y = scaled ? to_float(x) * scale : to_float(x);
    const O o = from_float<O>(y);
    nonfinite |= !is_finite(to_float(o));  // the stored value: catches overflow in the cast
    return o;
  }

  template <typename Meta>
  __device__ void operator()(const Meta& meta, ScaleArgs a) const {
    if (a.skip_if != nullptr && *a.skip_if != 0.0f) return;
    const BlockChunk<Meta> ch(meta);
    const I* in = ch.template ptr<const I>(meta, 0);
    O* out = ch.template ptr<O>(meta, 1);
    const bool scaled = a.scale != nullptr;
    const float scale = scaled ? *a.scale : 1.0f;
    bool nonfinite = false;
    int64_t done = 0;
    if (is_aligned(in) && is_aligned(out)) {
      const int64_t packs = ch.len / N;
      for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
        I r[N];
        O w[N];
        load_vec<N>(in + k * N, r);
#pragma unroll
        for (int e = 0; e < N; ++e) w[e] = convert(r[e], scale, scaled, nonfinite);
        store_vec<N>(out + k * N, w);
      }
      done = packs * N;
    }
    for (int64_t i = done + threadIdx.x; i < ch.len; i += blockDim.x) {
      out[i] = convert(in[i], scale, scaled, nonfinite);
    }
    if (a.found_inf_out != nullptr && __syncthreads_or(nonfinite) && threadIdx.x == 0) {
      *a.found_inf_out = 1.0f;
    }
  }
};

}  // namespace

void scale_cuda(const TensorLists& tl, const ScaleArgs& args, void* stream) {
  std::array<const std::vector<void*>*, 2> rows = {&tl.lists[0].data, &tl.lists[1].data};
  dispatch_float(tl.lists[0].dtype, "scale input", [&](auto in_tag) {
    dispatch_float(tl.lists[1].dtype, "scale output", [&](auto out_tag) {
      using I = typename decltype(in_tag)::type;
      using O = typename decltype(out_tag)::type;
      multi_tensor_apply<2>(rows, tl.numel, static_cast<cudaStream_t>(stream), "scale",
                            ScaleOp<I, O>{}, args);
    });
  });
}

}  // namespace distopt
