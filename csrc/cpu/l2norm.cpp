// CPU multi-tensor L2 norm: squares in fp32 (as on the GPU), sums in double, nonfinite flag.
//
// Determinism: the result depends only on the inputs, never on the thread count, the ISA or where
// parallel_for cuts the work. Each tensor is split into blocks of kBlock elements counted from its
// start; a block's squares go, element j to lane j % kLanes, into kLanes double sums, which are added
// in a fixed pairwise tree; a tensor's square is the sum of its block sums in block order, and the
// total the sum of the per-tensor squares (rounded to fp32, as the GPU keeps them) in tensor order.
// Threads only decide which blocks they compute. The CUDA kernel sums in another order (fp32 within
// a chunk), so the two agree within NORM_RTOL, not bit for bit.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DISTOPT_L2NORM_SSE2 1
#endif

#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../common/dispatch.h"
#include "../kernels.h"
#include "flat.h"
#include "isa.h"
#include "parallel.h"

namespace distopt {
namespace {

constexpr int64_t kBlock = 4096;  // elements per block sum: one parallel_for unit
constexpr int kLanes = 16;        // independent double sums: two AVX2 fp32 vectors per step

struct NormCtx {
  const TensorLists* tl;
  const std::vector<int64_t>* block_offsets;  // flat_offsets of the per-tensor block counts
  double* block_sums;
  std::atomic<bool>* nonfinite;
};

// Sum of squares of x[0, n) in kLanes double lanes (element j into lane j % kLanes, fp32 squares,
// as on the GPU), then the lanes in a fixed pairwise tree; raises `bad` on inf/nan. One version per
// ISA with the same lane arithmetic, so they agree bit for bit.
double finish_lanes(double (&lanes)[kLanes]) {
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int k = 0; k < width; ++k) lanes[k] += lanes[k + width];
  }
  return lanes[0];
}

#if !defined(DISTOPT_L2NORM_SSE2)
// Other hosts: the same lanes in plain C++ (element j into lane j % kLanes).
double sum_squares_baseline(const float* x, int64_t n, uint32_t& bad) {
  double lanes[kLanes] = {};
  uint32_t flags = 0;
  for (int64_t j = 0; j < n; ++j) {
    flags |= (float_bits(x[j]) & 0x7f800000u) == 0x7f800000u;
    lanes[j % kLanes] += static_cast<double>(x[j] * x[j]);
  }
  bad |= flags;
  return finish_lanes(lanes);
}
#else
double sum_squares_baseline(const float* x, int64_t n, uint32_t& bad) {
  const __m128i exp_mask = _mm_set1_epi32(0x7f800000);
  __m128d acc[kLanes / 2];
  for (auto& a : acc) a = _mm_setzero_pd();
  __m128i flags = _mm_setzero_si128();
  float pad[kLanes] = {};  // the last partial step, zero-padded (zeros add exactly nothing)
  for (int64_t j = 0; j < n; j += kLanes) {
    const float* p = x + j;
    if (n - j < kLanes) {
      std::memcpy(pad, p, static_cast<size_t>(n - j) * sizeof(float));
      p = pad;
    }
    for (int q = 0; q < kLanes / 4; ++q) {
      const __m128 v = _mm_loadu_ps(p + 4 * q);
      flags = _mm_or_si128(flags, _mm_cmpeq_epi32(_mm_and_si128(_mm_castps_si128(v), exp_mask), exp_mask));
      const __m128 sq = _mm_mul_ps(v, v);
      acc[2 * q] = _mm_add_pd(acc[2 * q], _mm_cvtps_pd(sq));
      acc[2 * q + 1] = _mm_add_pd(acc[2 * q + 1], _mm_cvtps_pd(_mm_movehl_ps(sq, sq)));
    }
  }
  double lanes[kLanes];
  for (int q = 0; q < kLanes / 2; ++q) _mm_storeu_pd(lanes + 2 * q, acc[q]);
  bad |= _mm_movemask_epi8(flags) != 0;
  return finish_lanes(lanes);
}
#endif

#if defined(DISTOPT_CPU_HAS_AVX2_PATH)
// Eight elements as fp32: floats, or bf16 widened in place (the exact shift of to_float).
template <typename T>
__attribute__((target("avx2"))) inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    static_assert(std::is_same_v<T, float>);
    return _mm256_loadu_ps(p);
  }
}

template <typename T>
__attribute__((target("avx2"))) double sum_squares_avx2(const T* x, int64_t n, uint32_t& bad) {
  const __m256i exp_mask = _mm256_set1_epi32(0x7f800000);
  __m256d acc[kLanes / 4];
  for (auto& a : acc) a = _mm256_setzero_pd();
  __m256i flags = _mm256_setzero_si256();
  T pad[kLanes] = {};  // all-zero bits: +0.0 in every type
  for (int64_t j = 0; j < n; j += kLanes) {
    const T* p = x + j;
    if (n - j < kLanes) {
      std::memcpy(static_cast<void*>(pad), p, static_cast<size_t>(n - j) * sizeof(T));
      p = pad;
    }
    for (int h = 0; h < kLanes / 8; ++h) {
      const __m256 v = load8(p + 8 * h);
      flags = _mm256_or_si256(flags,
                              _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), exp_mask), exp_mask));
      const __m256 sq = _mm256_mul_ps(v, v);
      acc[2 * h] = _mm256_add_pd(acc[2 * h], _mm256_cvtps_pd(_mm256_castps256_ps128(sq)));
      acc[2 * h + 1] = _mm256_add_pd(acc[2 * h + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(sq, 1)));
    }
  }
  double lanes[kLanes];
  for (int q = 0; q < kLanes / 4; ++q) _mm256_storeu_pd(lanes + 4 * q, acc[q]);
  bad |= _mm256_movemask_epi8(flags) != 0;
  return finish_lanes(lanes);
}
#endif

template <typename T, CpuIsa kIsa>
struct NormRange {
  // Sum of the squares of x[0, n) (n <= kBlock); 16-bit inputs are widened first (exactly).
  static DISTOPT_ALWAYS_INLINE double block(const T* __restrict x, int64_t n, uint32_t& bad) {
#if defined(DISTOPT_CPU_HAS_AVX2_PATH)
    // float and bf16 straight from memory; fp16 through the buffer below.
    if constexpr (kIsa == CpuIsa::Avx2 && !std::is_same_v<T, half_t>) return sum_squares_avx2(x, n, bad);
#endif
    const float* f;
    float buf[std::is_same_v<T, float> ? 1 : kBlock];
    if constexpr (std::is_same_v<T, float>) {
      f = x;
    } else {
      for (int64_t j = 0; j < n; ++j) buf[j] = to_float(x[j]);
      f = buf;
    }
#if defined(DISTOPT_CPU_HAS_AVX2_PATH)
    if constexpr (kIsa == CpuIsa::Avx2) return sum_squares_avx2<float>(f, n, bad);
#endif
    return sum_squares_baseline(f, n, bad);
  }

  // The flat blocks [b, e).
  static DISTOPT_ALWAYS_INLINE void run(const NormCtx* ctx, int64_t b, int64_t e) {
    const std::vector<int64_t>& offsets = *ctx->block_offsets;
    uint32_t bad = 0;
    for (int64_t i = tensor_at(offsets, b); b < e; ++i) {
      const int64_t numel = ctx->tl->numel[i];
      const auto* x = static_cast<const T*>(ctx->tl->lists[0].data[i]);
      for (; b < e && b < offsets[i + 1]; ++b) {
        const int64_t start = (b - offsets[i]) * kBlock;
        const int64_t len = numel - start < kBlock ? numel - start : kBlock;
        ctx->block_sums[b] = block(x + start, len, bad);
      }
    }
    if (bad != 0) ctx->nonfinite->store(true, std::memory_order_relaxed);
  }
};

}  // namespace

void l2norm_cpu(const TensorLists& tl, float* total, float* per_tensor, float* found_inf) {
  std::vector<int64_t> blocks(tl.numel.size());
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = (tl.numel[i] + kBlock - 1) / kBlock;
  const std::vector<int64_t> block_offsets = flat_offsets(blocks);
  std::vector<double> block_sums(static_cast<size_t>(block_offsets.back()));
  std::atomic<bool> nonfinite{false};
  const NormCtx ctx{&tl, &block_offsets, block_sums.data(), &nonfinite};
  const CpuIsa isa = cpu_isa();
  dispatch_float(tl.lists[0].dtype, "l2norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    // ~8 blocks (32K elements) per range at least; a range never splits a block.
    parallel_for(0, block_offsets.back(), kGrainElements / kBlock, [&](int64_t b, int64_t e) {
      if (isa == CpuIsa::Avx2) {
        run_for_isa<NormRange<T, CpuIsa::Avx2>>(isa, &ctx, b, e);
      } else {
        run_for_isa<NormRange<T, CpuIsa::Baseline>>(isa, &ctx, b, e);
      }
    });
  });

  double total_sq = 0.0;
  for (int64_t i = 0; i < tl.size(); ++i) {
    double sq = 0.0;
    for (int64_t b = block_offsets[i]; b < block_offsets[i + 1]; ++b) sq += block_sums[b];
    per_tensor[i] = static_cast<float>(std::sqrt(sq));
    total_sq += static_cast<double>(static_cast<float>(sq));
  }
  *total = static_cast<float>(std::sqrt(total_sq));
  if (nonfinite.load() && found_inf != nullptr) *found_inf = 1.0f;
}

}  // namespace distopt
