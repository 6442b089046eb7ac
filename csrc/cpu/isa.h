// Which vector ISA the CPU kernels' loops run with, chosen at run time.
//
// The x86-64 baseline is SSE2, so every hot loop is compiled three times: for the baseline
// (run_baseline), for AVX2 (run_avx2, 256-bit integer and fp32 operations) and for AVX-512
// (run_avx512: F, BW, VL and DQ, 512-bit vectors), and the best copy this CPU and OS support runs.
// All instantiate the same always-inline loop body, which the compiler vectorises inside each
// wrapper with that wrapper's target: the wider copies do the same IEEE operations per element in
// wider registers (hand-written loops, as in l2norm.cpp, keep the same lanes), so every path gives
// the same bits. Neither target enables FMA contraction (the build has -ffp-contract=off), and no
// AVX-512 approximation (rcp14, rsqrt14) or bf16 instruction (vcvtneps2bf16 flushes subnormals) is
// used. DISTOPT_CPU_ISA=baseline|avx2|avx512 forces a path (the tests compare them); asking for one
// this CPU lacks is an error. Other architectures build the baseline only. Where the CPU also has
// AVX512-VBMI, the default path reads 8-bit moments with its byte permutes (cpu_vbmi()); a forced
// avx512 leaves them out, so that the tests run both versions of that read.
#pragma once

#include <cstdint>

namespace distopt {

enum class CpuIsa { Baseline, Avx2, Avx512 };
constexpr int kNumCpuIsas = 3;

// The best path this CPU and OS support.
CpuIsa best_cpu_isa();

// The path the kernels take now: DISTOPT_CPU_ISA if set (unset, empty or "auto": best_cpu_isa()).
// Throws std::invalid_argument for an unknown name or a path this CPU does not support.
CpuIsa cpu_isa();

// "baseline", "avx2", "avx512".
const char* cpu_isa_name(CpuIsa isa);

// Whether the AVX-512 path may use AVX512-VBMI now: the CPU has it and DISTOPT_CPU_ISA is unset or auto.
bool cpu_vbmi();

// How many ranges each path's wrapper has run since the library was loaded (a test hook: it shows
// which compiled copy did the work, not only which one was asked for).
void note_cpu_isa_run(CpuIsa isa);
int64_t cpu_isa_runs(CpuIsa isa);

}  // namespace distopt

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define DISTOPT_CPU_HAS_AVX2_PATH 1
#define DISTOPT_CPU_HAS_AVX512_PATH 1
#endif

#define DISTOPT_ALWAYS_INLINE inline __attribute__((always_inline))

// The AVX-512 wrappers' target. GCC's generic tuning would otherwise still be free to prefer 256-bit
// vectors for the auto-vectorised loops; clang has no such target option (and uses 512 bits here).
#if defined(__clang__)
#define DISTOPT_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#else
#define DISTOPT_AVX512_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,prefer-vector-width=512")))
#endif

namespace distopt {

// Kernel::run(args...) compiled for the baseline ISA and (x86) for AVX2 and AVX-512, the copy picked
// at run time. Kernel::run must be DISTOPT_ALWAYS_INLINE and call only inline code, so that its loops
// are compiled (and vectorised) inside these wrappers, with their target.
template <typename Kernel, typename... Args>
void run_baseline(Args... args) {
  note_cpu_isa_run(CpuIsa::Baseline);
  Kernel::run(args...);
}

#if defined(DISTOPT_CPU_HAS_AVX2_PATH)
template <typename Kernel, typename... Args>
__attribute__((target("avx2"))) void run_avx2(Args... args) {
  note_cpu_isa_run(CpuIsa::Avx2);
  Kernel::run(args...);
}
#endif

#if defined(DISTOPT_CPU_HAS_AVX512_PATH)
template <typename Kernel, typename... Args>
DISTOPT_AVX512_TARGET void run_avx512(Args... args) {
  note_cpu_isa_run(CpuIsa::Avx512);
  Kernel::run(args...);
}
#endif

template <typename Kernel, typename... Args>
void run_for_isa(CpuIsa isa, Args... args) {
#if defined(DISTOPT_CPU_HAS_AVX512_PATH)
  if (isa == CpuIsa::Avx512) {
    run_avx512<Kernel>(args...);
    return;
  }
#endif
#if defined(DISTOPT_CPU_HAS_AVX2_PATH)
  if (isa == CpuIsa::Avx2) {
    run_avx2<Kernel>(args...);
    return;
  }
#endif
  (void)isa;
  run_baseline<Kernel>(args...);
}

}  // namespace distopt
