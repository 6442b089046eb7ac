// The fused Adam update with low-precision moments (bf16 or 8-bit blockwise, Note [State formats] in
// math/state_format.h) or stochastic rounding on CUDA: dequantise, update, requantise in one pass, with
// the grad scale, the found_inf skip, the param cast, param_outs and bf16 remainders of AdamOp
// (adam_op.cuh), whose fp32-moment kernels stay as they are. adam_states.cu has the eager variants,
// adam_states_capturable.cu the ones that read lr and steps on the device.
//
// Note [Quantisation blocks on CUDA]
// One warp updates one quantisation block (kQuantBlock = 256 elements, 8 per lane): the block's new
// absmax is the largest magnitude of its updated moments, a warp reduction (shuffles, no barrier), and
// only then can its codes be written. A chunk (kChunkSize, a multiple of kQuantBlock) starts at a
// multiple of kQuantBlock within its tensor, so every block lies in one chunk and the 16 warps of a CUDA
// block take its 256 blocks in turn. A full block whose lists are all aligned is read and written with
// vector accesses (lane l holds elements 8l..8l+7: 16-byte accesses for 16- and 32-bit lists, 8-byte ones
// for the codes); a tensor's short last block, or an unaligned one, takes coalesced scalar accesses
// (lane l holds elements l, l + 32, ...). The maximum is exact and quantize_code is the CPU's search, so
// codes and scales are the CPU kernel's bits whatever the split. The maps' values and thresholds are
// computed into shared memory by each CUDA block (4 KiB, once per 65,536 elements), where the 8-step
// binary search of quantize_code reads them.
//
// The moment formats and stochastic rounding are launch arguments (uniform branches), not template
// parameters: one instantiation per dtype combination, as AdamOp. The rows of the launch metadata are
// AdamOp's, then both scales lists (absent entries for non-8-bit moments) and, with stochastic
// rounding, each entry's param id and first element within its param (Note [Stochastic rounding bits]),
// carried as integers in address rows so that they follow their tensor across launches.
#pragma once

#include <array>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/dispatch.h"
#include "../math/philox.h"
#include "adam_op.cuh"

namespace distopt {
namespace adam_detail {

struct StatesDeviceArgs {
  AdamDeviceArgs adam;
  PhiloxKeys keys;     // stochastic rounding: the seed's round keys
  uint32_t step_word;  // the step's counter word (eager; capturable with a step row: read on the device)
  StateFormat m_format, v_format;
  bool stochastic_rounding;
};

void launch_states_capturable(const TensorLists& tl, const AdamArgs& args, const StatesDeviceArgs& a,
                              cudaStream_t s);

}  // namespace adam_detail

namespace {

using namespace cuda;
using adam_detail::StatesDeviceArgs;

static_assert(kChunkSize % kQuantBlock == 0, "a chunk must hold whole quantisation blocks");
// Element and block indices within a chunk are 32-bit: 64-bit ones kept live through the 8-element loop
// (two registers each, and 64-bit arithmetic per address) pushed the 16-bit-param variants past the
// 64-register cap into local memory.
static_assert(kChunkSize <= (1 << 30), "indices within a chunk are int");
static_assert(kBlockSize % 32 == 0 && kQuantBlock == 8 * 32, "one warp, 8 elements per lane, per block");

template <typename P, typename G, typename O, bool kRem, bool kCap>
struct AdamStatesOp {
  static_assert(!kRem || std::is_same_v<P, bf16_t>, "remainders pair with bf16 params");
  static constexpr int kOutRow = 4;
  static constexpr int kRemRow = kOutRow + (is_present<O> ? 1 : 0);
  static constexpr int kStepRow = kRemRow + (kRem ? 1 : 0);
  static constexpr int kScaleRow = kStepRow + (kCap ? 1 : 0);  // exp_avg's, then exp_avg_sq's
  static constexpr int kIdRow = kScaleRow + 2;                   // param ids, then param offsets
  static constexpr int kDepth = kIdRow + 2;
  static constexpr int kPer = kQuantBlock / 32;  // elements per lane
  static constexpr int kWarps = kBlockSize / 32;
  using OutT = std::conditional_t<is_present<O>, O, float>;
  // With stochastic rounding, a bf16 param without remainders is rounded with its random word.
  static constexpr bool kRoundParam = std::is_same_v<P, bf16_t> && !kRem;
  // Whether the stored param holds the update's value exactly (fp32, bf16 + remainder, or a bf16 param
  // rounded stochastically, whose param_outs get the rounded value): param_outs are then read back from
  // it when their pack is stored, instead of being held in registers through the block (which spills
  // at the 64-register cap with remainders and 16-bit lists).
  static constexpr bool kExactParam = kRem || std::is_same_v<P, float>;

  // The stored param as fp32 (bf16 + remainder: the fp32 master).
  __device__ static float param_value(P p, int16_t r) {
    if constexpr (kRem) {
      return join_bf16_remainder(p, r);
    } else {
      return to_float(p);
    }
  }

  // A moment's values of the lane's 8 elements (block elements 8 lane ... 8 lane + 7) as fp32.
  __device__ static void read_moment(StateFormat f, const void* base, const float* map, float absmax, int i,
                                     float (&x)[kPer]) {
    if (f == StateFormat::Float32) {
      load_vec<kPer>(static_cast<const float*>(base) + i, x);
    } else if (f == StateFormat::BFloat16) {
      bf16_t r[kPer];
      load_vec<kPer>(static_cast<const bf16_t*>(base) + i, r);
#pragma unroll
      for (int e = 0; e < kPer; ++e) x[e] = to_float(r[e]);
    } else {
      const uint64_t w = *reinterpret_cast<const uint64_t*>(static_cast<const uint8_t*>(base) + i);
#pragma unroll
      for (int e = 0; e < kPer; ++e) x[e] = map[(w >> (8 * e)) & 0xffu] * absmax;
    }
  }

  // The block's new absmax from the lanes' largest magnitudes and NaN flags (all 32 lanes call it). The
  // maximum is exact, so the order of the reduction cannot matter.
  __device__ static float warp_absmax(float max_abs, bool any_nan) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      const float o = __shfl_xor_sync(0xffffffffu, max_abs, off);
      max_abs = o > max_abs ? o : max_abs;
    }
    return block_absmax(max_abs, __any_sync(0xffffffffu, any_nan) != 0);
  }

  // Stores the lane's 8 moment values (bf16 ones already rounded, see round_moment) in its format; an
  // 8-bit block first gets its absmax, written to scales[qb] by lane 0. Called by all 32 lanes.
  __device__ static void write_moment(StateFormat f, void* base, const float* thr, bool is_signed, float* scales,
                                      int qb, int lane, const float (&x)[kPer]) {
    const int i = qb * kQuantBlock + lane * kPer;
    if (f == StateFormat::Float32) {
      store_vec<kPer>(static_cast<float*>(base) + i, x);
    } else if (f == StateFormat::BFloat16) {
      bf16_t r[kPer];
#pragma unroll
      for (int e = 0; e < kPer; ++e) r[e] = from_float<bf16_t>(x[e]);
      store_vec<kPer>(static_cast<bf16_t*>(base) + i, r);
    } else {
      float max_abs = 0.0f;
      bool any_nan = false;
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        const float a = abs_value(x[e]);
        any_nan |= a != a;
        max_abs = a > max_abs ? a : max_abs;
      }
      const float absmax = warp_absmax(max_abs, any_nan);
      if (lane == 0) scales[qb] = absmax;
      const float inv = absmax_inverse(absmax);
      uint64_t w = 0;
#pragma unroll
      for (int e = 0; e < kPer; ++e) w |= static_cast<uint64_t>(quantize_code(x[e] * inv, thr, is_signed)) << (8 * e);
      *reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(base) + i) = w;
    }
  }

  // A bf16 moment's value as it will be stored: rounded to nearest or with its random word (so that the
  // random words need not stay live until the store; storing the rounded value again is exact).
  __device__ static float round_moment(StateFormat f, float x, bool sr, uint32_t random) {
    if (f != StateFormat::BFloat16) return x;
    return float_from_bf16_bits(sr ? bf16_bits_stochastic(x, random) : bf16_bits_from_float(x));
  }

  // Loads the 16-byte pack of src that starts with element e (of the lane's elements) if e starts one.
  template <typename T>
  __device__ static void load_pack(const T* src, T (&r)[kPer], int e) {
    constexpr int kPack = kVecBytes / sizeof(T);
    if (e % kPack != 0) return;
    T part[kPack];
    load_vec<kPack>(src + e, part);
#pragma unroll
    for (int k = 0; k < kPack; ++k) r[e + k] = part[k];
  }

  // Stores the 16-byte pack of r that ends with element e (of the lane's elements) if e ends one.
  template <typename T>
  __device__ static void store_pack(T* dst, const T (&r)[kPer], int e) {
    constexpr int kPack = kVecBytes / sizeof(T);
    if ((e + 1) % kPack != 0) return;
    T part[kPack];
#pragma unroll
    for (int k = 0; k < kPack; ++k) part[k] = r[e + 1 - kPack + k];
    store_vec<kPack>(dst + e + 1 - kPack, part);
  }

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

  // A full quantisation block qb of the chunk whose lists are all aligned, by one warp: vector accesses.
  __device__ static void update_block(const Block& b, const StatesDeviceArgs& a, const AdamCoeffs& c, float gs,
                                      const RoundingKey& key, const float (*maps)[2][kCodes], int qb,
                                      int lane) {
    const int i = qb * kQuantBlock + lane * kPer;  // the lane's first element
    const StateFormat mf = a.m_format, vf = a.v_format;
    const bool sr = a.stochastic_rounding;
    float m[kPer], v[kPer];
    read_moment(mf, b.m, maps[0][0], mf == StateFormat::Blockwise8 ? b.m_scale[qb] : 0.0f, i, m);
    read_moment(vf, b.v, maps[1][0], vf == StateFormat::Blockwise8 ? b.v_scale[qb] : 0.0f, i, v);
    const bool need_bits = sr && (kRoundParam || mf == StateFormat::BFloat16 || vf == StateFormat::BFloat16);

    P rp[kPer];
    G rg[kPer];
    int16_t rr[kPer] = {};
    OutT ro[kPer];
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      // Each 16-byte pack when its first element comes (fp32: two per list), not all up front.
      load_pack(b.p + i, rp, e);
      load_pack(b.g + i, rg, e);
      if constexpr (kRem) load_pack(b.rem + i, rr, e);
      float x = param_value(rp[e], rr[e]);
      adam_update(x, to_float(rg[e]) * gs, m[e], v[e], c);
      Philox4 r{};
      if (need_bits) r = rounding_bits(a.keys, key, i + e);
      if constexpr (kRem) {
        split_bf16_remainder(x, rp[e], rr[e]);
      } else if constexpr (kRoundParam) {
        if (sr) {
          const uint16_t bits = bf16_bits_stochastic(x, r.w[0]);
          rp[e] = P(bits, P::from_bits());
          x = float_from_bf16_bits(bits);  // param_outs get the rounded value
        } else {
          rp[e] = from_float<P>(x);
        }
      } else {
        rp[e] = from_float<P>(x);
      }
      if constexpr (!kExactParam) ro[e] = from_float<OutT>(x);
      m[e] = round_moment(mf, m[e], sr, r.w[1]);
      v[e] = round_moment(vf, v[e], sr, r.w[2]);
      // Each 16-byte pack as soon as it is complete.
      store_pack(b.p + i, rp, e);
      if constexpr (kRem) store_pack(b.rem + i, rr, e);
      if (b.out != nullptr) {
        if constexpr (kExactParam) {  // the pack's values from the stored params, when it is complete
          constexpr int kPackOut = kVecBytes / sizeof(OutT);
          if ((e + 1) % kPackOut == 0) {
#pragma unroll
            for (int k = e + 1 - kPackOut; k <= e; ++k) ro[k] = from_float<OutT>(param_value(rp[k], rr[k]));
          }
        }
        store_pack(b.out + i, ro, e);
      }
    }
    write_moment(mf, b.m, maps[0][1], true, b.m_scale, qb, lane, m);
    write_moment(vf, b.v, maps[1][1], false, b.v_scale, qb, lane, v);
  }

  // Element j of the block's grad times the grad factor, and its param and moments as fp32.
  struct Elem {
    float p, g, m, v;
  };
  __device__ static Elem load_elem(const Block& b, const StatesDeviceArgs& a, const float (*maps)[2][kCodes],
                                   float m_absmax, float v_absmax, int i, float gs) {
    int16_t r = 0;
    if constexpr (kRem) r = b.rem[i];
    Elem x{param_value(b.p[i], r), to_float(b.g[i]) * gs, 0.0f, 0.0f};
    switch (a.m_format) {
      case StateFormat::Float32: x.m = static_cast<const float*>(b.m)[i]; break;
      case StateFormat::BFloat16: x.m = to_float(static_cast<const bf16_t*>(b.m)[i]); break;
      case StateFormat::Blockwise8: x.m = maps[0][0][static_cast<const uint8_t*>(b.m)[i]] * m_absmax; break;
    }
    switch (a.v_format) {
      case StateFormat::Float32: x.v = static_cast<const float*>(b.v)[i]; break;
      case StateFormat::BFloat16: x.v = to_float(static_cast<const bf16_t*>(b.v)[i]); break;
      case StateFormat::Blockwise8: x.v = maps[1][0][static_cast<const uint8_t*>(b.v)[i]] * v_absmax; break;
    }
    return x;
  }

  // A moment's value stored at i in its format (8-bit: the code of x * inv).
  __device__ static void store_moment(StateFormat f, void* base, const float* thr, bool is_signed, float inv,
                                      int i, float x) {
    switch (f) {
      case StateFormat::Float32: static_cast<float*>(base)[i] = x; break;
      case StateFormat::BFloat16: static_cast<bf16_t*>(base)[i] = from_float<bf16_t>(x); break;
      case StateFormat::Blockwise8:
        static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(quantize_code(x * inv, thr, is_signed));
        break;
    }
  }

  // A short (a tensor's last) or unaligned block, lane l taking elements l, l + 32, ...: two passes, so
  // that no element's values stay in registers (holding all eight spills at the 64-register cap). The
  // first computes only the updated moments' absmax (8-bit moments), the second the update again, the
  // same operations on the same inputs, so the same values, and stores everything.
  __device__ static void update_block_scalar(const Block& blk, const StatesDeviceArgs& a, const AdamCoeffs& c,
                                             float gs, const RoundingKey& key, const float (*maps)[2][kCodes],
                                             int qb, int lane, int n) {
    const int lo = qb * kQuantBlock;
    const StateFormat mf = a.m_format, vf = a.v_format;
    const bool m8 = mf == StateFormat::Blockwise8, v8 = vf == StateFormat::Blockwise8;
    const bool sr = a.stochastic_rounding;
    const float m_old = m8 ? blk.m_scale[qb] : 0.0f, v_old = v8 ? blk.v_scale[qb] : 0.0f;
    float m_inv = 0.0f, v_inv = 0.0f;
    if (m8 || v8) {  // warp-uniform
      float m_max = 0.0f, v_max = 0.0f;
      bool m_nan = false, v_nan = false;
      for (int j = lane; j < n; j += 32) {
        Elem x = load_elem(blk, a, maps, m_old, v_old, lo + j, gs);
        adam_update(x.p, x.g, x.m, x.v, c);
        const float am = abs_value(x.m), av = abs_value(x.v);
        m_nan |= am != am;
        v_nan |= av != av;
        m_max = am > m_max ? am : m_max;
        v_max = av > v_max ? av : v_max;
      }
      const float m_absmax = warp_absmax(m_max, m_nan), v_absmax = warp_absmax(v_max, v_nan);
      if (lane == 0 && m8) blk.m_scale[qb] = m_absmax;
      if (lane == 0 && v8) blk.v_scale[qb] = v_absmax;
      m_inv = absmax_inverse(m_absmax);
      v_inv = absmax_inverse(v_absmax);
    }
    const bool need_bits = sr && (kRoundParam || mf == StateFormat::BFloat16 || vf == StateFormat::BFloat16);
    for (int j = lane; j < n; j += 32) {
      const int i = lo + j;
      Elem x = load_elem(blk, a, maps, m_old, v_old, i, gs);
      adam_update(x.p, x.g, x.m, x.v, c);
      Philox4 r{};
      if (need_bits) r = rounding_bits(a.keys, key, i);
      P pv;
      int16_t rv = 0;
      if constexpr (kRem) {
        split_bf16_remainder(x.p, pv, rv);
        blk.rem[i] = rv;
      } else if constexpr (kRoundParam) {
        if (sr) {
          const uint16_t bits = bf16_bits_stochastic(x.p, r.w[0]);
          pv = P(bits, P::from_bits());
          x.p = float_from_bf16_bits(bits);  // param_outs get the rounded value
        } else {
          pv = from_float<P>(x.p);
        }
      } else {
        pv = from_float<P>(x.p);
      }
      blk.p[i] = pv;
      if (blk.out != nullptr) blk.out[i] = from_float<OutT>(x.p);
      store_moment(mf, blk.m, maps[0][1], true, m_inv, i, round_moment(mf, x.m, sr, r.w[1]));
      store_moment(vf, blk.v, maps[1][1], false, v_inv, i, round_moment(vf, x.v, sr, r.w[2]));
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
    if constexpr (is_present<O>) b.out = ch.template ptr<OutT>(meta, kOutRow);
    b.rem = nullptr;
    if constexpr (kRem) b.rem = ch.template ptr<int16_t>(meta, kRemRow);
    const StateFormat mf = a.m_format, vf = a.v_format;
    const bool m8 = mf == StateFormat::Blockwise8, v8 = vf == StateFormat::Blockwise8;
    // Moments as bytes: each format's element size applies in read_moment/write_moment.
    const int64_t m_bytes = mf == StateFormat::Float32 ? 4 : mf == StateFormat::BFloat16 ? 2 : 1;
    const int64_t v_bytes = vf == StateFormat::Float32 ? 4 : vf == StateFormat::BFloat16 ? 2 : 1;
    b.m = static_cast<char*>(meta.addresses[2][ch.slot]) + ch.start * m_bytes;
    b.v = static_cast<char*>(meta.addresses[3][ch.slot]) + ch.start * v_bytes;
    const int64_t first_block = ch.start / kQuantBlock;
    b.m_scale = m8 ? static_cast<float*>(meta.addresses[kScaleRow][ch.slot]) + first_block : nullptr;
    b.v_scale = v8 ? static_cast<float*>(meta.addresses[kScaleRow + 1][ch.slot]) + first_block : nullptr;

    // [signed (exp_avg), unsigned (exp_avg_sq)][map values, thresholds]: only the 8-bit moments' maps.
    __shared__ float maps[2][2][kCodes];
    if (m8 || v8) {
      const int t = threadIdx.x % kCodes;
      const bool is_signed = threadIdx.x < kCodes;
      if (is_signed ? m8 : v8) {
        float(*map)[kCodes] = maps[is_signed ? 0 : 1];
        map[0][t] = dynamic_map_value(is_signed, t);
        map[1][t] = t + 1 < kCodes ? dynamic_map_threshold(is_signed, t) : bits_float(0x7f800000u);
      }
    }
    static_assert(kBlockSize >= 2 * kCodes, "one thread per map entry");

    AdamCoeffs c = a.adam.coeffs;
    uint32_t step_word = a.step_word;
    if constexpr (kCap) {  // Note [Capturable coefficients once per block] (adam_op.cuh)
      __shared__ float block_coeffs[3];
      __shared__ uint32_t block_step;
      if (threadIdx.x == 0) {
        const auto* step_ptr = static_cast<const float*>(meta.addresses[kStepRow][ch.slot]);
        const double lr = a.adam.lr_ptr != nullptr ? static_cast<double>(*a.adam.lr_ptr) : a.adam.lr;
        const double step = step_ptr != nullptr ? static_cast<double>(*step_ptr) : a.adam.step;
        const AdamCoeffs d = adam_coeffs(a.adam.hyper, lr, step);
        block_coeffs[0] = d.decay;
        block_coeffs[1] = d.step_size;
        block_coeffs[2] = d.bc2_sqrt;
        block_step = rounding_step(step);
      }
      __syncthreads();
      c.decay = block_coeffs[0];
      c.step_size = block_coeffs[1];
      c.bc2_sqrt = block_coeffs[2];
      step_word = block_step;
    } else {
      if (m8 || v8) __syncthreads();  // uniform
    }
    const float gs = grad_factor(a.adam.grad_scale != nullptr ? *a.adam.grad_scale : 1.0f, c);
    RoundingKey key{step_word, 0, static_cast<uint64_t>(ch.start)};
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
    const int lane = threadIdx.x % 32;
    const int len = static_cast<int>(ch.len);  // <= kChunkSize
    const int blocks = (len + kQuantBlock - 1) / kQuantBlock;
    // Full blocks with vector accesses, then the rest (a short last block, or every block of an unaligned
    // chunk) with scalar ones: two loops, so that neither path's registers are live in the other's.
    const int vector_blocks = aligned ? len / kQuantBlock : 0;
    const int warp = threadIdx.x / 32;
    for (int qb = warp; qb < vector_blocks; qb += kWarps) {  // warp-uniform
      update_block(b, a, c, gs, key, maps, qb, lane);
    }
    for (int qb = vector_blocks + warp; qb < blocks; qb += kWarps) {
      const int left = len - qb * kQuantBlock;
      update_block_scalar(b, a, c, gs, key, maps, qb, lane, left < kQuantBlock ? left : kQuantBlock);
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
  auto run = [&](auto op) {
    using Op = decltype(op);
    std::array<const std::vector<void*>*, Op::kDepth> rows{};
    for (int d = 0; d < 4; ++d) rows[d] = &tl.lists[d].data;
    if constexpr (Op::kOutRow < Op::kRemRow) rows[Op::kOutRow] = &tl.lists[kParamOut].data;
    if constexpr (Op::kRemRow < Op::kStepRow) rows[Op::kRemRow] = &tl.lists[kRemainder].data;
    if constexpr (Op::kStepRow < Op::kScaleRow) rows[Op::kStepRow] = &args.steps.data;
    rows[Op::kScaleRow] = &tl.lists[kExpAvgScale].data;
    rows[Op::kScaleRow + 1] = &tl.lists[kExpAvgSqScale].data;
    rows[Op::kIdRow] = &ids;
    rows[Op::kIdRow + 1] = &offsets;
    cuda::multi_tensor_apply<Op::kDepth>(rows, tl.numel, s, "adam states", op, a);
  };
  static_assert(kParam == 0 && kGrad == 1 && kExpAvg == 2 && kExpAvgSq == 3, "AdamStatesOp reads rows 0-3 as these");
  dispatch_adam(tl.lists[kParam], tl.lists[kGrad], tl.lists[kParamOut], !tl.lists[kRemainder].empty(),
                [&](auto p_tag, auto g_tag, auto o_tag, auto remainders) {
                  using P = typename decltype(p_tag)::type;
                  using G = typename decltype(g_tag)::type;
                  using O = typename decltype(o_tag)::type;
                  run(AdamStatesOp<P, G, O, decltype(remainders)::value, kCap>{});
                });
}

}  // namespace
}  // namespace distopt
