// Warp collectives of the SIMT emulator (__shfl_*_sync, __ballot_sync, __any/__all_sync,
// __reduce_max_sync, __syncwarp).
//
// A lane that calls a collective waits until every lane of its mask has reached the same call site;
// the last one to arrive computes every lane's result. CUDA requires (and the emulator checks) that
// the caller is in its mask, that the lanes of one call site pass the same mask, that the mask names
// only lanes that exist and have not exited, and (for shuffles) that the lane read from is in it.
#include <cstdio>

#include "simt_internal.h"

namespace simt::detail {
namespace {

SIMT_NOSAN std::string mask_hex(unsigned mask) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", mask);
  return buf;
}

// The lane whose value `lane` receives, or -1 if none (ballot, any, all, syncwarp).
SIMT_NOSAN int source_lane(WarpOp op, int lane, int arg, int width) {
  const int segment = lane & ~(width - 1);  // first lane of the lane's width-wide segment
  const int pos = lane & (width - 1);
  switch (op) {
    case WarpOp::ShflIdx: return segment + (arg & (width - 1));
    case WarpOp::ShflUp: return pos >= arg ? lane - arg : lane;
    case WarpOp::ShflDown: return pos + arg < width ? lane + arg : lane;
    case WarpOp::ShflXor: {
      const int src = lane ^ arg;
      return (src & ~(width - 1)) > segment ? lane : src;  // a later segment: the lane's own value
    }
    default: return -1;
  }
}

// Every lane of `mask` (warp starting at thread `base`) has arrived: compute the results, wake them.
SIMT_NOSAN void complete(Emu* e, int base, unsigned mask, int me) {
  const Thread& first = e->threads[me];
  unsigned votes = 0;
  uint64_t max = 0;
  for (int l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    const uint64_t v = e->threads[base + l].value;
    if (v != 0) votes |= 1u << l;
    max = v > max ? v : max;
  }
  for (int l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    Thread& t = e->threads[base + l];
    const int src = source_lane(t.warp_op, l, t.arg, t.width);
    if (src >= 0 && !(mask >> src & 1u)) {
      fail(e, "warp collective mask", thread_name(e, base + l) + " reads lane " + std::to_string(src) + " in " +
                                          site_name(t.site) + ", which is not in the mask " + mask_hex(mask) +
                                          " (the value is undefined on a GPU)");
    }
    switch (first.warp_op) {
      case WarpOp::Ballot: t.result = votes; break;
      case WarpOp::Any: t.result = votes != 0; break;
      case WarpOp::All: t.result = votes == mask; break;
      case WarpOp::Sync: t.result = 0; break;
      case WarpOp::ReduceMax: t.result = max; break;
      default: t.result = e->threads[base + src].value; break;
    }
  }
  for (int l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    e->threads[base + l].state = State::Ready;
    make_runnable(e, base + l);  // the caller too: any lane may continue first
  }
  e->warp_waiting[base / 32] &= ~mask;
  counters.warp_collectives.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace
}  // namespace simt::detail

namespace simt {
using namespace detail;

SIMT_NOSAN uint64_t warp_collective(const Site& site, WarpOp op, unsigned mask, uint64_t value, int arg,
                                    int width) {
  Emu* e = current_emu(site.what);
  RuntimeScope scope(e);
  const int me = e->current;
  const int lane = me % 32, base = me - lane;
  const int n = e->nthreads;
  const int lanes = n - base < 32 ? n - base : 32;
  const unsigned existing = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
  // Built only for a message (this is the hot path of every reduction).
  auto who = [&] { return thread_name(e, me) + " calls " + site_name(site) + " with mask " + mask_hex(mask); };
  if (!(mask >> lane & 1u)) fail(e, "warp collective mask", who() + ", which does not include its own lane");
  if ((mask & ~existing) != 0) {
    fail(e, "warp collective mask", who() + ", which names lanes the block does not have (its last warp has " +
                                        std::to_string(lanes) + " lanes)");
  }
  const bool shuffle =
      op == WarpOp::ShflIdx || op == WarpOp::ShflUp || op == WarpOp::ShflDown || op == WarpOp::ShflXor;
  if (shuffle && (width < 1 || width > 32 || (width & (width - 1)) != 0)) {
    fail(e, "warp collective", who() + ": width " + std::to_string(width) + " is not a power of 2 up to 32");
  }
  if (shuffle && (op == WarpOp::ShflUp || op == WarpOp::ShflDown) && arg < 0) {
    fail(e, "warp collective", who() + ": negative delta " + std::to_string(arg));
  }
  const int warp = me / 32;
  if (const unsigned gone = mask & e->warp_exited[warp]) {
    fail(e, "warp collective mask", who() + ", but lane " + std::to_string(__builtin_ctz(gone)) +
                                        " has exited (deadlock on a GPU)");
  }
  // The lanes already waiting at this site passed equal masks (each was checked on arrival): compare
  // with the first of them.
  for (unsigned w = e->warp_waiting[warp]; w != 0; w &= w - 1) {
    const int l = __builtin_ctz(w);
    const Thread& o = e->threads[base + l];
    if (!same_site(o.site, site)) continue;
    if (o.mask != mask) {
      fail(e, "warp collective mask", who() + ", but lane " + std::to_string(l) + " waits there with mask " +
                                          mask_hex(o.mask) + " (all lanes must pass the same mask)");
    }
    break;
  }
  Thread& t = e->threads[me];
  t.state = State::Warp;
  t.site = site;
  t.warp_op = op;
  t.mask = mask;
  t.value = value;
  t.arg = arg;
  t.width = shuffle ? width : 32;
  e->warp_waiting[warp] |= 1u << lane;
  bool all = (e->warp_waiting[warp] & mask) == mask;
  for (unsigned w = mask; all && w != 0; w &= w - 1) {
    all = same_site(e->threads[base + __builtin_ctz(w)].site, site);
  }
  if (all) complete(e, base, mask, me);
  yield(e, false);  // complete() queued this lane if it is done
  return e->threads[me].result;
}

SIMT_NOSAN unsigned active_mask() {
  Emu* e = current_emu("__activemask");
  const int me = e->current;
  const int base = me - me % 32;
  unsigned mask = 0;
  for (int l = 0; l < 32 && base + l < e->nthreads; ++l) {
    if (e->threads[base + l].state != State::Exited) mask |= 1u << l;
  }
  return mask;
}

}  // namespace simt
