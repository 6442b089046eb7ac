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
constexpr int kLanes = 16;        // independent double sums: two AVX2 (one AVX-512) fp32 vectors per step

struct NormCtx {
  const TensorLists* tl;
  const std::vector<int64_t>* block_offsets;  // flat_offsets of the per-tensor block counts
  double* block_sums;
  std::atomic<bool>* nonfinite;
};

// Sum of squares of x[0, n) in kLanes double lanes (element j into lane j % kLanes, fp32 squares,
// as on the GPU), then the lanes in a fixed pairwise tree. One version per ISA with the same lane
// arithmetic, so they agree bit for bit.
double finish_lanes(double (&lanes)[kLanes]) {
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int k = 0; k < width; ++k) lanes[k] += lanes[k + width];
  }
  return lanes[0];
}

#if !defined(DISTOPT_L2NORM_SSE2)
// Other hosts: the same lanes in plain C++ (element j into lane j % kLanes).
double sum_squares_baseline(const float* x, int64_t n) {
  double lanes[kLanes] = {};
  for (int64_t j = 0; j < n; ++j) lanes[j % kLanes] += static_cast<double>(x[j] * x[j]);
  return finish_lanes(lanes);
}
#else
double sum_squares_baseline(const float* x, int64_t n) {
  __m128d acc[kLanes / 2];
  for (auto& a : acc) a = _mm_setzero_pd();
  float pad[kLanes] = {};  // the last partial step, zero-padded (zeros add exactly nothing)
  for (int64_t j = 0; j < n; j += kLanes) {
    const float* p = x + j;
    if (n - j < kLanes) {
      std::memcpy(pad, p, static_cast<size_t>(n - j) * sizeof(float));
      p = pad;
    }
    for (int q = 0; q < kLanes / 4; ++q) {
      const __m128 v = _mm_loadu_ps(p + 4 * q);
      const __m128 sq = _mm_mul_ps(v, v);
      acc[2 * q] = _mm_add_pd(acc[2 * q], _mm_cvtps_pd(sq));
      acc[2 * q + 1] = _mm_add_pd(acc[2 * q + 1], _mm_cvtps_pd(_mm_movehl_ps(sq, sq)));
    }
  }
  double lanes[kLanes];
  for (int q = 0; q < kLanes / 2; ++q) _mm_storeu_pd(lanes + 2 * q, acc[q]);
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
__attribute__((target("avx2"))) double sum_squares_avx2(const T* x, int64_t n) {
  __m256d acc[kLanes / 4];
  for (auto& a : acc) a = _mm256_setzero_pd();
  T pad[kLanes] = {};  // all-zero bits: +0.0 in every type
  for (int64_t j = 0; j < n; j += kLanes) {
    const T* p = x + j;
    if (n - j < kLanes) {
      std::memcpy(static_cast<void*>(pad), p, static_cast<size_t>(n - j) * sizeof(T));
      p = pad;
    }
    for (int h = 0; h < kLanes / 8; ++h) {
      const __m256 v = load8(p + 8 * h);
      const __m256 sq = _mm256_mul_ps(v, v);
      acc[2 * h] = _mm256_add_pd(acc[2 * h], _mm256_cvtps_pd(_mm256_castps256_ps128(sq)));
      acc[2 * h + 1] = _mm256_add_pd(acc[2 * h + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(sq, 1)));
    }
  }
  double lanes[kLanes];
  for (int q = 0; q < kLanes / 4; ++q) _mm256_storeu_pd(lanes + 4 * q, acc[q]);
  return finish_lanes(lanes);
}
#endif

#if defined(DISTOPT_CPU_HAS_AVX512_PATH)
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 intrinsics initialise their result from _mm*_undefined_*(), which its
// -Wmaybe-uninitialized misreads (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// Sixteen elements as fp32 (fewer: the rest zero), as load8 does.
template <typename T>
DISTOPT_AVX512_TARGET inline __m512 load16(const T* p, __mmask16 valid) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    const __m256i h = _mm256_maskz_loadu_epi16(valid, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    static_assert(std::is_same_v<T, float>);
    return _mm512_maskz_loadu_ps(valid, p);
  }
}

// The AVX2 version's lanes in two registers: acc0 holds lanes 0-7, acc1 lanes 8-15, so each lane
// adds the same squares in the same order (the masked load zero-fills the last partial step).
template <typename T>
DISTOPT_AVX512_TARGET double sum_squares_avx512(const T* x, int64_t n) {
  static_assert(kLanes == 16);
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  for (int64_t j = 0; j < n; j += kLanes) {
    const __mmask16 valid = n - j >= kLanes ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (n - j)) - 1u);
    const __m512 v = load16(x + j, valid);
    const __m512 sq = _mm512_mul_ps(v, v);
    acc0 = _mm512_add_pd(acc0, _mm512_cvtps_pd(_mm512_castps512_ps256(sq)));
    acc1 = _mm512_add_pd(acc1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sq), 1))));
  }
  double lanes[kLanes];
  _mm512_storeu_pd(lanes, acc0);
  _mm512_storeu_pd(lanes + 8, acc1);
  return finish_lanes(lanes);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

template <typename T, CpuIsa kIsa>
struct NormRange {
  // Sum of the squares of x[0, n) (n <= kBlock); 16-bit inputs are widened first (exactly).
  static DISTOPT_ALWAYS_INLINE double block(const T* __restrict x, int64_t n) {
    // float and bf16 straight from memory; fp16 through the buffer below.
#if defined(DISTOPT_CPU_HAS_AVX512_PATH)
    if constexpr (kIsa == CpuIsa::Avx512 && !std::is_same_v<T, half_t>) return sum_squares_avx512(x, n);
#endif
#if defined(DISTOPT_CPU_HAS_AVX2_PATH)
    if constexpr (kIsa == CpuIsa::Avx2 && !std::is_same_v<T, half_t>) return sum_squares_avx2(x, n);
#endif
    const float* f;
    float buf[std::is_same_v<T, float> ? 1 : kBlock];
    if constexpr (std::is_same_v<T, float>) {
      f = x;
    } else {
      for (int64_t j = 0; j < n; ++j) buf[j] = to_float(x[j]);
      f = buf;
    }
#if defined(DISTOPT_CPU_HAS_AVX512_PATH)
    if constexpr (kIsa == CpuIsa::Avx512) return sum_squares_avx512<float>(f, n);
#endif
#if defined(DISTOPT_CPU_HAS_AVX2_PATH)
    if constexpr (kIsa == CpuIsa::Avx2) return sum_squares_avx2<float>(f, n);
#endif
    return sum_squares_baseline(f, n);
  }

  // Whether x[0, n) holds an inf or nan (the exponent bits all ones; widening keeps them).
  static DISTOPT_ALWAYS_INLINE bool any_nonfinite(const T* __restrict x, int64_t n) {
    uint32_t flags = 0;
    for (int64_t j = 0; j < n; ++j) flags |= (float_bits(to_float(x[j])) & 0x7f800000u) == 0x7f800000u;
    return flags != 0;
  }

  // The flat blocks [b, e).
  static DISTOPT_ALWAYS_INLINE void run(const NormCtx* ctx, int64_t b, int64_t e) {
    const std::vector<int64_t>& offsets = *ctx->block_offsets;
    bool bad = false;
    for (int64_t i = tensor_at(offsets, b); b < e; ++i) {
      const int64_t numel = ctx->tl->numel[i];
      const auto* x = static_cast<const T*>(ctx->tl->lists[0].data[i]);
      for (; b < e && b < offsets[i + 1]; ++b) {
        const int64_t start = (b - offsets[i]) * kBlock;
        const int64_t len = numel - start < kBlock ? numel - start : kBlock;
        const double sum = block(x + start, len);
        ctx->block_sums[b] = sum;
        if (!std::isfinite(sum) && !bad) bad = any_nonfinite(x + start, len);
      }
    }
    if (bad) ctx->nonfinite->store(true, std::memory_order_relaxed);
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
      switch (isa) {
        case CpuIsa::Avx512: run_for_isa<NormRange<T, CpuIsa::Avx512>>(isa, &ctx, b, e); break;
        case CpuIsa::Avx2: run_for_isa<NormRange<T, CpuIsa::Avx2>>(isa, &ctx, b, e); break;
        case CpuIsa::Baseline: run_for_isa<NormRange<T, CpuIsa::Baseline>>(isa, &ctx, b, e); break;
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
