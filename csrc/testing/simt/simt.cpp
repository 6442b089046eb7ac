// The SIMT emulator's scheduler: fibers, barriers, warp collectives, launches (see simt.h).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>

#include "simt_internal.h"

namespace simt::detail {

thread_local __constinit Emu* tls_emu = nullptr;
Counters counters;

namespace {

constexpr uint64_t kLivelockAccesses = uint64_t{1} << 30;
constexpr size_t kMaxLogged = 100000;

std::atomic<uint64_t> g_seed{0};
std::atomic<bool> g_seed_set{false};
std::atomic<uint64_t> g_launches_since_seed{0};
std::mutex g_runtime_mutex;  // a 20-byte struct: std::atomic of it would need libatomic
Runtime g_runtime{13000, 13000, 9, 0, 132};
std::mutex g_log_mutex;
std::atomic<bool> g_bank_counting{false};  // Note [Shared-memory wavefronts]
std::vector<LaunchRecord> g_log;

SIMT_NOSAN uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// ---- Fibers and the scheduler --------------------------------------------------------------------
SIMT_NOSAN void fiber_main(void* arg) {
  auto* e = static_cast<Emu*>(arg);
  e->in_runtime = false;
  try {
    e->body(e->body_ctx);
  } catch (const std::exception& ex) {
    e->in_runtime = true;
    fail(e, "exception in kernel code", ex.what());
  }
  e->in_runtime = true;
  Thread& t = e->threads[e->current];
  t.state = State::Exited;
  ++e->exited;
  e->warp_exited[e->current / 32] |= 1u << (e->current % 32);
  switch_context(&t.ctx, e->sched_ctx);
  __builtin_trap();  // an exited fiber is never resumed
}

// Takes a runnable thread: a random one unless the seed is 0 (then the longest waiting).
SIMT_NOSAN int pick(Emu* e) {
  const int n = e->nthreads;
  if (e->random && e->queue_size > 1) {
    const int j = (e->queue_head + static_cast<int>(next_random(e) % static_cast<uint64_t>(e->queue_size))) % n;
    std::swap(e->queue[e->queue_head], e->queue[j]);
  }
  const int i = e->queue[e->queue_head];
  e->queue_head = (e->queue_head + 1) % n;
  --e->queue_size;
  return i;
}

// Lists which threads wait where (grouped by site), for deadlock and divergence messages.
SIMT_NOSAN std::string waiting_summary(const Emu* e) {
  std::map<std::string, std::vector<int>> groups;
  for (int i = 0; i < e->nthreads; ++i) {
    const Thread& t = e->threads[i];
    if (t.state == State::Barrier || t.state == State::Warp) {
      std::string key = site_name(t.site);
      if (t.state == State::Warp) {
        char buf[48];
        std::snprintf(buf, sizeof(buf), " (mask 0x%08x)", t.mask);
        key += buf;
      }
      groups[key].push_back(i);
    }
  }
  std::ostringstream os;
  for (const auto& [where, ids] : groups) {
    os << "\n  " << ids.size() << " thread(s) wait at " << where << ": " << thread_name(e, ids.front());
    if (ids.size() > 2) os << ", ...";
    if (ids.size() > 1) os << ", " << thread_name(e, ids.back());
  }
  if (e->exited > 0) os << "\n  " << e->exited << " thread(s) have exited";
  return os.str();
}

// Every thread is blocked: release the barrier if all live threads wait at one site, else fail.
SIMT_NOSAN void resolve_stall(Emu* e) {
  const int n = e->nthreads;
  int at_barrier = 0, first = -1;
  bool one_site = true;
  for (int i = 0; i < n; ++i) {
    const Thread& t = e->threads[i];
    if (t.state != State::Barrier) continue;
    ++at_barrier;
    if (first < 0) first = i;
    else one_site = one_site && same_site(t.site, e->threads[first].site);
  }
  if (at_barrier == 0 || at_barrier + e->exited != n) {
    fail(e, "deadlock",
         "no thread can run: warp collectives wait for lanes that never arrive" + waiting_summary(e));
  }
  const Site site = e->threads[first].site;
  if (e->exited > 0) {
    fail(e, "barrier divergence",
         std::to_string(e->exited) + " thread(s) exited while " + std::to_string(at_barrier) +
             " wait at " + site_name(site) + " (every thread of a block must reach each barrier)" +
             waiting_summary(e));
  }
  if (!one_site) {
    fail(e, "barrier divergence", "threads wait at different barriers" + waiting_summary(e));
  }
  const BarrierOp op = e->threads[first].barrier_op;
  uint64_t count = 0;
  for (int i = 0; i < n; ++i) count += e->threads[i].value != 0;
  const uint64_t result = op == BarrierOp::Or    ? count > 0
                          : op == BarrierOp::And ? count == static_cast<uint64_t>(n)
                          : op == BarrierOp::Count ? count
                                                   : 0;
  for (int i = 0; i < n; ++i) {
    Thread& t = e->threads[i];
    t.state = State::Ready;
    t.result = result;
    make_runnable(e, i);
  }
  ++e->epoch;  // a new barrier interval: earlier shared accesses no longer conflict
  e->last_barrier = site;
  counters.barriers.fetch_add(1, std::memory_order_relaxed);
}

SIMT_NOSAN void run_block(Emu* e, uint3 block) {
  const dim3 bd = e->info->block;
  const int n = static_cast<int>(bd.x * bd.y * bd.z);
  e->block = block;
  ++e->block_serial;
  ++e->epoch;
  e->last_barrier = Site{"", 0, "the start of the block"};
  if (static_cast<int>(e->thread_store.size()) < n) {
    e->thread_store.resize(static_cast<size_t>(n));
    e->queue_store.resize(static_cast<size_t>(n));
  }
  const int warps = (n + 31) / 32;
  e->warp_store.assign(2 * static_cast<size_t>(warps), 0u);
  e->threads = e->thread_store.data();
  e->queue = e->queue_store.data();
  e->warp_waiting = e->warp_store.data();
  e->warp_exited = e->warp_waiting + warps;
  e->nthreads = n;
  e->queue_head = e->queue_size = 0;
  e->exited = 0;
  for (int i = 0; i < n; ++i) {
    Thread& t = e->threads[i];
    t = Thread{};
    const auto u = static_cast<unsigned>(i);
    t.idx = uint3{u % bd.x, u / bd.x % bd.y, u / (bd.x * bd.y)};
    t.ctx = make_context(e, i, fiber_main, e);
    make_runnable(e, i);
  }
  while (!e->failed) {
    if (e->queue_size == 0) {
      if (e->exited == n) break;
      resolve_stall(e);
      continue;
    }
    const int i = pick(e);
    e->current = i;
    e->segment_accesses = 0;
    e->slice = e->random ? 64 + static_cast<uint32_t>(next_random(e) % 384) : 0xffffffffu;
    e->countdown = e->slice;
    switch_context(&e->sched_ctx, e->threads[i].ctx);
    e->current = -1;
  }
  if (e->failed) {
    e->shared_trace.clear();
    throw Error(e->error);
  }
  if (e->count_banks) count_wavefronts(e);
  counters.blocks.fetch_add(1, std::memory_order_relaxed);
  counters.threads.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
}

SIMT_NOSAN std::string dims(dim3 d) {
  return "(" + std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
}

SIMT_NOSAN void check_config(Emu* e, const LaunchInfo& info) {
  const dim3 g = info.grid, b = info.block;
  const uint64_t threads = uint64_t{b.x} * b.y * b.z;
  std::string problem;
  if (g.x == 0 || g.y == 0 || g.z == 0) problem = "empty grid " + dims(g);
  else if (g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535) problem = "grid " + dims(g) + " exceeds the limits";
  else if (threads == 0 || threads > 1024 || b.z > 64) problem = "block " + dims(b) + ": 1-1024 threads, z <= 64";
  else if (info.dynamic_shared_bytes != 0) problem = "dynamic shared memory is not emulated";
  else if (info.param_bytes > max_param_bytes()) {
    const Runtime r = runtime();
    problem = "the kernel parameters take " + std::to_string(info.param_bytes) + " bytes, more than " +
              std::to_string(max_param_bytes()) + " (emulated driver " + std::to_string(r.driver_version) +
              ", runtime " + std::to_string(r.runtime_version) + ", compute capability " +
              std::to_string(r.cc_major) + "." + std::to_string(r.cc_minor) + ")";
  }
  if (!problem.empty()) fail(e, "invalid launch", problem);
}

}  // namespace

// ---- Runtime entry points used by the hooks and the intrinsics -------------------------------------
SIMT_NOSAN uint64_t next_random(Emu* e) {
  e->rng = splitmix(e->rng);
  return e->rng;
}

SIMT_NOSAN Emu* current_emu(const char* what) {
  Emu* e = tls_emu;
  if (e == nullptr || e->current < 0) {
    throw Error(std::string("CUDA emulator: ") + what + " called outside a kernel");
  }
  return e;
}

SIMT_NOSAN void fail(Emu* e, const char* kind, const std::string& detail) {
  std::string message;
  {  // scoped: a failing kernel thread is abandoned, and would never free the stream
    std::ostringstream os;
    os << "CUDA emulator: " << kind;
    if (e->info != nullptr) {
      os << " in kernel '" << e->info->what << "' (grid " << dims(e->info->grid) << ", block "
         << dims(e->info->block) << ", seed " << seed() << ", launch " << e->launch_number
         << " since the seed was set)";
      if (e->nthreads > 0) os << ", block " << dims(e->block);
    }
    os << ": " << detail;
    message = os.str();
  }
  if (e->current < 0) throw Error(message);
  if (!e->failed) {
    e->failed = true;
    e->error = std::move(message);
  }
  Thread& t = e->threads[e->current];
  switch_context(&t.ctx, e->sched_ctx);  // never resumed: the scheduler throws
  __builtin_trap();
}

SIMT_NOSAN void yield(Emu* e, bool runnable) {
  const int me = e->current;
  if (runnable) make_runnable(e, me);
  switch_context(&e->threads[me].ctx, e->sched_ctx);
}

SIMT_NOSAN void tick(Emu* e) {
  RuntimeScope scope(e);
  e->segment_accesses += e->slice;
  if (e->segment_accesses > kLivelockAccesses) {
    fail(e, "livelock", thread_name(e, e->current) + " made " + std::to_string(e->segment_accesses) +
                            " memory accesses without reaching a barrier or exiting (a spin loop?)");
  }
  e->countdown = e->slice;
  if (e->random) yield(e, true);  // preempt: another thread may run first
}

SIMT_NOSAN std::string thread_name(const Emu* e, int linear) {
  const Thread& t = e->threads[linear];
  std::string s = "thread ";
  const dim3 b = e->info->block;
  s += (b.y == 1 && b.z == 1) ? std::to_string(t.idx.x) : dims(dim3(t.idx));
  return s + " (warp " + std::to_string(linear / 32) + " lane " + std::to_string(linear % 32) + ")";
}

SIMT_NOSAN std::string site_name(const Site& site) {
  if (site.line == 0) return site.what;
  std::string file = site.file;
  const size_t csrc = file.rfind("csrc/");
  const size_t slash = file.rfind('/');
  if (csrc != std::string::npos) file = file.substr(csrc + 5);
  else if (slash != std::string::npos) file = file.substr(slash + 1);
  return std::string(site.what) + " at " + file + ":" + std::to_string(site.line);
}

}  // namespace simt::detail

// ---- Public API ----------------------------------------------------------------------------------
namespace simt {
using namespace detail;

SIMT_NOSAN uint3 thread_idx() {
  const Emu* e = tls_emu;
  return e != nullptr && e->current >= 0 ? e->threads[e->current].idx : uint3{0, 0, 0};
}
SIMT_NOSAN uint3 block_idx() { return tls_emu != nullptr ? tls_emu->block : uint3{0, 0, 0}; }
SIMT_NOSAN dim3 block_dim() { return tls_emu != nullptr && tls_emu->info ? tls_emu->info->block : dim3(); }
SIMT_NOSAN dim3 grid_dim() { return tls_emu != nullptr && tls_emu->info ? tls_emu->info->grid : dim3(); }

SIMT_NOSAN int barrier(const Site& site, BarrierOp op, int predicate) {
  Emu* e = current_emu(site.what);
  RuntimeScope scope(e);
  Thread& t = e->threads[e->current];
  t.state = State::Barrier;
  t.site = site;
  t.barrier_op = op;
  t.value = static_cast<uint64_t>(predicate != 0);
  yield(e, false);
  return static_cast<int>(e->threads[e->current].result);
}

SIMT_NOSAN void atomic_point() {
  Emu* e = tls_emu;
  if (e == nullptr || e->current < 0) return;
  RuntimeScope scope(e);
  if (e->random && next_random(e) % 2 == 0) yield(e, true);
}

SIMT_NOSAN void set_seed(uint64_t s) {
  g_seed.store(s);
  g_seed_set.store(true);
  g_launches_since_seed.store(0);
}

SIMT_NOSAN uint64_t seed() {
  if (!g_seed_set.load()) {
    const char* env = std::getenv("DISTOPT_SIMT_SEED");
    set_seed(env != nullptr && *env != '\0' ? std::strtoull(env, nullptr, 0) : 1);
  }
  return g_seed.load();
}

SIMT_NOSAN void set_runtime(const Runtime& r) {
  std::lock_guard<std::mutex> lock(g_runtime_mutex);
  g_runtime = r;
}

SIMT_NOSAN Runtime runtime() {
  std::lock_guard<std::mutex> lock(g_runtime_mutex);
  return g_runtime;
}

SIMT_NOSAN size_t max_param_bytes() {
  const Runtime r = runtime();
  const bool large = r.driver_version >= 12010 && r.runtime_version >= 12010 && r.cc_major >= 7;
  return large ? 32764 : 4096;
}

SIMT_NOSAN Stats stats() {
  return Stats{counters.launches.load(),        counters.blocks.load(),          counters.threads.load(),
               counters.barriers.load(),        counters.warp_collectives.load(), counters.shared_accesses.load(),
               counters.shared_requests.load(), counters.shared_wavefronts.load()};
}

SIMT_NOSAN void set_bank_counting(bool on) { g_bank_counting.store(on); }
SIMT_NOSAN bool bank_counting() { return g_bank_counting.load(); }

SIMT_NOSAN std::vector<LaunchRecord> launch_log() {
  std::lock_guard<std::mutex> lock(g_log_mutex);
  return g_log;
}

SIMT_NOSAN void reset_stats() {
  counters.launches = counters.blocks = counters.threads = 0;
  counters.barriers = counters.warp_collectives = counters.shared_accesses = 0;
  counters.shared_requests = counters.shared_wavefronts = 0;
  std::lock_guard<std::mutex> lock(g_log_mutex);
  g_log.clear();
}

SIMT_NOSAN void launch(const LaunchInfo& info, ThreadBody body, void* ctx) {
  static thread_local std::unique_ptr<Emu> owner;
  if (!owner) {
    owner = std::make_unique<Emu>();
    tls_emu = owner.get();
    locate_shared(tls_emu);
  }
  Emu* e = tls_emu;
  if (e->active) fail(e, "invalid launch", "a kernel cannot launch kernels in the emulator");
  const uint64_t s = seed();
  e->active = true;
  e->info = &info;
  e->body = body;
  e->body_ctx = ctx;
  e->failed = false;
  e->error.clear();
  e->launch_number = g_launches_since_seed.fetch_add(1);
  e->random = s != 0;
  e->count_banks = g_bank_counting.load();
  e->shared_trace.clear();
  e->rng = splitmix(s ^ splitmix(e->launch_number));
#if defined(__x86_64__)
  asm volatile("stmxcsr %0" : "=m"(e->mxcsr));
  asm volatile("fnstcw %0" : "=m"(e->fpucw));
#endif
  struct Reset {
    Emu* e;
    SIMT_NOSAN ~Reset() {
      e->nthreads = 0;  // no block running
      e->active = false;
      e->info = nullptr;
      e->current = -1;
      e->in_runtime = true;
    }
  } reset{e};
  check_config(e, info);
  counters.launches.fetch_add(1, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(g_log_mutex);
    if (g_log.size() < kMaxLogged) g_log.push_back(LaunchRecord{info.what, info.grid, info.block});
  }
  // Blocks run one after another, in a random order unless the seed is 0 (a GPU promises none).
  const dim3 g = info.grid;
  const uint64_t blocks = uint64_t{g.x} * g.y * g.z;
  std::vector<uint64_t> order(blocks);
  for (uint64_t i = 0; i < blocks; ++i) order[i] = i;
  if (e->random) {
    for (uint64_t i = blocks; i > 1; --i) std::swap(order[i - 1], order[next_random(e) % i]);
  }
  for (uint64_t b : order) {
    run_block(e, uint3{static_cast<unsigned>(b % g.x), static_cast<unsigned>(b / g.x % g.y),
                       static_cast<unsigned>(b / (uint64_t{g.x} * g.y))});
  }
}

}  // namespace simt

// ---- Version and device queries ------------------------------------------------------------------
SIMT_NOSAN cudaError_t cudaDriverGetVersion(int* version) {
  if (version == nullptr) return cudaErrorInvalidValue;
  *version = simt::runtime().driver_version;
  return cudaSuccess;
}

SIMT_NOSAN cudaError_t cudaRuntimeGetVersion(int* version) {
  if (version == nullptr) return cudaErrorInvalidValue;
  *version = simt::runtime().runtime_version;
  return cudaSuccess;
}

SIMT_NOSAN cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return cudaErrorInvalidValue;
  *device = 0;
  return cudaSuccess;
}

SIMT_NOSAN cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (value == nullptr || device != 0) return cudaErrorInvalidValue;
  const simt::Runtime r = simt::runtime();
  switch (attr) {
    case cudaDevAttrComputeCapabilityMajor: *value = r.cc_major; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = r.cc_minor; return cudaSuccess;
    case cudaDevAttrMultiProcessorCount: *value = r.multiprocessors; return cudaSuccess;
  }
  return cudaErrorInvalidValue;
}

// ---- Error API -----------------------------------------------------------------------------------
// Launch errors are thrown (simt::Error), so there is never a pending error to report.
SIMT_NOSAN cudaError_t cudaGetLastError() { return cudaSuccess; }
SIMT_NOSAN cudaError_t cudaPeekAtLastError() { return cudaSuccess; }
SIMT_NOSAN const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
  }
  return "unknown error";
}
