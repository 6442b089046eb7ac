// The SIMT emulator's fibers: one stack and saved context per CUDA thread of the running block.
#include <sys/mman.h>

#include <memory>

#include "simt_internal.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#if defined(__x86_64__)
// A switch saves the callee-saved registers and the SSE/x87 control words on the old stack and
// restores them from the new one: no system call (glibc's swapcontext makes one per switch, to save
// the signal mask, which would dominate the run time of a block reduction).
extern "C" SIMT_API void simt_ctx_switch(void** save, void* load);
extern "C" SIMT_API void simt_ctx_start();
asm(R"(
  .text
  .p2align 4
  .globl simt_ctx_switch
  .hidden simt_ctx_switch
  .type simt_ctx_switch,@function
simt_ctx_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr 8(%rsp)
  fnstcw 12(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr 8(%rsp)
  fldcw 12(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size simt_ctx_switch,.-simt_ctx_switch

  .p2align 4
  .globl simt_ctx_start
  .hidden simt_ctx_start
  .type simt_ctx_start,@function
simt_ctx_start:
  .cfi_startproc
  .cfi_undefined rip
  movq %r12, %rdi
  callq *%r13
  ud2
  .cfi_endproc
  .size simt_ctx_start,.-simt_ctx_start
)");
#endif

namespace simt::detail {
namespace {

constexpr size_t kStackBytes = 256 * 1024;  // touched lazily; kernels need a few KiB
constexpr size_t kGuardBytes = 4096;         // PROT_NONE below each stack: an overflow faults

SIMT_NOSAN char* stack_top(Emu* e, int thread) {
  while (static_cast<int>(e->stacks.size()) <= thread) {
    void* p = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw Error("CUDA emulator: cannot allocate fiber stacks");
    mprotect(p, kGuardBytes, PROT_NONE);
    e->stacks.push_back(static_cast<char*>(p) + kGuardBytes);
  }
  return e->stacks[static_cast<size_t>(thread)] + kStackBytes;
}

#if !defined(__x86_64__)
// Portable fallback: ucontext (slower: a system call per switch; untested).
std::vector<std::unique_ptr<ucontext_t>> g_contexts;  // one per thread slot
void (*g_entry)(void*) = nullptr;
SIMT_NOSAN void trampoline() { g_entry(tls_emu); }
#endif

}  // namespace

#if defined(__x86_64__)
// A fresh fiber's stack, laid out as simt_ctx_switch leaves a suspended one: control words, r15..rbp
// (r13 = entry, r12 = its argument), then simt_ctx_start as the return address. After its `ret` the
// stack is 16-byte aligned, so simt_ctx_start's call enters `entry` as the ABI requires.
SIMT_NOSAN void* make_context(Emu* e, int thread, void (*entry)(void*), void* arg) {
  const uintptr_t top = reinterpret_cast<uintptr_t>(stack_top(e, thread)) & ~uintptr_t{15};
  auto* sp = reinterpret_cast<uint64_t*>(top - 88);
  sp[0] = 0;
  sp[1] = e->mxcsr | (uint64_t{e->fpucw} << 32);  // the launching thread's (e.g. flush-to-zero)
  sp[2] = sp[3] = sp[6] = sp[7] = 0;
  sp[4] = reinterpret_cast<uint64_t>(entry);
  sp[5] = reinterpret_cast<uint64_t>(arg);
  sp[8] = reinterpret_cast<uint64_t>(&simt_ctx_start);
  return sp;
}

SIMT_NOSAN void switch_context(void** save, void* load) { simt_ctx_switch(save, load); }
#else
SIMT_NOSAN void* make_context(Emu* e, int thread, void (*entry)(void*), void* /*arg: tls_emu*/) {
  while (g_contexts.size() <= static_cast<size_t>(thread)) g_contexts.push_back(std::make_unique<ucontext_t>());
  ucontext_t* uc = g_contexts[static_cast<size_t>(thread)].get();
  getcontext(uc);
  uc->uc_stack.ss_sp = stack_top(e, thread) - kStackBytes;
  uc->uc_stack.ss_size = kStackBytes;
  uc->uc_link = nullptr;
  g_entry = entry;
  makecontext(uc, trampoline, 0);
  return uc;
}

SIMT_NOSAN void switch_context(void** save, void* load) {
  if (*save == nullptr) *save = new ucontext_t();
  swapcontext(static_cast<ucontext_t*>(*save), static_cast<ucontext_t*>(load));
}
#endif

SIMT_NOSAN Emu::~Emu() {
  for (char* s : stacks) munmap(s - kGuardBytes, kStackBytes + kGuardBytes);
}

}  // namespace simt::detail
