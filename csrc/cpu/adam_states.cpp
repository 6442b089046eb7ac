// CPU traversal of the fused Adam update with low-precision moments (bf16 or 8-bit blockwise, Note
// [State formats] in math/state_format.h) or stochastic rounding, in one pass.
//
// The unit of work is a quantisation block: kQuantBlock elements of one tensor counted from its first
// element (the last one may be shorter), so each block's absmax is computed by one thread whatever the
// thread count, and a block's bits never depend on how the work is split. Per block: the moments are
// read into fp32 buffers on the stack (bf16 widened, codes read back through the map; fp32 moments are
// used in place), the Adam loop of adam_loop.h runs on them, and the buffers are stored back in their
// format. With stochastic rounding a bf16 param (without remainders) is updated in an fp32 buffer too
// and rounded with its random word; param_outs then get that rounded value. Blocks are spread over
// torch's threads; every loop is compiled for each vector ISA (isa.h) and does the same operations.
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "../common/dispatch.h"
#include "../kernels.h"
#include "adam_loop.h"
#include "flat.h"
#include "isa.h"
#include "parallel.h"
#include "state_tables.h"

namespace distopt {
namespace {

#if defined(DISTOPT_CPU_HAS_AVX512_PATH)
// The 8-bit format's two per-element loops in AVX-512 (16 lanes), with the scalar loops' arithmetic:
// the map lookup as a tree of two-table permutes (eight 32-entry tables, then the code's top three bits
// pick one), the bucket lookup as a gather (Note [Quantisation by buckets]).
DISTOPT_AVX512_TARGET void dequantize_avx512(const uint8_t* codes, const float* values, float absmax, int64_t n,
                                            float* out) {
  __m512 t[16];
  for (int k = 0; k < 16; ++k) t[k] = _mm512_loadu_ps(values + 16 * k);
  const __m512 a = _mm512_set1_ps(absmax);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j)));
    __m512 r[4];
    const __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
    for (int q = 0; q < 4; ++q) {
      r[q] = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(t[4 * q], idx, t[4 * q + 1]),
                                  _mm512_permutex2var_ps(t[4 * q + 2], idx, t[4 * q + 3]));
    }
    const __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
    const __mmask16 b7 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(128));
    const __m512 lo = _mm512_mask_blend_ps(b6, r[0], r[1]), hi = _mm512_mask_blend_ps(b6, r[2], r[3]);
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_mask_blend_ps(b7, lo, hi), a));
  }
  for (; j < n; ++j) out[j] = values[codes[j]] * absmax;
}

// The largest bits & 0x7fffffff of x[0, n) (max_abs_bits below), 16 lanes at a time: GCC leaves that
// reduction scalar.
DISTOPT_AVX512_TARGET uint32_t max_abs_bits_avx512(const float* x, int64_t n) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  __m512i acc = _mm512_setzero_si512();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) acc = _mm512_max_epu32(acc, _mm512_and_si512(_mm512_loadu_si512(x + j), abs_mask));
  uint32_t m = _mm512_reduce_max_epu32(acc);
  for (; j < n; ++j) {
    const uint32_t a = float_bits(x[j]) & 0x7fffffffu;
    m = a > m ? a : m;
  }
  return m;
}

// codes[j] = quantize_by_buckets(x[j] * inv); returns nothing (the absmax is the caller's).
DISTOPT_AVX512_TARGET void quantize_avx512(const float* x, float inv, int64_t n, const uint32_t* buckets,
                                          uint32_t key_min, uint32_t key_max, bool is_signed, uint8_t* codes) {
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i kmin = _mm512_set1_epi32(static_cast<int>(key_min)), kmax = _mm512_set1_epi32(static_cast<int>(key_max));
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), low = _mm512_set1_epi32(0xffff);
  const __m512i one = _mm512_set1_epi32(1), c127 = _mm512_set1_epi32(127), inf_bits = _mm512_set1_epi32(0x7f800000);
  const __m512i zero_c = _mm512_set1_epi32(zero_code(is_signed));
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(x + j), vinv));
    const __m512i a = _mm512_and_si512(u, abs_mask);
    const __m512i key = _mm512_min_epu32(_mm512_max_epu32(_mm512_srli_epi32(a, 16), kmin), kmax);
    const __m512i e = _mm512_i32gather_epi32(_mm512_sub_epi32(key, kmin), reinterpret_cast<const int*>(buckets), 4);
    const __mmask16 above = _mm512_cmpgt_epu32_mask(_mm512_and_si512(a, low), _mm512_and_si512(e, low));
    const __m512i below = _mm512_mask_add_epi32(_mm512_srli_epi32(e, 16), above, _mm512_srli_epi32(e, 16), one);
    const __mmask16 negative = _mm512_cmpneq_epu32_mask(u, a);
    __m512i code;
    if (is_signed) {
      const __m512i neg = _mm512_sub_epi32(c127, _mm512_min_epu32(below, c127));
      code = _mm512_mask_blend_epi32(negative, _mm512_add_epi32(c127, below), neg);
    } else {
      code = _mm512_maskz_mov_epi32(static_cast<__mmask16>(~negative), below);
    }
    code = _mm512_mask_blend_epi32(_mm512_cmpgt_epu32_mask(a, inf_bits), code, zero_c);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j), _mm512_cvtepi32_epi8(code));
  }
  for (; j < n; ++j) codes[j] = quantize_by_buckets(x[j] * inv, buckets, key_min, key_max, is_signed);
}
#endif

// One moment list as the blocks read and write it.
struct MomentList {
  StateFormat format;
  const std::vector<void*>* data;    // per entry: float, bf16 or uint8 codes
  const std::vector<void*>* scales;  // 8-bit: per entry, the fp32 absmax of each block
  const float* values;               // 8-bit: the map
  const uint32_t* buckets;           // 8-bit: the bucket table (Note [Quantisation by buckets])
  uint32_t key_min, key_max;
  bool is_signed;
  bool avx512;  // the 8-bit loops' AVX-512 versions (else the scalar ones, which GCC vectorises less)
};

struct StatesCtx {
  const TensorLists* tl;
  const std::vector<int64_t>* block_offsets;  // flat_offsets of each tensor's block count
  AdamCoeffs coeffs;
  AdamHyper hyper;
  double lr;
  double step;
  const std::vector<void*>* steps;  // capturable: per-tensor float32 step scalars (else nullptr)
  float grad_scale;
  MomentList m, v;
  const AdamArgs* args;  // stochastic rounding: seed, param ids and offsets
};

MomentList moment_list(StateFormat format, const TensorList& data, const TensorList& scales, bool is_signed) {
  MomentList l{format, &data.data, &scales.data, nullptr, nullptr, 0, 0, is_signed, cpu_isa() == CpuIsa::Avx512};
  if (format == StateFormat::Blockwise8) {
    const QuantTable& t = quant_table(is_signed);
    l.values = t.values;
    l.buckets = t.buckets.data();
    l.key_min = t.key_min;
    l.key_max = t.key_max;
  }
  return l;
}

// Elements [lo, lo + n) of entry i of `l` as fp32: the list itself (fp32) or `buf`, filled.
DISTOPT_ALWAYS_INLINE float* read_moment(const MomentList& l, int64_t i, int64_t lo, int64_t block, int64_t n,
                                         float* __restrict buf) {
  void* base = (*l.data)[i];
  switch (l.format) {
    case StateFormat::Float32: return static_cast<float*>(base) + lo;
    case StateFormat::BFloat16: {
      const bf16_t* x = static_cast<const bf16_t*>(base) + lo;
      for (int64_t j = 0; j < n; ++j) buf[j] = to_float(x[j]);
      return buf;
    }
    case StateFormat::Blockwise8: {
      const uint8_t* codes = static_cast<const uint8_t*>(base) + lo;
      const float absmax = static_cast<const float*>((*l.scales)[i])[block];
      const float* __restrict values = l.values;
#if defined(DISTOPT_CPU_HAS_AVX512_PATH)
      if (l.avx512) {
        dequantize_avx512(codes, values, absmax, n, buf);
        return buf;
      }
#endif
      for (int64_t j = 0; j < n; ++j) buf[j] = values[codes[j]] * absmax;
      return buf;
    }
  }
  return buf;
}

// Stores the fp32 values x[0, n) (read_moment's pointer) into entry i of `l`; `random` holds the
// element's stochastic-rounding word (nullptr: round to nearest).
DISTOPT_ALWAYS_INLINE void write_moment(const MomentList& l, int64_t i, int64_t lo, int64_t block, int64_t n,
                                        const float* __restrict x, const uint32_t* __restrict random) {
  void* base = (*l.data)[i];
  switch (l.format) {
    case StateFormat::Float32: return;  // updated in place
    case StateFormat::BFloat16: {
      bf16_t* out = static_cast<bf16_t*>(base) + lo;
      if (random != nullptr) {
        for (int64_t j = 0; j < n; ++j) out[j] = bf16_t(bf16_bits_stochastic(x[j], random[j]), bf16_t::from_bits());
      } else {
        for (int64_t j = 0; j < n; ++j) out[j] = from_float<bf16_t>(x[j]);
      }
      return;
    }
    case StateFormat::Blockwise8: {
      // block_absmax's arguments from one integer maximum: |x| orders like its bits, and a NaN's bits
      // exceed every other value's (so the maximum's order of comparisons cannot matter).
      uint32_t max_bits = 0;
#if defined(DISTOPT_CPU_HAS_AVX512_PATH)
      if (l.avx512) max_bits = max_abs_bits_avx512(x, n);
#endif
      if (!l.avx512) {
        for (int64_t j = 0; j < n; ++j) {
          const uint32_t a = float_bits(x[j]) & 0x7fffffffu;
          max_bits = a > max_bits ? a : max_bits;
        }
      }
      const float absmax = block_absmax(bits_float(max_bits), is_nan_bits(max_bits));
      static_cast<float*>((*l.scales)[i])[block] = absmax;
      const float inv = absmax_inverse(absmax);
      uint8_t* codes = static_cast<uint8_t*>(base) + lo;
      const uint32_t* __restrict buckets = l.buckets;
      const uint32_t key_min = l.key_min, key_max = l.key_max;
      const bool is_signed = l.is_signed;
#if defined(DISTOPT_CPU_HAS_AVX512_PATH)
      if (l.avx512) {
        quantize_avx512(x, inv, n, buckets, key_min, key_max, is_signed, codes);
        return;
      }
#endif
      for (int64_t j = 0; j < n; ++j) codes[j] = quantize_by_buckets(x[j] * inv, buckets, key_min, key_max, is_signed);
      return;
    }
  }
}

template <typename P, typename G, typename O, bool kRem>
struct StatesRange {
  // With stochastic rounding, a bf16 param without remainders is rounded with its random word.
  static constexpr bool kRoundParam = std::is_same_v<P, bf16_t> && !kRem;

  // Blocks [b, e) of the flat block numbering.
  static DISTOPT_ALWAYS_INLINE void run(const StatesCtx* ctx, int64_t b, int64_t e) {
    const TensorLists& tl = *ctx->tl;
    const std::vector<int64_t>& offsets = *ctx->block_offsets;
    const bool sr = ctx->args->stochastic_rounding;
    // Random words only where a bf16 store takes them (Philox is the costliest part of a rounded update).
    const bool bits_needed = sr && (kRoundParam || ctx->m.format == StateFormat::BFloat16 ||
                                    ctx->v.format == StateFormat::BFloat16);
    alignas(64) float mbuf[kQuantBlock], vbuf[kQuantBlock], pbuf[kQuantBlock];
    alignas(64) uint32_t rnd[3][kQuantBlock];
    for (int64_t i = tensor_at(offsets, b); b < e; ++i) {
      const int64_t first = offsets[i];
      const int64_t block_hi = (e < offsets[i + 1] ? e : offsets[i + 1]) - first;
      AdamCoeffs c = ctx->coeffs;
      double step = ctx->step;
      if (ctx->steps != nullptr) {
        step = static_cast<double>(*static_cast<const float*>((*ctx->steps)[i]));
        c = adam_coeffs(ctx->hyper, ctx->lr, step);
      }
      const float gf = grad_factor(ctx->grad_scale, c);
      RoundingKey key{};
      if (sr) {
        key.seed = ctx->args->seed;
        key.step = rounding_step(step);
        key.param_id = ctx->args->param_ids[i];
        key.offset = ctx->args->param_offsets.empty() ? 0 : ctx->args->param_offsets[i];
      }
      const int64_t numel = tl.numel[i];
      auto* p_base = static_cast<P*>(tl.lists[kParam].data[i]);
      const auto* g_base = static_cast<const G*>(tl.lists[kGrad].data[i]);
      int16_t* rem_base = nullptr;
      if constexpr (kRem) rem_base = static_cast<int16_t*>(tl.lists[kRemainder].data[i]);
      O* out_base = nullptr;
      if constexpr (is_present<O>) out_base = static_cast<O*>(tl.lists[kParamOut].data[i]);

      for (int64_t blk = b - first; blk < block_hi; ++blk) {
        const int64_t lo = blk * kQuantBlock;
        const int64_t n = numel - lo < kQuantBlock ? numel - lo : kQuantBlock;
        if (bits_needed) {
          for (int64_t j = 0; j < n; ++j) {
            const Philox4 r = rounding_bits(key, lo + j);
            rnd[0][j] = r.w[0];
            rnd[1][j] = r.w[1];
            rnd[2][j] = r.w[2];
          }
        }
        float* m = read_moment(ctx->m, i, lo, blk, n, mbuf);
        float* v = read_moment(ctx->v, i, lo, blk, n, vbuf);
        P* p = p_base + lo;
        const G* g = g_base + lo;
        int16_t* rem = kRem ? rem_base + lo : nullptr;
        bool rounded = false;
        if constexpr (kRoundParam) {
          if (sr) {
            for (int64_t j = 0; j < n; ++j) pbuf[j] = to_float(p[j]);
            adam_piece<float, G, NoList, false>(pbuf, g, m, v, nullptr, nullptr, n, c, gf);
            for (int64_t j = 0; j < n; ++j) {
              const uint16_t bits = bf16_bits_stochastic(pbuf[j], rnd[0][j]);
              p[j] = P(bits, P::from_bits());
              pbuf[j] = float_from_bf16_bits(bits);
            }
            if constexpr (is_present<O>) {
              if (out_base != nullptr) {
                O* out = out_base + lo;
                for (int64_t j = 0; j < n; ++j) out[j] = from_float<O>(pbuf[j]);
              }
            }
            rounded = true;
          }
        }
        if (!rounded) {
          if (is_present<O> && out_base != nullptr) {
            adam_piece<P, G, O, kRem>(p, g, m, v, out_base + lo, rem, n, c, gf);
          } else {
            adam_piece<P, G, NoList, kRem>(p, g, m, v, nullptr, rem, n, c, gf);
          }
        }
        write_moment(ctx->m, i, lo, blk, n, m, bits_needed ? rnd[1] : nullptr);
        write_moment(ctx->v, i, lo, blk, n, v, bits_needed ? rnd[2] : nullptr);
      }
      b = first + block_hi;
    }
  }
};

}  // namespace

void adam_states_cpu(const TensorLists& tl, const AdamArgs& args) {
  StatesCtx ctx;
  ctx.tl = &tl;
  std::vector<int64_t> blocks(tl.numel.size());
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = (tl.numel[i] + kQuantBlock - 1) / kQuantBlock;
  const std::vector<int64_t> block_offsets = flat_offsets(blocks);
  ctx.block_offsets = &block_offsets;
  ctx.hyper = args.hyper;
  ctx.lr = args.lr_ptr != nullptr ? static_cast<double>(*args.lr_ptr) : args.lr;
  ctx.step = args.step;
  ctx.steps = args.steps.empty() ? nullptr : &args.steps.data;
  ctx.coeffs = adam_coeffs(args.hyper, ctx.lr, args.step);
  ctx.grad_scale = args.grad_scale != nullptr ? *args.grad_scale : 1.0f;
  ctx.m = moment_list(args.exp_avg_format, tl.lists[kExpAvg], tl.lists[kExpAvgScale], true);
  ctx.v = moment_list(args.exp_avg_sq_format, tl.lists[kExpAvgSq], tl.lists[kExpAvgSqScale], false);
  ctx.args = &args;
  const CpuIsa isa = cpu_isa();
  constexpr int64_t kGrainBlocks = kGrainElements / kQuantBlock;

  dispatch_adam(tl.lists[kParam], tl.lists[kGrad], tl.lists[kParamOut], !tl.lists[kRemainder].empty(),
                [&](auto p_tag, auto g_tag, auto o_tag, auto remainders) {
                  using Range = StatesRange<typename decltype(p_tag)::type, typename decltype(g_tag)::type,
                                            typename decltype(o_tag)::type, decltype(remainders)::value>;
                  parallel_for(0, block_offsets.back(), kGrainBlocks, [&](int64_t b, int64_t e) {
                    run_for_isa<Range>(isa, static_cast<const StatesCtx*>(&ctx), b, e);
                  });
                });
}

}  // namespace distopt
