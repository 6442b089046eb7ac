// Which vector ISA the CPU kernels' loops run with, chosen at run time.
//
// The x86-64 baseline is SSE2, so every hot loop is compiled twice: for the baseline (run_baseline)
// and for AVX2 (run_avx2, 256-bit integer and fp32 operations), which runs where the CPU and OS
// support it. Both instantiate the same always-inline loop body, which the compiler vectorises
// inside each wrapper with that wrapper's target: the AVX2 copy does the same IEEE operations per
// element in wider registers, so the two give the same bits ("avx2" does not enable FMA, and the
// build has -ffp-contract=off anyway). DISTOPT_CPU_ISA=baseline forces the baseline loops (the
// tests compare the two). Other architectures build the baseline only.
#pragma once

namespace distopt {

enum class CpuIsa { Baseline, Avx2 };

// AVX2 if this CPU and OS have it and DISTOPT_CPU_ISA is not "baseline"; else Baseline.
CpuIsa cpu_isa();

}  // namespace distopt

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define DISTOPT_CPU_HAS_AVX2_PATH 1
#endif

#define DISTOPT_ALWAYS_INLINE inline __attribute__((always_inline))

namespace distopt {

// Kernel::run(args...) compiled for the baseline ISA and (x86) for AVX2, the copy picked at run time.
// Kernel::run must be DISTOPT_ALWAYS_INLINE and call only inline code, so that its loops are
// compiled (and vectorised) inside these wrappers, with their target.
template <typename Kernel, typename... Args>
void run_baseline(Args... args) {
  Kernel::run(args...);
}

#if defined(DISTOPT_CPU_HAS_AVX2_PATH)
template <typename Kernel, typename... Args>
__attribute__((target("avx2"))) void run_avx2(Args... args) {
  Kernel::run(args...);
}
#endif

template <typename Kernel, typename... Args>
void run_for_isa(CpuIsa isa, Args... args) {
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
