// SIMT emulator: compiles the unmodified CUDA kernels of csrc/cuda as host C++ and runs them on the
// CPU, one fiber per CUDA thread, blocks one after another, while checking what a GPU would not report:
//
//   * barrier divergence: threads of a block waiting at different __syncthreads call sites, or some
//     threads exiting while others wait at a barrier;
//   * warp collectives (__shfl_*_sync, __ballot_sync, ...) whose mask does not match the lanes that
//     call them: the caller missing from its mask, lanes of one call site passing different masks,
//     a shuffle reading a lane outside the mask, a mask naming exited or nonexistent lanes;
//   * deadlock: no thread can run and no barrier or collective can complete;
//   * shared-memory races: two threads touching one __shared__ byte between the same two barriers,
//     at least one writing, and reads of __shared__ bytes no thread of the block has written;
//   * (when asked, set_bank_counting) shared-memory bank conflicts: the wavefronts each warp-wide
//     shared access takes on the GPU's 32 four-byte banks (Note [Shared-memory wavefronts]);
//   * misaligned accesses, among them the 16-byte vector loads/stores of vec.cuh (a GPU faults);
//   * launch configurations a GPU rejects (empty grid, > 1024 threads, kernel parameters over the
//     limit of the emulated runtime: 4 KiB, or 32,764 bytes with CUDA >= 12.1 on Volta and later).
//
// How: the emulated build compiles every source with -fsanitize=thread and -fsanitize=alignment but
// links no sanitizer runtime; simt.cpp implements the hooks those flags call (__tsan_read4, ...,
// __ubsan_handle_type_mismatch_v1) and so sees every memory access of the kernels. __shared__ becomes
// `static thread_local`, which puts all shared arrays in the module's TLS segment: an access is a
// shared-memory access iff it falls in that segment (a macro cannot wrap the declarator
// `T name[N]`, and GCC ignores section attributes on statics of templates, so this is the one way to
// recognise them without editing the kernels). The order in which threads run between barriers, and
// preemption at memory accesses, come from a seeded scheduler (DISTOPT_SIMT_SEED or set_seed), so
// order-dependent bugs show under some seeds; seed 0 runs threads in order without preemption.
//
// A violation ends the launch: simt::launch throws simt::Error (a std::runtime_error, RuntimeError
// in Python) naming the kernel, the block, the threads, the call sites and the seed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define DISTOPT_SIMT_EMULATION 1

// Each module (distopt._C_emulated, the test kernels) gets its own copy of the runtime.
#pragma GCC visibility push(hidden)
#define SIMT_API __attribute__((visibility("hidden")))

// ---- CUDA qualifiers ---------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
// One instance per OS thread (concurrent emulations do not share) in the TLS segment (see above).
// `extern __shared__` (dynamic shared memory) is not supported.
#define __shared__ static thread_local

// ---- Vector and index types --------------------------------------------------------------------
struct uint3 {
  unsigned int x, y, z;
};

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

// CUDA's built-in vector types, with their alignment (a float4 access is one 16-byte access).
#define SIMT_VEC2(T, name, align)                                        \
  struct alignas(align) name {                                           \
    T x, y;                                                              \
  };                                                                     \
  inline name make_##name(T x, T y) { return name{x, y}; }
#define SIMT_VEC4(T, name, align)                                        \
  struct alignas(align) name {                                           \
    T x, y, z, w;                                                        \
  };                                                                     \
  inline name make_##name(T x, T y, T z, T w) { return name{x, y, z, w}; }
SIMT_VEC2(float, float2, 8)
SIMT_VEC4(float, float4, 16)
SIMT_VEC2(int, int2, 8)
SIMT_VEC4(int, int4, 16)
SIMT_VEC2(unsigned int, uint2, 8)
SIMT_VEC4(unsigned int, uint4, 16)
SIMT_VEC2(double, double2, 16)
SIMT_VEC2(long long, longlong2, 16)
#undef SIMT_VEC2
#undef SIMT_VEC4

constexpr int warpSize = 32;

// ---- Runtime API subset ------------------------------------------------------------------------
enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorLaunchFailure = 719,
};
using cudaStream_t = struct CUstream_st*;
enum cudaDeviceAttr : int { cudaDevAttrMultiProcessorCount = 16, cudaDevAttrComputeCapabilityMajor = 75,
                            cudaDevAttrComputeCapabilityMinor = 76 };

SIMT_API cudaError_t cudaGetLastError();
SIMT_API cudaError_t cudaPeekAtLastError();
SIMT_API const char* cudaGetErrorString(cudaError_t err);
// The emulated machine's versions and device (simt::set_runtime), one device: 0.
SIMT_API cudaError_t cudaDriverGetVersion(int* version);
SIMT_API cudaError_t cudaRuntimeGetVersion(int* version);
SIMT_API cudaError_t cudaGetDevice(int* device);
SIMT_API cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }  // launches run synchronously
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }

namespace simt {

// A call site of a barrier or warp collective: threads meet only at the same site.
struct Site {
  const char* file;
  int line;
  const char* what;
};
#define SIMT_SITE(name) (::simt::Site{__FILE__, __LINE__, name})

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// ---- Thread and block indices: the running fiber's ------------------------------------------
SIMT_API uint3 thread_idx();
SIMT_API uint3 block_idx();
SIMT_API dim3 block_dim();
SIMT_API dim3 grid_dim();

// ---- Barriers ----------------------------------------------------------------------------------
enum class BarrierOp : uint8_t { Sync, Or, And, Count };
SIMT_API int barrier(const Site& site, BarrierOp op, int predicate);

// ---- Warp collectives --------------------------------------------------------------------------
enum class WarpOp : uint8_t { ShflIdx, ShflUp, ShflDown, ShflXor, Ballot, Any, All, Sync, ReduceMax };
// `value`: the caller's bits (shuffles) or predicate; `arg`: src lane / delta / lane mask.
SIMT_API uint64_t warp_collective(const Site& site, WarpOp op, unsigned mask, uint64_t value, int arg, int width);
SIMT_API unsigned active_mask();

template <typename T>
T shfl(const Site& site, WarpOp op, unsigned mask, T var, int arg, int width = warpSize) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffles move at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = warp_collective(site, op, mask, bits, arg, width);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

// Atomics: run to completion (fibers are cooperative), never reported as shared-memory races.
SIMT_API void atomic_point();  // a scheduling point, as another thread's atomic may come first
template <typename T, typename F>
__attribute__((no_sanitize("thread"))) T atomic_rmw(T* p, F f) {  // not seen by the race check
  atomic_point();
  const T old = *p;
  *p = f(old);
  return old;
}

// ---- Launch ------------------------------------------------------------------------------------
struct LaunchInfo {
  const char* what;  // the kernel's name in error messages
  dim3 grid, block;
  size_t dynamic_shared_bytes;
  size_t param_bytes;
};
using ThreadBody = void (*)(void* ctx);

// Runs body(ctx) in every thread of every block; throws simt::Error on a violation.
SIMT_API void launch(const LaunchInfo& info, ThreadBody body, void* ctx);

// Bytes of the kernel parameter buffer (each parameter at its alignment), as CUDA lays it out.
template <typename... Ts>
constexpr size_t param_bytes() {
  size_t offset = 0;
  ((offset = (offset + alignof(Ts) - 1) / alignof(Ts) * alignof(Ts) + sizeof(Ts)), ...);
  return offset;
}

// Calls the kernel with by-value copies of the parameters (a grid_const parameter, launch.cuh, binds
// to the launch's one copy instead). The copies are not instrumented: on a GPU
// parameters live in the constant bank, and a 3 KiB metadata struct seen by the hooks per thread
// would dominate the run time.
template <typename Kernel, typename Params, size_t... I>
__attribute__((no_sanitize("thread", "alignment"))) void call_kernel(Kernel kernel, const Params& params,
                                                                      std::index_sequence<I...>) {
  kernel(std::get<I>(params)...);
}

// kernel<<<grid, block, shmem, stream>>>(args...): the arguments are copied once into a parameter
// tuple, and each thread calls the kernel with its own by-value copies, as on a GPU.
template <typename... KArgs, typename... Args>
void launch_kernel(const char* what, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t shmem,
                   cudaStream_t /*stream*/, Args&&... args) {
  using Params = std::tuple<std::decay_t<KArgs>...>;
  struct Ctx {
    void (*kernel)(KArgs...);
    Params params;
  };
  Ctx ctx{kernel, Params(std::forward<Args>(args)...)};
  const LaunchInfo info{what, grid, block, shmem, param_bytes<std::decay_t<KArgs>...>()};
  launch(
      info,
      [](void* p) {
        auto* c = static_cast<Ctx*>(p);
        call_kernel(c->kernel, c->params, std::index_sequence_for<KArgs...>{});
      },
      &ctx);
}

// ---- Configuration and counters ---------------------------------------------------------------
// The scheduler's seed (initially $DISTOPT_SIMT_SEED, else 1); 0: threads in order, no preemption.
SIMT_API void set_seed(uint64_t seed);
SIMT_API uint64_t seed();

// The machine the emulator stands for: what cudaDriverGetVersion, cudaRuntimeGetVersion and
// cudaDeviceGetAttribute report, and so the kernel-parameter limit launches are checked against.
// Initially an H100 (9.0, 132 SMs) with CUDA 13.0.
struct Runtime {
  int driver_version, runtime_version;  // 1000 * major + 10 * minor, as CUDA reports them
  int cc_major, cc_minor, multiprocessors;
};
SIMT_API void set_runtime(const Runtime& runtime);
SIMT_API Runtime runtime();
// 32,764 with runtime and driver >= 12.1 on compute capability >= 7.0, else 4,096: what CUDA accepts.
SIMT_API size_t max_param_bytes();

// Note [Shared-memory wavefronts]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A GPU serves a warp's shared-memory access in wavefronts: each reads or writes at most one 4-byte word
// per bank of 32 (word w in bank w % 32), and lanes reading the same word share it (a broadcast). So an
// access takes as many wavefronts as the most distinct words any one bank must deliver; accesses wider
// than 4 bytes go by groups of 128 / width lanes (half a warp for 8 bytes, a quarter for 16), each
// group counted the same way (the CUDA programming guide's and Nsight Compute's model). With
// set_bank_counting(true) the emulator groups each block's shared accesses into the warp accesses a
// GPU would issue (lane l's k-th execution of a code site goes with the other lanes' k-th: exact for
// code whose lanes run the same sites in the same order, which divergence at a loop's end only
// shortens) and counts shared_requests (warp accesses) and shared_wavefronts. Off by default: it
// records every shared access of a block.
struct Stats {
  uint64_t launches, blocks, threads, barriers, warp_collectives, shared_accesses;
  uint64_t shared_requests, shared_wavefronts;  // with set_bank_counting(true)
};
struct LaunchRecord {
  std::string what;
  dim3 grid, block;
};
SIMT_API Stats stats();
SIMT_API void set_bank_counting(bool on);  // Note [Shared-memory wavefronts]
SIMT_API bool bank_counting();
SIMT_API std::vector<LaunchRecord> launch_log();  // the launches since reset_stats (the first 100000)
SIMT_API void reset_stats();

}  // namespace simt

// ---- Intrinsics ----------------------------------------------------------------------------------
#define threadIdx (::simt::thread_idx())
#define blockIdx (::simt::block_idx())
#define blockDim (::simt::block_dim())
#define gridDim (::simt::grid_dim())

#define __syncthreads() ((void)::simt::barrier(SIMT_SITE("__syncthreads"), ::simt::BarrierOp::Sync, 0))
#define __syncthreads_or(p) ::simt::barrier(SIMT_SITE("__syncthreads_or"), ::simt::BarrierOp::Or, (p) ? 1 : 0)
#define __syncthreads_and(p) ::simt::barrier(SIMT_SITE("__syncthreads_and"), ::simt::BarrierOp::And, (p) ? 1 : 0)
#define __syncthreads_count(p) \
  ::simt::barrier(SIMT_SITE("__syncthreads_count"), ::simt::BarrierOp::Count, (p) ? 1 : 0)

#define __shfl_sync(mask, var, ...) \
  ::simt::shfl(SIMT_SITE("__shfl_sync"), ::simt::WarpOp::ShflIdx, (mask), (var), __VA_ARGS__)
#define __shfl_up_sync(mask, var, ...) \
  ::simt::shfl(SIMT_SITE("__shfl_up_sync"), ::simt::WarpOp::ShflUp, (mask), (var), __VA_ARGS__)
#define __shfl_down_sync(mask, var, ...) \
  ::simt::shfl(SIMT_SITE("__shfl_down_sync"), ::simt::WarpOp::ShflDown, (mask), (var), __VA_ARGS__)
#define __shfl_xor_sync(mask, var, ...) \
  ::simt::shfl(SIMT_SITE("__shfl_xor_sync"), ::simt::WarpOp::ShflXor, (mask), (var), __VA_ARGS__)
#define SIMT_VOTE(name, op, mask, p) \
  ::simt::warp_collective(SIMT_SITE(name), ::simt::WarpOp::op, (mask), (p) ? 1 : 0, 0, 32)
// The unsigned overload only (CUDA's also takes int).
#define __reduce_max_sync(mask, value)                                                                   \
  static_cast<unsigned>(::simt::warp_collective(SIMT_SITE("__reduce_max_sync"), ::simt::WarpOp::ReduceMax, \
                                                (mask), static_cast<unsigned>(value), 0, 32))
#define __ballot_sync(mask, p) static_cast<unsigned>(SIMT_VOTE("__ballot_sync", Ballot, mask, p))
#define __any_sync(mask, p) static_cast<int>(SIMT_VOTE("__any_sync", Any, mask, p))
#define __all_sync(mask, p) static_cast<int>(SIMT_VOTE("__all_sync", All, mask, p))
#define __syncwarp(...) ::simt::syncwarp(SIMT_SITE("__syncwarp"), ##__VA_ARGS__)
#define __activemask() ::simt::active_mask()
#define __threadfence() ::simt::atomic_point()
#define __threadfence_block() ::simt::atomic_point()

namespace simt {
inline void syncwarp(const Site& site, unsigned mask = 0xffffffffu) {
  warp_collective(site, WarpOp::Sync, mask, 0, 0, 32);
}
}  // namespace simt

// Bit and byte intrinsics (plain functions of their arguments).
inline int __ffs(int x) { return __builtin_ffs(x); }

template <typename T>
T atomicAdd(T* p, T v) {
  return simt::atomic_rmw(p, [v](T old) { return static_cast<T>(old + v); });
}
template <typename T>
T atomicSub(T* p, T v) {
  return simt::atomic_rmw(p, [v](T old) { return static_cast<T>(old - v); });
}
template <typename T>
T atomicExch(T* p, T v) {
  return simt::atomic_rmw(p, [v](T) { return v; });
}
template <typename T>
T atomicMax(T* p, T v) {
  return simt::atomic_rmw(p, [v](T old) { return old < v ? v : old; });
}
template <typename T>
T atomicMin(T* p, T v) {
  return simt::atomic_rmw(p, [v](T old) { return v < old ? v : old; });
}
template <typename T>
T atomicOr(T* p, T v) {
  return simt::atomic_rmw(p, [v](T old) { return static_cast<T>(old | v); });
}
template <typename T>
T atomicAnd(T* p, T v) {
  return simt::atomic_rmw(p, [v](T old) { return static_cast<T>(old & v); });
}
template <typename T>
T atomicCAS(T* p, T compare, T v) {
  return simt::atomic_rmw(p, [compare, v](T old) { return old == compare ? v : old; });
}

#pragma GCC visibility pop
