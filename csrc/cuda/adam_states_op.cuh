// The fused Adam update with low-precision moments (bf16 or 8-bit blockwise, Note [State formats] in
// math/state_format.h) or stochastic rounding on CUDA: dequantise, update, requantise in one pass, with
// the grad scale, the found_inf skip, the param cast, param_outs and bf16 remainders of the fp32-moment
// update (adam_op.cuh; what both share is adam_common.cuh). adam_states.cu has the eager variants,
// adam_states_capturable.cu the ones that read lr and steps on the device.
//
// Note [Quantisation blocks on CUDA]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// One warp updates one quantisation block (kQuantBlock = 256 elements, 8 per lane: lane l holds
// elements 8l..8l+7): the block's new absmax is the largest magnitude of its updated moments, one warp
// reduction, and only then can its codes be written. A chunk (kChunkSize, a multiple of kQuantBlock)
// starts at a multiple of kQuantBlock within its tensor, so every block lies in one chunk and the 16
// warps of a CUDA block take its 256 blocks in turn. The update is memory bound, so a full block whose
// lists are all aligned (the vector path, update_block) is written for the memory system:
//   * every global load of the block is issued before its first arithmetic (16-byte accesses, 8 bytes
//     for a lane's codes), so a warp waits on memory once per block;
//   * codes are read back and found through tables in shared memory (Note [8-bit maps in shared
//     memory]): one load each, no search;
//   * stochastic rounding's Philox takes its key schedule from the kernel arguments (math/philox.h);
//   * nothing is stored until the block's absmax is known: a block whose absmax or its inverse is not
//     finite (a NaN or an infinity in it, or a tiny absmax) is left to the general path, so the vector
//     path's codes need no NaN or overflow handling. That decision is the warp's (a reduction's
//     result), so it never splits a warp.
// The general path (update_block_scalar) takes a tensor's short last block, every block of an
// unaligned chunk, and the blocks the vector path left: lane l takes elements l, l + 32, ..., in two
// passes (the absmax, then the update again and the stores: the same operations on the same inputs, so
// the same values). Both compute the CPU kernel's bits: the maximum is exact, and both quantise with
// the CPU's bucket table (math/quant_tables.h).
//
// The moment formats and stochastic rounding are launch arguments, so warp-uniform branches, not
// template parameters: one instantiation per dtype combination, as the fp32-moment update (nine format
// pairs with and without rounding as template parameters would multiply the compiled code, and the
// build time, by up to 18). The rows of the launch metadata are the fp32-moment update's, then both
// scales lists (absent entries for non-8-bit moments) and, with stochastic rounding, each entry's param
// id and first element within its param (Note [Stochastic rounding bits] in math/philox.h), carried
// as integers in address rows so that they follow their tensor across launches.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "adam_common.cuh"
#include "states_lanes.cuh"

namespace distopt {
namespace adam_detail {

struct StatesDeviceArgs {
  AdamDeviceArgs adam;
  PhiloxKeys keys;     // stochastic rounding: the seed's round keys (read from the kernel arguments)
  uint32_t step_word;  // the step's counter word (eager; capturable with a step row: read on the device)
  StateFormat m_format, v_format;
  bool stochastic_rounding;
};

void launch_states_capturable(const TensorLists& tl, const AdamArgs& args, const StatesDeviceArgs& a,
                              cudaStream_t s);

}  // namespace adam_detail

namespace {

using adam_detail::StatesDeviceArgs;
static_assert(sizeof(StatesDeviceArgs) + sizeof(void*) <= kOpArgBytes, "the op's kernel arguments");

static_assert(kChunkSize % kQuantBlock == 0, "a chunk must hold whole quantisation blocks");
// Element and block indices within a chunk are 32-bit: 64-bit ones kept live through the 8-element loop
// (two registers each, and 64-bit arithmetic per address) pushed the 16-bit-param variants past the
// 64-register cap into local memory.
static_assert(kChunkSize <= (1 << 30), "indices within a chunk are int");
static_assert(kBlockSize % 32 == 0 && kQuantBlock == 8 * 32, "one warp, 8 elements per lane, per block");
static_assert(kChunkSize / kQuantBlock / (kBlockSize / 32) <= 32, "a warp's blocks left fit 32 bits");
static_assert(kBlockSize / 32 == 16, "block qb is the (qb / 16)-th of warp qb % 16");

template <typename P, typename G, typename O, bool kRem, bool kCap>
struct AdamStatesOp {
  static_assert(!kRem || std::is_same_v<P, bf16_t>, "remainders pair with bf16 params");
  using Rows = AdamRows<O, kRem, kCap, 4>;  // Note [Adam launch rows]
  static constexpr int kScaleRow = Rows::kExtraRow;  // exp_avg's, then exp_avg_sq's
  static constexpr int kIdRow = kScaleRow + 2;       // param ids, then param offsets
  static constexpr int kDepth = Rows::kDepth;
  static constexpr int kPer = kLane;  // elements per lane
  static constexpr int kWarps = kBlockSize / 32;
  using OutT = std::conditional_t<is_present<O>, O, float>;
  // With stochastic rounding, a bf16 param without remainders is rounded with its random word.
  static constexpr bool kRoundParam = std::is_same_v<P, bf16_t> && !kRem;
  // Whether the stored param holds the update's value exactly (fp32, or bf16 + remainder): param_outs
  // are then computed from it when they are stored, instead of being held in registers through the block.
  static constexpr bool kExactParam = kRem || std::is_same_v<P, float>;

  struct Block {
    P* p;
    const G* g;
    OutT* out;
    int16_t* rem;
    void* m;
    void* v;
    float* m_scale;
    float* v_scale;
  };

  // The general path's: the rounded value itself (storing it again as bf16 is exact).
  __device__ static float round_moment(StateFormat f, float x, bool sr, uint32_t random) {
    if (f != StateFormat::BFloat16) return x;
    return float_from_bf16_bits(sr ? bf16_bits_stochastic(x, random) : bf16_bits_from_float(x));
  }

  // ---- The vector path ----------------------------------------------------------------------------

  // Block qb of the chunk, whose lists are all aligned, by one warp (Note [Quantisation blocks on CUDA]).
  // When an 8-bit moment's new absmax or its inverse is not finite it stores nothing and leaves the
  // block to the general path: lane 0 sets its bit in `left` (bit k for block warp + k kWarps), right
  // there, so that the fast path's code has no test of it after its stores.
  __device__ static void update_block(const Block& b, const StatesDeviceArgs& a, const AdamCoeffs& c, float gs,
                                      const RoundingKey& key, const QuantSmem& smem, int qb, int lane,
                                      uint32_t& left) {
    const int i = qb * kQuantBlock + lane * kPer;  // the lane's first element
    const StateFormat mf = a.m_format, vf = a.v_format;
    const bool m8 = mf == StateFormat::Blockwise8, v8 = vf == StateFormat::Blockwise8;
    const bool sr = a.stochastic_rounding;
    const bool need_bits = sr && (kRoundParam || mf == StateFormat::BFloat16 || vf == StateFormat::BFloat16);
    const RoundingStream stream = rounding_stream(a.keys, key);  // the same for every block: uniform
    const uint64_t first = stream.offset + static_cast<uint32_t>(i);  // the lane's first counter

    // Every load of the block first.
    Lanes8<P> rp;
    Lanes8<G> rg;
    Lanes8<int16_t> rr;  // kRem only
    MomentPack mp, vp;
    rp.load(b.p + i);
    rg.load(b.g + i);
    if constexpr (kRem) rr.load(b.rem + i);
    load_moment(mf, b.m, b.m_scale, qb, i, mp);
    load_moment(vf, b.v, b.v_scale, qb, i, vp);
    loads_issued();

    Lanes8<OutT> ro;  // !kExactParam only
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      float x = load_param<kRem>(rp.get(e), kRem ? rr.get(e) : int16_t{0});
      float mx = moment_elem<true>(mf, mp, smem, lane, e), vx = moment_elem<false>(vf, vp, smem, lane, e);
      adam_update(x, to_float(rg.get(e)) * gs, mx, vx, c);
      Philox4 r{};
      if (need_bits) r = rounding_bits_at(a.keys, stream, first + e);
      if constexpr (kRoundParam) {
        if (sr) {
          const uint16_t bits = bf16_bits_stochastic(x, r.w[0]);
          rp.set(e, P(bits, P::from_bits()));
          x = float_from_bf16_bits(bits);  // param_outs get the rounded value
        } else {
          rp.set(e, from_float<P>(x));
        }
      } else {
        P pv;
        int16_t rv = 0;
        store_param<kRem>(x, pv, rv);
        rp.set(e, pv);
        if constexpr (kRem) rr.set(e, rv);
      }
      if constexpr (!kExactParam) ro.set(e, from_float<OutT>(x));
      put_moment(mf, mp, e, mx, sr, r.w[1]);
      put_moment(vf, vp, e, vx, sr, r.w[2]);
    }

    // The 8-bit moments' absmax, and whether the block is ordinary (warp-uniform).
    float m_inv = 0.0f, v_inv = 0.0f, m_absmax = 0.0f, v_absmax = 0.0f;
    if (m8) {
      m_absmax = warp_absmax(mp);
      m_inv = absmax_inverse(m_absmax);
      if (!is_finite(m_absmax) || !is_finite(m_inv)) return leave_block(qb, lane, left);
    }
    if (v8) {
      v_absmax = warp_absmax(vp);
      v_inv = absmax_inverse(v_absmax);
      if (!is_finite(v_absmax) || !is_finite(v_inv)) return leave_block(qb, lane, left);
    }

    // The stores' element index computed again (thread_index_again): otherwise the compiler keeps the
    // loads' 64-bit addresses live through the update for them, registers the update needs.
    const int j = qb * kQuantBlock + (thread_index_again() % 32) * kPer;
    rp.store(b.p + j);
    if constexpr (kRem) rr.store(b.rem + j);
    if (b.out != nullptr) {
      if constexpr (kExactParam) {
#pragma unroll
        for (int e = 0; e < kPer; ++e) {
          ro.set(e, from_float<OutT>(load_param<kRem>(rp.get(e), kRem ? rr.get(e) : int16_t{0})));
        }
      }
      ro.store(b.out + j);
    }
    if (m8) {
      if (lane == 0) b.m_scale[qb] = m_absmax;
      *reinterpret_cast<uint2*>(static_cast<uint8_t*>(b.m) + j) =
          codes_of(mp, m_inv, smem.signed_buckets, QuantMap<true>::kKeyMin, true);
    } else {
      store_wide(mf, b.m, j, mp);
    }
    if (v8) {
      if (lane == 0) b.v_scale[qb] = v_absmax;
      *reinterpret_cast<uint2*>(static_cast<uint8_t*>(b.v) + j) =
          codes_of(vp, v_inv, smem.unsigned_buckets, QuantMap<false>::kKeyMin, false);
    } else {
      store_wide(vf, b.v, j, vp);
    }
  }

  __device__ static void leave_block(int qb, int lane, uint32_t& left) {
    if (lane == 0) left |= 1u << (qb / kWarps);
  }

  // ---- The general path ---------------------------------------------------------------------------

  // Element i's moment as fp32 (8-bit: through the first copy of the map, times the old absmax).
  __device__ static float load_elem_moment(StateFormat f, const void* base, const float* values, int copies,
                                           float absmax, int i) {
    switch (f) {
      case StateFormat::Float32: return static_cast<const float*>(base)[i];
      case StateFormat::BFloat16: return to_float(static_cast<const bf16_t*>(base)[i]);
      case StateFormat::Blockwise8: return values[static_cast<const uint8_t*>(base)[i] * copies] * absmax;
    }
    return 0.0f;
  }

  // A moment's value stored at i in its format (8-bit: the code of x * inv, quantize_by_buckets).
  __device__ static void store_elem_moment(StateFormat f, void* base, const uint32_t* buckets, uint32_t key_min,
                                           bool is_signed, float inv, int i, float x) {
    switch (f) {
      case StateFormat::Float32: static_cast<float*>(base)[i] = x; break;
      case StateFormat::BFloat16: static_cast<bf16_t*>(base)[i] = from_float<bf16_t>(x); break;
      case StateFormat::Blockwise8:
        static_cast<uint8_t*>(base)[i] =
            static_cast<uint8_t>(quantize_by_buckets(x * inv, buckets, key_min, is_signed));
        break;
    }
  }

  // Element i's updated param and moments.
  struct Elem {
    float p, m, v;
  };
  __device__ static Elem update_elem(const Block& blk, const StatesDeviceArgs& a, const QuantSmem& smem,
                                     const AdamCoeffs& c, float gs, float m_old, float v_old, int i) {
    int16_t r = 0;
    if constexpr (kRem) r = blk.rem[i];
    Elem x{load_param<kRem>(blk.p[i], r),
           load_elem_moment(a.m_format, blk.m, &smem.signed_values[0][0], kSignedCopies, m_old, i),
           load_elem_moment(a.v_format, blk.v, &smem.unsigned_values[0][0], kUnsignedCopies, v_old, i)};
    adam_update(x.p, to_float(blk.g[i]) * gs, x.m, x.v, c);
    return x;
  }

  // Block qb of n elements (a short last block, an unaligned one, or one the vector path left), lane l
  // taking elements l, l + 32, ...: two passes, so that no element's values stay in registers. The first
  // computes only the updated moments' absmax (8-bit moments), the second the update again, the same
  // operations on the same inputs, so the same values, and stores everything.
  __device__ static void update_block_scalar(const Block& blk, const StatesDeviceArgs& a, const AdamCoeffs& c,
                                             float gs, const RoundingKey& key, const QuantSmem& smem, int qb,
                                             int lane, int n) {
    const int lo = qb * kQuantBlock;
    const StateFormat mf = a.m_format, vf = a.v_format;
    const bool m8 = mf == StateFormat::Blockwise8, v8 = vf == StateFormat::Blockwise8;
    const bool sr = a.stochastic_rounding;
    const float m_old = m8 ? blk.m_scale[qb] : 0.0f, v_old = v8 ? blk.v_scale[qb] : 0.0f;
    float m_inv = 0.0f, v_inv = 0.0f;
    if (m8 || v8) {  // warp-uniform
      uint32_t m_max = 0, v_max = 0;
      for (int j = lane; j < n; j += 32) {
        const Elem x = update_elem(blk, a, smem, c, gs, m_old, v_old, lo + j);
        const uint32_t am = float_bits(x.m) & 0x7fffffffu, av = float_bits(x.v) & 0x7fffffffu;
        m_max = am > m_max ? am : m_max;
        v_max = av > v_max ? av : v_max;
      }
      const float m_absmax = block_absmax_of_bits(warp_max(m_max));
      const float v_absmax = block_absmax_of_bits(warp_max(v_max));
      if (lane == 0 && m8) blk.m_scale[qb] = m_absmax;
      if (lane == 0 && v8) blk.v_scale[qb] = v_absmax;
      m_inv = absmax_inverse(m_absmax);
      v_inv = absmax_inverse(v_absmax);
    }
    const bool need_bits = sr && (kRoundParam || mf == StateFormat::BFloat16 || vf == StateFormat::BFloat16);
    for (int j = lane; j < n; j += 32) {
      const int i = lo + j;
      Elem x = update_elem(blk, a, smem, c, gs, m_old, v_old, i);
      Philox4 r{};
      if (need_bits) r = rounding_bits(a.keys, key, i);
      P pv;
      int16_t rv = 0;
      if constexpr (kRoundParam) {
        if (sr) {
          const uint16_t bits = bf16_bits_stochastic(x.p, r.w[0]);
          pv = P(bits, P::from_bits());
          x.p = float_from_bf16_bits(bits);  // param_outs get the rounded value
        } else {
          pv = from_float<P>(x.p);
        }
      } else {
        store_param<kRem>(x.p, pv, rv);
      }
      blk.p[i] = pv;
      if constexpr (kRem) blk.rem[i] = rv;
      if (blk.out != nullptr) blk.out[i] = from_float<OutT>(x.p);
      store_elem_moment(mf, blk.m, smem.signed_buckets, QuantMap<true>::kKeyMin, true, m_inv, i,
                        round_moment(mf, x.m, sr, r.w[1]));
      store_elem_moment(vf, blk.v, smem.unsigned_buckets, QuantMap<false>::kKeyMin, false, v_inv, i,
                        round_moment(vf, x.v, sr, r.w[2]));
    }
  }

  template <typename Meta>
  __device__ void operator()(const Meta& meta, const StatesDeviceArgs& a) const {
    if (a.adam.found_inf != nullptr && *a.adam.found_inf != 0.0f) return;  // uniform: every thread returns
    const BlockChunk<Meta> ch(meta);
    Block b;
    b.p = ch.template ptr<P>(meta, 0);
    b.g = ch.template ptr<const G>(meta, 1);
    b.out = nullptr;  // stays nullptr for entries whose param_out aliases the param
    if constexpr (is_present<O>) b.out = ch.template ptr<OutT>(meta, Rows::kOutRow);
    b.rem = nullptr;
    if constexpr (kRem) b.rem = ch.template ptr<int16_t>(meta, Rows::kRemRow);
    const StateFormat mf = a.m_format, vf = a.v_format;
    const bool m8 = mf == StateFormat::Blockwise8, v8 = vf == StateFormat::Blockwise8;
    // Moments as bytes: each format's element size applies where they are read and written.
    const int64_t m_bytes = mf == StateFormat::Float32 ? 4 : mf == StateFormat::BFloat16 ? 2 : 1;
    const int64_t v_bytes = vf == StateFormat::Float32 ? 4 : vf == StateFormat::BFloat16 ? 2 : 1;
    b.m = static_cast<char*>(meta.addresses[2][ch.slot]) + ch.start * m_bytes;
    b.v = static_cast<char*>(meta.addresses[3][ch.slot]) + ch.start * v_bytes;
    const int64_t first_block = ch.start / kQuantBlock;
    b.m_scale = m8 ? static_cast<float*>(meta.addresses[kScaleRow][ch.slot]) + first_block : nullptr;
    b.v_scale = v8 ? static_cast<float*>(meta.addresses[kScaleRow + 1][ch.slot]) + first_block : nullptr;

    __shared__ QuantSmem smem;  // Note [8-bit maps in shared memory]: only the 8-bit moments' maps
    if (m8) copy_map(kSignedQuantMap, smem.signed_buckets, smem.signed_values);
    if (v8) copy_map(kUnsignedQuantMap, smem.unsigned_buckets, smem.unsigned_values);
    // Note [Capturable coefficients once per block]; its barrier (or this one) publishes the maps.
    const BlockCoeffs bc = block_coeffs<kCap>(meta, ch.slot, Rows::kStepRow, a.adam, a.step_word);
    if (!kCap && (m8 || v8)) __syncthreads();  // uniform
    const AdamCoeffs& c = bc.c;
    const float gs = grad_factor(a.adam.grad_scale != nullptr ? *a.adam.grad_scale : 1.0f, c);
    RoundingKey key{bc.step_word, 0, static_cast<uint64_t>(ch.start)};
    if (a.stochastic_rounding) {
      key.param_id = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(meta.addresses[kIdRow][ch.slot]));
      key.offset += static_cast<uint64_t>(reinterpret_cast<uintptr_t>(meta.addresses[kIdRow + 1][ch.slot]));
    }

    // Vector accesses: 16 bytes per lane for every 16- or 32-bit list, 8 for the codes.
    auto moment_aligned = [](const void* x, bool eight_bit) {
      return reinterpret_cast<uintptr_t>(x) % (eight_bit ? 8 : kVecBytes) == 0;
    };
    const bool aligned = is_aligned(b.p) && is_aligned(b.g) && moment_aligned(b.m, m8) && moment_aligned(b.v, v8) &&
                         (b.out == nullptr || is_aligned(b.out)) && (b.rem == nullptr || is_aligned(b.rem));
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int len = static_cast<int>(ch.len);  // <= kChunkSize
    const int vector_blocks = aligned ? len / kQuantBlock : 0;

    // The full aligned blocks on the vector path, then the rest on the general path: the blocks the
    // vector path left, a short last block, every block of an unaligned chunk. What the second loop needs
    // from before the first (the chunk's length, its vector blocks, the blocks left: bit k for block warp
    // + k kWarps) waits in shared memory, kept by each warp's lane 0, not in registers that would be live
    // through the vector path, the loop that needs them all.
    __shared__ uint32_t blocks_left[kWarps];
    __shared__ int chunk_blocks[kWarps][2];  // len, vector_blocks
    if (lane == 0) {
      blocks_left[warp] = 0;
      chunk_blocks[warp][0] = len;
      chunk_blocks[warp][1] = vector_blocks;
    }
    for (int qb = warp; qb < vector_blocks; qb += kWarps) {
      update_block(b, a, c, gs, key, smem, qb, lane, blocks_left[warp]);
    }
    for (int k = 0; k < kChunkSize / kQuantBlock / kWarps; ++k) {
      const int t = thread_index_again(), lane_again = t % 32, warp_again = t / 32, qb = warp_again + k * kWarps;
      const bool first = lane_again == 0;
      const int rest = __shfl_sync(0xffffffffu, first ? chunk_blocks[warp_again][0] : 0, 0) - qb * kQuantBlock;
      if (rest <= 0) break;  // warp-uniform
      const bool vector = qb < __shfl_sync(0xffffffffu, first ? chunk_blocks[warp_again][1] : 0, 0);
      const uint32_t left = __shfl_sync(0xffffffffu, first ? blocks_left[warp_again] : 0u, 0);
      if (!vector || ((left >> k) & 1u)) {  // warp-uniform
        update_block_scalar(b, a, c, gs, key, smem, qb, lane_again, rest < kQuantBlock ? rest : kQuantBlock);
      }
    }
  }
};

// Launches the eager (kCap false) or capturable variant of every list dtype combination.
template <bool kCap>
void launch_adam_states(const TensorLists& tl, const AdamArgs& args, const StatesDeviceArgs& a, cudaStream_t s) {
  // Stochastic rounding's per-entry keys as integers in address rows (see the top of this file).
  std::vector<void*> ids, offsets;
  if (args.stochastic_rounding) {
    for (size_t i = 0; i < tl.numel.size(); ++i) {
      ids.push_back(reinterpret_cast<void*>(static_cast<uintptr_t>(args.param_ids[i])));
      const uint64_t off = args.param_offsets.empty() ? 0 : args.param_offsets[i];
      offsets.push_back(reinterpret_cast<void*>(static_cast<uintptr_t>(off)));
    }
  }
  const std::array<const std::vector<void*>*, 4> extra{&tl.lists[kExpAvgScale].data, &tl.lists[kExpAvgSqScale].data,
                                                      &ids, &offsets};
  launch_adam_op<AdamStatesOp, kCap>(tl, args, "adam states", extra, a, s);
}

}  // namespace
}  // namespace distopt
