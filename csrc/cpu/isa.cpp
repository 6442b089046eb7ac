// Run-time choice of the CPU kernels' vector ISA (see isa.h).
#include "isa.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "../kernels.h"

namespace distopt {
namespace {

bool supported(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Baseline: return true;
#if defined(DISTOPT_CPU_HAS_AVX2_PATH)
    // libgcc's checks include the OS's XSAVE support of the wider registers (XCR0).
    case CpuIsa::Avx2: {
      static const bool has = __builtin_cpu_supports("avx2");
      return has;
    }
#endif
#if defined(DISTOPT_CPU_HAS_AVX512_PATH)
    case CpuIsa::Avx512: {
      static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                              __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
      return has;
    }
#endif
    default: return false;
  }
}

std::atomic<int64_t> g_runs[kNumCpuIsas];

// DISTOPT_CPU_ISA, or nullptr when it is unset, empty or "auto". Read per call (a few ns against an
// op's microseconds), so a test can switch it with os.environ.
const char* forced_isa() {
  const char* forced = std::getenv("DISTOPT_CPU_ISA");
  return forced == nullptr || forced[0] == '\0' || std::strcmp(forced, "auto") == 0 ? nullptr : forced;
}

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Baseline: return "baseline";
    case CpuIsa::Avx2: return "avx2";
    case CpuIsa::Avx512: return "avx512";
  }
  return "unknown";
}

CpuIsa best_cpu_isa() {
  for (CpuIsa isa : {CpuIsa::Avx512, CpuIsa::Avx2}) {
    if (supported(isa)) return isa;
  }
  return CpuIsa::Baseline;
}

CpuIsa cpu_isa() {
  const char* forced = forced_isa();
  if (forced == nullptr) return best_cpu_isa();
  for (CpuIsa isa : {CpuIsa::Baseline, CpuIsa::Avx2, CpuIsa::Avx512}) {
    if (std::strcmp(forced, cpu_isa_name(isa)) != 0) continue;
    if (!supported(isa)) {
      throw std::invalid_argument(std::string(kArgumentError) + "DISTOPT_CPU_ISA=" + forced +
                                  ": this CPU (or build) has no " + forced + " path; the best it has is " +
                                  cpu_isa_name(best_cpu_isa()));
    }
    return isa;
  }
  throw std::invalid_argument(std::string(kArgumentError) + "DISTOPT_CPU_ISA=" + forced +
                              ": expected auto, baseline, avx2 or avx512");
}

bool cpu_vbmi() {
#if defined(DISTOPT_CPU_HAS_AVX512_PATH)
  static const bool has = supported(CpuIsa::Avx512) && __builtin_cpu_supports("avx512vbmi");
  return has && forced_isa() == nullptr;
#else
  return false;
#endif
}

void note_cpu_isa_run(CpuIsa isa) { g_runs[static_cast<int>(isa)].fetch_add(1, std::memory_order_relaxed); }

int64_t cpu_isa_runs(CpuIsa isa) { return g_runs[static_cast<int>(isa)].load(std::memory_order_relaxed); }

}  // namespace distopt
