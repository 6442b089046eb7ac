// Controls of the SIMT emulator (tests/emulation/test_simt.py): deliberately broken kernels, each of
// which the emulator must reject with a specific error, and a correct block reduction it must pass.
// Built by the test with the emulated build's flags (csrc/build_config.py) against csrc/testing/simt,
// using the real vec.cuh, reduce.cuh and launch.cuh as the product kernels do. Plain C entry points
// (called through ctypes): no torch headers, so the build takes seconds.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "../../csrc/cuda/launch.cuh"
#include "../../csrc/math/state_format.h"
#include "../../csrc/cuda/reduce.cuh"
#include "../../csrc/cuda/vec.cuh"

using distopt::cuda::block_sum;
using distopt::cuda::kBlockSize;
using distopt::cuda::launch_kernel;
using distopt::cuda::load_vec;

namespace {

// Correct: out[b] = the sum of block b's x (one value per thread), by the product's block_sum.
__global__ void block_sum_kernel(const float* x, float* out) {
  const float s = block_sum(x[blockIdx.x * blockDim.x + threadIdx.x]);
  if (threadIdx.x == 0) out[blockIdx.x] = s;
}

// A half-warp mask: a reduction over 16-lane segments, but run by every lane of the warp with the mask
// of the first half (lanes 16-31 call it with a mask that leaves them out).
__global__ void half_warp_mask_kernel(const float* x, float* out) {
  float v = x[threadIdx.x];
  for (int offset = 8; offset > 0; offset /= 2) v += __shfl_down_sync(0x0000ffffu, v, offset, 16);
  if (threadIdx.x % 16 == 0) out[threadIdx.x / 16] = v;
}

// A half-warp mask used by the half warp it names, but reading the other half (offset 16).
__global__ void shuffle_outside_mask_kernel(const float* x, float* out) {
  float v = x[threadIdx.x];
  if (threadIdx.x % 32 < 16) v += __shfl_down_sync(0x0000ffffu, v, 16);
  out[threadIdx.x] = v;
}

// A missing barrier: a shared-memory tree reduction whose steps are not separated by __syncthreads.
__global__ void missing_barrier_kernel(const float* x, float* out) {
  __shared__ float partial[kBlockSize];
  partial[threadIdx.x] = x[threadIdx.x];
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    // missing: __syncthreads();
  }
  if (threadIdx.x == 0) out[0] = partial[0];
}

// A 16-byte vector load from an address 4 bytes past a 16-byte boundary.
__global__ void misaligned_vector_kernel(const float* x, float* out) {
  float r[4];
  load_vec<4>(x + 1, r);
  out[threadIdx.x] = r[0];
}

// An early return before a block reduction: half the block never reaches block_sum's barriers.
__global__ void early_return_kernel(const float* x, float* out) {
  if (threadIdx.x >= blockDim.x / 2) return;
  const float s = block_sum(x[threadIdx.x]);
  if (threadIdx.x == 0) out[0] = s;
}

// Even and odd warps wait at different __syncthreads.
__global__ void divergent_barriers_kernel(const float* x, float* out) {
  if (threadIdx.x / 32 % 2 == 0) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = x[threadIdx.x];
}

// Lanes 0-15 shuffle with the full mask while lanes 16-31 wait at a barrier: neither can go on.
__global__ void deadlock_kernel(const float* x, float* out) {
  float v = x[threadIdx.x];
  if (threadIdx.x % 32 < 16) v += __shfl_down_sync(0xffffffffu, v, 16);
  __syncthreads();
  out[threadIdx.x] = v;
}

// Reads a shared element no thread of the block wrote.
__global__ void uninitialised_shared_kernel(const float* x, float* out) {
  __shared__ float buf[64];
  if (threadIdx.x < 32) buf[threadIdx.x] = x[threadIdx.x];
  __syncthreads();
  if (threadIdx.x == 0) out[0] = buf[40];
}

// Every thread writes its index to out[0], in no defined order: the last one scheduled wins. (A race
// in global memory, which the emulator does not check: here it shows the schedule.)
__global__ void last_writer_kernel(const float* x, float* out) { out[0] = static_cast<float>(threadIdx.x); }

// Parameters over CUDA's 4 KiB limit (before 12.1), and over its 32,764-byte limit (12.1 and later).
struct Big {
  float v[1100];
};
__global__ void big_params_kernel(Big big, float* out) { out[threadIdx.x] = big.v[threadIdx.x]; }
struct Huge {
  float v[8192];
};
__global__ void huge_params_kernel(Huge huge, float* out) { out[threadIdx.x] = huge.v[threadIdx.x]; }

// Shared-memory bank conflicts (Note [Shared-memory wavefronts] in simt.h): one warp fills a 32 x 32
// table (32 row writes, one wavefront each), then makes the one access under test, whose wavefronts a
// GPU would count as the comment says.
template <int kAccess>
__global__ void banks_kernel(const float* x, float* out) {
  __shared__ float table[32 * 32];
  const int lane = threadIdx.x;
  for (int row = 0; row < 32; ++row) table[row * 32 + lane] = x[row * 32 + lane];
  __syncthreads();
  float v = 0.0f;
  if constexpr (kAccess == 0) v = table[lane];            // consecutive words: 1
  if constexpr (kAccess == 1) v = table[7];               // one word for every lane (a broadcast): 1
  if constexpr (kAccess == 2) v = table[lane * 32];       // one bank, 32 words: 32
  if constexpr (kAccess == 3) v = table[lane * 2];        // two words per bank: 2
  if constexpr (kAccess == 4) v = table[(lane % 4) * 32]; // four words of one bank, each for 8 lanes: 4
  // Wider accesses as one copy each (the host compiler splits a float4 load whose fields are used into four
  // 4-byte loads, which the emulator would see as four warp accesses).
  if constexpr (kAccess == 5) {                           // 16 bytes per lane, consecutive: 4 (a quarter warp each)
    float4 q;
    __builtin_memcpy(&q, table + 4 * lane, sizeof(q));
    v = q.x + q.y + q.z + q.w;
  }
  if constexpr (kAccess == 6) {                           // 8 bytes per lane, consecutive: 2 (a half warp each)
    float2 q;
    __builtin_memcpy(&q, table + 2 * lane, sizeof(q));
    v = q.x + q.y;
  }
  out[lane] = v;
}

// The shared-memory accesses of the 8-bit update before it read codes from bucket tables (commit
// 89b84a8): per element and moment, the map value of the old code and quantize_code's 8-step binary
// search over the 255 thresholds, both maps in one array, as the kernel laid them out. One warp, 8
// elements per lane (x: 256 values), so 8 x 32 elements per launch: its wavefronts per 32 elements
// exceed the 8-bit kernel's budget (tests/emulation/test_shared_wavefronts.py).
__global__ void binary_search_8bit_kernel(const float* x, float* out) {
  __shared__ float maps[2][2][distopt::kCodes];  // [signed, unsigned][values, thresholds]
  const int lane = threadIdx.x;
  for (int k = lane; k < distopt::kCodes; k += 32) {
    for (int s = 0; s < 2; ++s) {
      maps[s][0][k] = distopt::dynamic_map_value(s == 0, k);
      maps[s][1][k] = k + 1 < distopt::kCodes ? distopt::dynamic_map_threshold(s == 0, k) : 1e30f;
    }
  }
  __syncthreads();
  float acc = 0.0f;
  for (int e = 0; e < 8; ++e) {
    const float xi = x[lane * 8 + e];
    const uint32_t code = distopt::float_bits(xi) & 0xffu;
    const float m = maps[0][0][code], v = maps[1][0][255 - code];
    const float ym = xi * 0.25f, yv = xi * xi * 0.0625f;
    const float ym_clamped = ym < -1.0f ? -1.0f : ym > 1.0f ? 1.0f : ym;
    acc += m + v + static_cast<float>(distopt::quantize_code(ym_clamped, maps[0][1], true));
    acc += static_cast<float>(distopt::quantize_code(yv > 1.0f ? 1.0f : yv, maps[1][1], false));
  }
  out[lane] = acc;
}

int run(const std::string& name, const float* x, float* out) {
  if (name == "block_sum") {
    launch_kernel("block_sum", block_sum_kernel, 4, kBlockSize, 0, nullptr, x, out);
  } else if (name == "half_warp_mask") {
    launch_kernel("half_warp_mask", half_warp_mask_kernel, 1, 64, 0, nullptr, x, out);
  } else if (name == "shuffle_outside_mask") {
    launch_kernel("shuffle_outside_mask", shuffle_outside_mask_kernel, 1, 64, 0, nullptr, x, out);
  } else if (name == "missing_barrier") {
    launch_kernel("missing_barrier", missing_barrier_kernel, 1, kBlockSize, 0, nullptr, x, out);
  } else if (name == "misaligned_vector") {
    launch_kernel("misaligned_vector", misaligned_vector_kernel, 1, 32, 0, nullptr, x, out);
  } else if (name == "early_return") {
    launch_kernel("early_return", early_return_kernel, 1, kBlockSize, 0, nullptr, x, out);
  } else if (name == "divergent_barriers") {
    launch_kernel("divergent_barriers", divergent_barriers_kernel, 1, 128, 0, nullptr, x, out);
  } else if (name == "deadlock") {
    launch_kernel("deadlock", deadlock_kernel, 1, 64, 0, nullptr, x, out);
  } else if (name == "uninitialised_shared") {
    launch_kernel("uninitialised_shared", uninitialised_shared_kernel, 2, 64, 0, nullptr, x, out);
  } else if (name == "last_writer") {
    launch_kernel("last_writer", last_writer_kernel, 1, kBlockSize, 0, nullptr, x, out);
  } else if (name == "big_params") {
    launch_kernel("big_params", big_params_kernel, 1, 32, 0, nullptr, Big{}, out);
  } else if (name == "huge_params") {
    launch_kernel("huge_params", huge_params_kernel, 1, 32, 0, nullptr, Huge{}, out);
  } else if (name.rfind("banks_", 0) == 0) {
    static const char* const kNames[] = {"banks_consecutive", "banks_broadcast", "banks_one_bank", "banks_stride2",
                                         "banks_four_words", "banks_vector16", "banks_vector8"};
    static void (*const kKernels[])(const float*, float*) = {banks_kernel<0>, banks_kernel<1>, banks_kernel<2>,
                                                             banks_kernel<3>, banks_kernel<4>, banks_kernel<5>,
                                                             banks_kernel<6>};
    int k = 0;
    while (k < 7 && name != kNames[k]) ++k;
    if (k == 7) return 2;
    launch_kernel(kNames[k], kKernels[k], 1, 32, 0, nullptr, x, out);
  } else if (name == "binary_search_8bit") {
    launch_kernel("binary_search_8bit", binary_search_8bit_kernel, 1, 32, 0, nullptr, x, out);
  } else if (name == "empty_grid") {
    launch_kernel("empty_grid", block_sum_kernel, 0, kBlockSize, 0, nullptr, x, out);
  } else {
    return 2;
  }
  return 0;
}

}  // namespace

// Runs control `name` on x (at least 2048 floats) into out (as many) under scheduler seed `seed`.
// Returns 0, or 1 with the emulator's error message in err, or 2 for an unknown name.
extern "C" __attribute__((visibility("default"))) int distopt_simt_control(const char* name, uint64_t seed,
                                                                           const float* x, float* out, char* err,
                                                                           size_t err_len) {
  simt::set_seed(seed);
  try {
    return run(name, x, out);
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return 1;
  }
}

// The emulator's counters: launches, blocks, threads, barriers, warp collectives, shared accesses, and
// (with bank counting) shared requests and wavefronts.
extern "C" __attribute__((visibility("default"))) void distopt_simt_stats(uint64_t* out, int reset) {
  const simt::Stats s = simt::stats();
  const uint64_t values[] = {s.launches,         s.blocks,           s.threads,         s.barriers,
                             s.warp_collectives, s.shared_accesses, s.shared_requests, s.shared_wavefronts};
  std::memcpy(out, values, sizeof(values));
  if (reset) simt::reset_stats();
}

// Turns shared-memory bank counting on or off (simt::set_bank_counting).
extern "C" __attribute__((visibility("default"))) void distopt_simt_set_bank_counting(int on) {
  simt::set_bank_counting(on != 0);
}

// Sets the machine the emulator stands for (simt::set_runtime): CUDA versions and compute capability.
extern "C" __attribute__((visibility("default"))) void distopt_simt_set_runtime(int driver, int runtime, int cc_major) {
  simt::Runtime r = simt::runtime();
  r.driver_version = driver;
  r.runtime_version = runtime;
  r.cc_major = cc_major;
  simt::set_runtime(r);
}
