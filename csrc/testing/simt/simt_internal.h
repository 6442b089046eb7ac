// The emulator's runtime state, shared by the scheduler (simt.cpp) and the sanitizer hooks
// (hooks.cpp). Not for kernels: they see simt.h only.
#pragma once

#include <atomic>
#include <cstring>
#include <cstdint>
#include <string>
#include <vector>

#include "simt.h"

// The runtime is compiled with the module's -fsanitize flags like everything else; its own functions
// must not call the hooks (they would recurse and see the runtime's bookkeeping as kernel accesses).
#define SIMT_NOSAN __attribute__((no_sanitize("thread", "alignment")))

#pragma GCC visibility push(hidden)

namespace simt::detail {

enum class State : uint8_t { Ready, Barrier, Warp, Exited };

struct Thread {
  void* ctx = nullptr;  // saved context: a stack pointer (x86-64) or a ucontext_t*
  uint3 idx{};
  State state = State::Ready;
  Site site{};  // where it waits (Barrier, Warp)
  BarrierOp barrier_op = BarrierOp::Sync;
  WarpOp warp_op = WarpOp::Sync;
  unsigned mask = 0;
  int arg = 0, width = 32;
  uint64_t value = 0;   // barrier predicate or the lane's collective input
  uint64_t result = 0;  // what the barrier / collective returns to it
  uint32_t shared_seq = 0;  // its shared accesses so far in the block (bank counting)
};

// One shared access of a block, recorded for Note [Shared-memory wavefronts].
struct SharedRecord {
  uintptr_t pc;
  uint32_t offset;  // in the shared segment
  uint16_t thread;
  uint8_t size;
  uint32_t seq;     // the thread's shared_seq at the access
};

// Per shared byte: who wrote and read it since the last barrier (epochs number barrier intervals
// across all blocks), and the block that last wrote it (earlier blocks' values are not initialised).
struct ShadowByte {
  uint64_t init_block = 0;
  uint64_t write_epoch = 0, read_epoch = 0;
  int32_t writer = -1, reader = -1;  // reader: kManyReaders when several threads read
  uintptr_t write_pc = 0, read_pc = 0;
};
constexpr int32_t kManyReaders = -2;

// One per OS thread that launches kernels (concurrent launches on different threads never share).
struct Emu {
  // True whenever the code running is not kernel code (no launch, the scheduler, the runtime):
  // the hooks then return at once.
  bool in_runtime = true;
  bool active = false;  // a launch is running (a kernel launching a kernel is not supported)
  int current = -1;     // the running thread's linear index, -1 in the scheduler
  void* sched_ctx = nullptr;

  // The launch and the block being run.
  const LaunchInfo* info = nullptr;
  ThreadBody body = nullptr;
  void* body_ctx = nullptr;
  uint64_t launch_number = 0;  // since the seed was set
  uint3 block{};
  uint64_t block_serial = 0, epoch = 0;
  Site last_barrier{};
  // Raw pointers into the vectors below: std::vector's accessors are out-of-line instrumented code
  // when called from SIMT_NOSAN functions, and would run the hooks on every use.
  Thread* threads = nullptr;
  int nthreads = 0;
  int* queue = nullptr;  // runnable threads: a ring of nthreads slots (each thread is in it at most once)
  int queue_head = 0, queue_size = 0;
  int exited = 0;
  unsigned* warp_waiting = nullptr;  // per warp: lanes waiting in a collective
  unsigned* warp_exited = nullptr;   // per warp: lanes that have exited
  std::vector<Thread> thread_store;
  std::vector<int> queue_store;
  std::vector<unsigned> warp_store;

  // Scheduling: random order and preemption unless the seed is 0.
  bool random = true;
  uint64_t rng = 0;
  uint32_t countdown = 1;  // instrumented accesses until the next preemption / livelock check
  uint32_t slice = 1;      // the countdown's initial value
  uint64_t segment_accesses = 0;  // by the running thread since it last blocked

  // Bank counting (Note [Shared-memory wavefronts]): the block's shared accesses so far.
  bool count_banks = false;
  std::vector<SharedRecord> shared_trace;

  // Shared memory: the module's TLS segment (see simt.h), and its shadow.
  uintptr_t shared_lo = 0;
  size_t shared_size = 0;
  ShadowByte* shadow = nullptr;
  std::vector<ShadowByte> shadow_store;

  // Fiber stacks and the FP control state they start with (the caller's, e.g. flush-to-zero).
  std::vector<char*> stacks;
  uint32_t mxcsr = 0x1f80;
  uint16_t fpucw = 0x037f;

  bool failed = false;
  std::string error;

  Emu() = default;
  Emu(const Emu&) = delete;
  Emu& operator=(const Emu&) = delete;
  ~Emu();  // unmaps the stacks
};

// constinit: no dynamic initialisation, so no TLS wrapper call on every hook.
extern thread_local __constinit Emu* tls_emu;

struct Counters {
  std::atomic<uint64_t> launches{0}, blocks{0}, threads{0}, barriers{0}, warp_collectives{0}, shared_accesses{0};
  std::atomic<uint64_t> shared_requests{0}, shared_wavefronts{0};
};
extern Counters counters;

// Marks runtime code run on behalf of a kernel thread (restores the previous state on exit).
class RuntimeScope {
 public:
  SIMT_NOSAN explicit RuntimeScope(Emu* e) : e_(e), prev_(e->in_runtime) { e->in_runtime = true; }
  SIMT_NOSAN ~RuntimeScope() { e_->in_runtime = prev_; }
  RuntimeScope(const RuntimeScope&) = delete;
  RuntimeScope& operator=(const RuntimeScope&) = delete;

 private:
  Emu* e_;
  bool prev_;
};

// The running kernel thread's Emu; throws if called outside a kernel.
Emu* current_emu(const char* what);
// Ends the launch with `kind: detail`. In a kernel thread the thread is abandoned (the scheduler
// throws); elsewhere it throws at once.
[[noreturn]] void fail(Emu* e, const char* kind, const std::string& detail);
// Fibers (fiber.cpp): a fresh context that calls entry(arg) on `thread`'s stack, and a switch that
// saves the running context in *save and resumes `load`.
void* make_context(Emu* e, int thread, void (*entry)(void*), void* arg);
void switch_context(void** save, void* load);

SIMT_NOSAN inline void make_runnable(Emu* e, int thread) {
  e->queue[(e->queue_head + e->queue_size++) % e->nthreads] = thread;
}
// Gives the CPU back to the scheduler; `runnable`: the thread may be picked again at once.
void yield(Emu* e, bool runnable);
// A preemption / livelock check, every `slice` instrumented accesses of a kernel thread.
void tick(Emu* e);
uint64_t next_random(Emu* e);

SIMT_NOSAN inline bool same_site(const Site& a, const Site& b) {
  return a.line == b.line && (a.file == b.file || std::strcmp(a.file, b.file) == 0) &&
         (a.what == b.what || std::strcmp(a.what, b.what) == 0);
}

// Text for messages.
std::string thread_name(const Emu* e, int linear);
std::string site_name(const Site& site);
std::string pc_name(uintptr_t pc);  // file:line of a code address (addr2line), else module+offset
std::string hex(uintptr_t value);

// The calling OS thread's instance of this module's TLS segment.
void locate_shared(Emu* e);
void shared_access(Emu* e, uintptr_t addr, size_t size, bool write, uintptr_t pc);
// The wavefronts of the block's recorded shared accesses, added to the counters (bank counting).
void count_wavefronts(Emu* e);

}  // namespace simt::detail

#pragma GCC visibility pop
