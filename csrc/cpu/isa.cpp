// Run-time choice of the CPU kernels' vector ISA (see isa.h).
#include "isa.h"

#include <cstdlib>
#include <cstring>

namespace distopt {

CpuIsa cpu_isa() {
  // Read per call (a few ns against an op's microseconds), so a test can switch it with os.environ.
  const char* forced = std::getenv("DISTOPT_CPU_ISA");
  if (forced != nullptr && std::strcmp(forced, "baseline") == 0) return CpuIsa::Baseline;
#if defined(DISTOPT_CPU_HAS_AVX2_PATH)
  // libgcc's check includes the OS's XSAVE support of the 256-bit registers.
  static const bool has_avx2 = __builtin_cpu_supports("avx2");
  if (has_avx2) return CpuIsa::Avx2;
#endif
  return CpuIsa::Baseline;
}

}  // namespace distopt
