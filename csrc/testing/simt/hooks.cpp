// The SIMT emulator's view of memory: the hooks that -fsanitize=thread and -fsanitize=alignment make
// the compiler call (implemented here instead of by a sanitizer runtime, which is never linked), the
// shared-memory race check, and source locations for messages.
//
// Every function here is SIMT_NOSAN, so the hooks do not instrument themselves. Outside kernel code
// (e->in_runtime, or no launch on this OS thread) a hook only does what the instrumented operation
// needs (the atomics must still be atomic: torch's reference counts go through them).
#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <cinttypes>
#include <tuple>
#include <cstdio>
#include <map>
#include <mutex>

#include "simt_internal.h"

namespace simt::detail {

SIMT_NOSAN std::string hex(uintptr_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%" PRIxPTR, v);
  return buf;
}

namespace {

SIMT_NOSAN std::string access_text(const Emu* e, int thread, bool write, uintptr_t pc) {
  std::string s = thread == kManyReaders ? "several threads" : thread_name(e, thread);
  return s + (write ? " wrote" : " read") + " it at " + pc_name(pc);
}

}  // namespace

SIMT_NOSAN void locate_shared(Emu* e) {
  struct Query {
    uintptr_t code;
    uintptr_t lo = 0;
    size_t size = 0;
  } q{reinterpret_cast<uintptr_t>(&locate_shared)};
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) SIMT_NOSAN -> int {
        auto* query = static_cast<Query*>(data);
        bool ours = false;
        const ElfW(Phdr)* tls = nullptr;
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const ElfW(Phdr)& ph = info->dlpi_phdr[i];
          const uintptr_t start = info->dlpi_addr + ph.p_vaddr;
          if (ph.p_type == PT_LOAD && query->code >= start && query->code < start + ph.p_memsz) ours = true;
          if (ph.p_type == PT_TLS) tls = &ph;
        }
        if (!ours) return 0;
        if (tls != nullptr && info->dlpi_tls_data != nullptr) {
          query->lo = reinterpret_cast<uintptr_t>(info->dlpi_tls_data);
          query->size = tls->p_memsz;
        }
        return 1;
      },
      &q);
  if (q.size == 0) throw Error("CUDA emulator: cannot locate this module's TLS segment (shared memory)");
  e->shared_lo = q.lo;
  e->shared_size = q.size;
  e->shadow_store.assign(q.size, ShadowByte{});
  e->shadow = e->shadow_store.data();
}

// Two threads touching one byte in one barrier interval, at least one writing, is a race (CUDA
// orders shared memory between threads only through barriers); a read of a byte this block never
// wrote sees another block's (or no) data.
SIMT_NOSAN void shared_access(Emu* e, uintptr_t addr, size_t size, bool write, uintptr_t pc) {
  RuntimeScope scope(e);
  counters.shared_accesses.fetch_add(1, std::memory_order_relaxed);
  const int me = e->current;
  const size_t off = addr - e->shared_lo;
  if (e->count_banks) {  // a wider copy is several 16-byte accesses on a GPU
    for (size_t done = 0; done < size; done += 16) {
      const size_t piece = size - done < 16 ? size - done : 16;
      e->shared_trace.push_back(SharedRecord{pc, static_cast<uint32_t>(off + done), static_cast<uint16_t>(me),
                                             static_cast<uint8_t>(piece), e->threads[me].shared_seq++});
    }
  }
  auto what = [&] {  // only for a message
    return thread_name(e, me) + (write ? " writes " : " reads ") + std::to_string(size) +
           " byte(s) of shared memory at offset " + hex(off) + " (" + pc_name(pc) + ")";
  };
  auto since = [&] { return " since " + site_name(e->last_barrier); };
  for (size_t b = off; b < off + size && b < e->shared_size; ++b) {
    ShadowByte& s = e->shadow[b];
    if (!write) {
      if (s.init_block != e->block_serial) {
        fail(e, "uninitialised shared memory", what() + ", which no thread of this block has written");
      }
      if (s.write_epoch == e->epoch && s.writer != me) {
        fail(e, "shared-memory race", what() + "; " + access_text(e, s.writer, true, s.write_pc) + since());
      }
      if (s.read_epoch != e->epoch) {
        s.read_epoch = e->epoch;
        s.reader = me;
        s.read_pc = pc;
      } else if (s.reader != me) {
        s.reader = kManyReaders;
      }
    } else {
      if (s.write_epoch == e->epoch && s.writer != me) {
        fail(e, "shared-memory race", what() + "; " + access_text(e, s.writer, true, s.write_pc) + since());
      }
      if (s.read_epoch == e->epoch && s.reader != me) {
        fail(e, "shared-memory race", what() + "; " + access_text(e, s.reader, false, s.read_pc) + since());
      }
      s.write_epoch = e->epoch;
      s.writer = me;
      s.write_pc = pc;
      s.init_block = e->block_serial;
    }
  }
  if (e->random && next_random(e) % 4 == 0) yield(e, true);  // vary the order around shared accesses
}

// Note [Shared-memory wavefronts] (simt.h): the block's recorded accesses grouped into warp accesses
// (warp, code site, the lane's how-many-th execution of it), each costed bank by bank.
SIMT_NOSAN void count_wavefronts(Emu* e) {
  RuntimeScope scope(e);
  std::vector<SharedRecord>& t = e->shared_trace;
  if (t.empty()) return;
  // Each record's occurrence index: its rank among its thread's records at the same site.
  std::sort(t.begin(), t.end(), [](const SharedRecord& a, const SharedRecord& b) {
    return std::tie(a.thread, a.pc, a.seq) < std::tie(b.thread, b.pc, b.seq);
  });
  struct Access {
    uint32_t warp;
    uintptr_t pc;
    uint32_t occurrence;
    uint32_t lane, offset, size;
  };
  std::vector<Access> accesses;
  accesses.reserve(t.size());
  for (size_t k = 0; k < t.size(); ++k) {
    const bool same = k > 0 && t[k].thread == t[k - 1].thread && t[k].pc == t[k - 1].pc;
    const uint32_t occurrence = same ? accesses.back().occurrence + 1 : 0;
    accesses.push_back(Access{t[k].thread / 32u, t[k].pc, occurrence, t[k].thread % 32u, t[k].offset, t[k].size});
  }
  std::sort(accesses.begin(), accesses.end(), [](const Access& a, const Access& b) {
    return std::tie(a.warp, a.pc, a.occurrence, a.lane) < std::tie(b.warp, b.pc, b.occurrence, b.lane);
  });
  uint64_t requests = 0, wavefronts = 0;
  for (size_t k = 0; k < accesses.size();) {
    size_t end = k;
    uint32_t width = 0;
    while (end < accesses.size() && accesses[end].warp == accesses[k].warp && accesses[end].pc == accesses[k].pc &&
           accesses[end].occurrence == accesses[k].occurrence) {
      width = accesses[end].size > width ? accesses[end].size : width;
      ++end;
    }
    // Lanes served together: the whole warp up to 4 bytes each, else 128 bytes' worth.
    const uint32_t group = width <= 4 ? 32 : 128 / (width <= 8 ? 8 : 16);
    for (uint32_t first = 0; first < 32; first += group) {
      uint32_t words[128];
      int n = 0;
      for (size_t j = k; j < end; ++j) {
        const Access& a = accesses[j];
        if (a.lane < first || a.lane >= first + group) continue;
        for (uint32_t w = a.offset / 4; w <= (a.offset + a.size - 1) / 4 && n < 128; ++w) words[n++] = w;
      }
      if (n == 0) continue;
      std::sort(words, words + n);
      int per_bank[32] = {};
      int most = 0;
      for (int j = 0; j < n; ++j) {
        if (j > 0 && words[j] == words[j - 1]) continue;  // one word read by several lanes: a broadcast
        const int c = ++per_bank[words[j] % 32];
        most = c > most ? c : most;
      }
      wavefronts += static_cast<uint64_t>(most);
    }
    ++requests;
    k = end;
  }
  t.clear();
  counters.shared_requests.fetch_add(requests, std::memory_order_relaxed);
  counters.shared_wavefronts.fetch_add(wavefronts, std::memory_order_relaxed);
}

// file:line of a return address, from addr2line (the emulated build has line tables, -g1).
SIMT_NOSAN std::string pc_name(uintptr_t pc) {
  static std::mutex mutex;
  static std::map<uintptr_t, std::string> cache;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = cache.find(pc); it != cache.end()) return it->second;
  Dl_info info{};
  if (pc == 0 || dladdr(reinterpret_cast<void*>(pc), &info) == 0 || info.dli_fname == nullptr) return hex(pc);
  const uintptr_t offset = pc - 1 - reinterpret_cast<uintptr_t>(info.dli_fbase);  // the call, not the return
  std::string where = std::string(info.dli_fname) + "+" + hex(offset);
  const std::string cmd = "addr2line -e '" + std::string(info.dli_fname) + "' " + hex(offset) + " 2>/dev/null";
  if (FILE* p = popen(cmd.c_str(), "r")) {
    char line[4096];
    if (std::fgets(line, sizeof(line), p) != nullptr && line[0] != '?') {
      std::string text(line);
      while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
      if (const size_t disc = text.find(" (discriminator"); disc != std::string::npos) text.resize(disc);
      const size_t csrc = text.rfind("csrc/"), slash = text.rfind('/');
      where = csrc != std::string::npos    ? text.substr(csrc + 5)
              : slash != std::string::npos ? text.substr(slash + 1)
                                           : text;
    }
    pclose(p);
  }
  return cache[pc] = where;
}

}  // namespace simt::detail

// ---- -fsanitize=thread hooks ---------------------------------------------------------------------
#define SIMT_HOOK extern "C" SIMT_API SIMT_NOSAN __attribute__((used))
#define SIMT_PC reinterpret_cast<uintptr_t>(__builtin_return_address(0))

namespace {

// The fast path of every instrumented access: nothing unless a kernel thread is running.
SIMT_NOSAN __attribute__((always_inline)) inline void on_access(const volatile void* p, size_t size, bool write,
                                                                 uintptr_t pc) {
  simt::detail::Emu* e = simt::detail::tls_emu;
  if (__builtin_expect(e == nullptr || e->in_runtime, 1)) return;
  const auto addr = reinterpret_cast<uintptr_t>(p);
  if (addr - e->shared_lo < e->shared_size) simt::detail::shared_access(e, addr, size, write, pc);
  if (--e->countdown == 0) simt::detail::tick(e);
}

}  // namespace

#define SIMT_RW(N)                                                                                \
  SIMT_HOOK void __tsan_read##N(void* p) { on_access(p, N, false, SIMT_PC); }                    \
  SIMT_HOOK void __tsan_write##N(void* p) { on_access(p, N, true, SIMT_PC); }                    \
  SIMT_HOOK void __tsan_unaligned_read##N(void* p) { on_access(p, N, false, SIMT_PC); }          \
  SIMT_HOOK void __tsan_unaligned_write##N(void* p) { on_access(p, N, true, SIMT_PC); }          \
  SIMT_HOOK void __tsan_volatile_read##N(void* p) { on_access(p, N, false, SIMT_PC); }           \
  SIMT_HOOK void __tsan_volatile_write##N(void* p) { on_access(p, N, true, SIMT_PC); }
SIMT_RW(1)
SIMT_RW(2)
SIMT_RW(4)
SIMT_RW(8)
SIMT_RW(16)
#undef SIMT_RW

SIMT_HOOK void __tsan_read_range(void* p, size_t n) { on_access(p, n, false, SIMT_PC); }
SIMT_HOOK void __tsan_write_range(void* p, size_t n) { on_access(p, n, true, SIMT_PC); }
SIMT_HOOK void* __tsan_memcpy(void* d, const void* s, size_t n) {
  on_access(s, n, false, SIMT_PC);
  on_access(d, n, true, SIMT_PC);
  return std::memcpy(d, s, n);
}
SIMT_HOOK void* __tsan_memmove(void* d, const void* s, size_t n) {
  on_access(s, n, false, SIMT_PC);
  on_access(d, n, true, SIMT_PC);
  return std::memmove(d, s, n);
}
SIMT_HOOK void* __tsan_memset(void* d, int c, size_t n) {
  on_access(d, n, true, SIMT_PC);
  return std::memset(d, c, n);
}
SIMT_HOOK void __tsan_init() {}
SIMT_HOOK void __tsan_func_entry(void*) {}
SIMT_HOOK void __tsan_func_exit() {}
SIMT_HOOK void __tsan_vptr_update(void**, void*) {}
SIMT_HOOK void __tsan_vptr_read(void**) {}

// Atomics (host code: torch's reference counts): performed, sequentially consistent.
#define SIMT_SEQ __ATOMIC_SEQ_CST
#define SIMT_RMW(N, T, op)                                             \
  SIMT_HOOK T __tsan_atomic##N##_fetch_##op(volatile T* a, T v, int) { \
    return __atomic_fetch_##op(a, v, SIMT_SEQ);                        \
  }
#define SIMT_ATOMICS(N, T)                                                                                  \
  SIMT_HOOK T __tsan_atomic##N##_load(const volatile T* a, int) { return __atomic_load_n(a, SIMT_SEQ); }  \
  SIMT_HOOK void __tsan_atomic##N##_store(volatile T* a, T v, int) { __atomic_store_n(a, v, SIMT_SEQ); } \
  SIMT_HOOK T __tsan_atomic##N##_exchange(volatile T* a, T v, int) {                                     \
    return __atomic_exchange_n(a, v, SIMT_SEQ);                                                           \
  }                                                                                                        \
  SIMT_RMW(N, T, add) SIMT_RMW(N, T, sub) SIMT_RMW(N, T, and) SIMT_RMW(N, T, or) SIMT_RMW(N, T, xor)     \
  SIMT_RMW(N, T, nand)                                                                                     \
  SIMT_HOOK int __tsan_atomic##N##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) {          \
    return __atomic_compare_exchange_n(a, c, v, false, SIMT_SEQ, SIMT_SEQ);                               \
  }                                                                                                        \
  SIMT_HOOK int __tsan_atomic##N##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) {            \
    return __atomic_compare_exchange_n(a, c, v, true, SIMT_SEQ, SIMT_SEQ);                                \
  }                                                                                                        \
  SIMT_HOOK T __tsan_atomic##N##_compare_exchange_val(volatile T* a, T c, T v, int, int) {                \
    __atomic_compare_exchange_n(a, &c, v, false, SIMT_SEQ, SIMT_SEQ);                                     \
    return c;                                                                                              \
  }
SIMT_ATOMICS(8, uint8_t)
SIMT_ATOMICS(16, uint16_t)
SIMT_ATOMICS(32, uint32_t)
SIMT_ATOMICS(64, uint64_t)
#undef SIMT_ATOMICS
#undef SIMT_RMW
SIMT_HOOK void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(SIMT_SEQ); }
SIMT_HOOK void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(SIMT_SEQ); }

// ---- -fsanitize=alignment hook -------------------------------------------------------------------
// The layout GCC and Clang pass to the handler (the ABI of their sanitizer runtimes).
struct UbsanLocation {
  const char* file;
  uint32_t line, column;
};
struct UbsanType {
  uint16_t kind, info;
  char name[1];
};
struct UbsanMismatch {
  UbsanLocation loc;
  const UbsanType* type;
  unsigned char log_alignment;
  unsigned char check_kind;
};

namespace {

SIMT_NOSAN void misaligned(const UbsanMismatch* d, uintptr_t ptr) {
  const uintptr_t align = uintptr_t{1} << d->log_alignment;
  if (ptr == 0 || (ptr & (align - 1)) == 0) return;  // not an alignment problem (no other check is on)
  static const char* const kKinds[] = {"load of", "store to", "reference binding to", "member access within",
                                       "member call on", "constructor call on", "downcast of", "downcast of",
                                       "upcast of", "cast to virtual base of", "_Nonnull binding to",
                                       "dynamic operation on"};
  const char* kind = d->check_kind < sizeof(kKinds) / sizeof(kKinds[0]) ? kKinds[d->check_kind] : "access to";
  std::string file = d->loc.file != nullptr ? d->loc.file : "?";
  if (const size_t csrc = file.rfind("csrc/"); csrc != std::string::npos) file = file.substr(csrc + 5);
  const std::string text = std::string(kind) + " misaligned address " + simt::detail::hex(ptr) + " for type " +
                           d->type->name + ", which requires " + std::to_string(align) + "-byte alignment, at " +
                           file + ":" + std::to_string(d->loc.line) + ":" + std::to_string(d->loc.column) +
                           " (a GPU faults: misaligned address)";
  simt::detail::Emu* e = simt::detail::tls_emu;
  if (e != nullptr && !e->in_runtime && e->current >= 0) {
    simt::detail::RuntimeScope scope(e);
    simt::detail::fail(e, "misaligned access", simt::detail::thread_name(e, e->current) + ": " + text);
  }
  std::fprintf(stderr, "distopt emulated build: %s\n", text.c_str());  // host code: report, go on
}

}  // namespace

SIMT_HOOK void __ubsan_handle_type_mismatch_v1(UbsanMismatch* d, uintptr_t ptr) { misaligned(d, ptr); }
SIMT_HOOK void __ubsan_handle_type_mismatch_v1_abort(UbsanMismatch* d, uintptr_t ptr) { misaligned(d, ptr); }
