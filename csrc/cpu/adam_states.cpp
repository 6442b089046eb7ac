// CPU traversal of the fused Adam update with low-precision moments (bf16 or 8-bit blockwise, Note
// [State formats] in math/state_format.h) or stochastic rounding, in one pass.
//
// The unit of work is a quantisation block: kQuantBlock elements of one tensor counted from its first
// element (the last one may be shorter), so each block's absmax is computed by one thread whatever the
// thread count, and a block's bits never depend on how the work is split. Per block: the moments are
// read into fp32 buffers on the stack (bf16 widened, codes read back through the map; fp32 moments are
// used in place), the Adam loop of adam_loop.h runs on them, and the buffers are stored back in their
// format. Both moments bf16 and rounded to nearest: the Adam loop converts them in place instead (the
// same conversions, no buffers). With stochastic rounding a bf16 param (without remainders) is updated
// in an fp32 buffer too and rounded with its random word; param_outs then get that rounded value.
// Blocks are spread over torch's threads; every loop is compiled for each vector ISA (isa.h) and does
// the same operations; the 8-bit reads and the random words have hand-written AVX-512 versions.
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
// GCC 12's AVX-512 headers pass a deliberately undefined vector (a self-initialised `__Y`) as the
// passthrough operand of some intrinsics (_mm512_cvtepu8_epi32, _mm512_max_epu32), and its
// -Wmaybe-uninitialized then reports every inlined use here, about 300 warnings that are none of ours.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#endif

#include "../common/dispatch.h"
#include "../kernels.h"
#include "adam_loop.h"
#include "flat.h"
#include "isa.h"
#include "parallel.h"
#include "../math/philox.h"
#include "../math/quant_tables.h"

namespace distopt {
namespace {

// Each map value's four bytes as byte tables (byte k of value c at [k][c]): dequantize_vbmi's permutes.
struct QuantBytes {
  alignas(64) uint8_t b[4][kCodes];
};

template <typename Map>
constexpr QuantBytes quant_bytes(const Map& map) {
  QuantBytes q{};
  for (int c = 0; c < kCodes; ++c) {
    for (int k = 0; k < 4; ++k) q.b[k][c] = static_cast<uint8_t>(float_bits_constexpr(map.values[c]) >> (8 * k));
  }
  return q;
}
constexpr QuantBytes kSignedQuantBytes = quant_bytes(kSignedQuantMap);
constexpr QuantBytes kUnsignedQuantBytes = quant_bytes(kUnsignedQuantMap);

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

// dequantize_avx512 with AVX512-VBMI (Ice Lake, Zen 4 and later): the map as four byte tables, 64
// codes per byte permute (two 128-byte tables and a blend on the code's top bit), the four bytes of
// each value then interleaved back into floats. The codes are first permuted so that the interleave,
// which works within 128-bit lanes, leaves the values in order. The same values, multiplied alike.
#if defined(__clang__)
#define DISTOPT_VBMI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi")))
#else
#define DISTOPT_VBMI_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,prefer-vector-width=512")))
#endif

// Byte 16 r + 4 L + q of the codes goes to byte 16 L + 4 r + q (L: the 128-bit lane, r: which of the
// four output vectors, q: the element within the lane's group of four).
alignas(64) constexpr uint8_t kVbmiOrder[64] = {
    0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
    8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // as in rounding_bits_avx512 below
DISTOPT_VBMI_TARGET void dequantize_vbmi(const uint8_t* codes, const uint8_t (*bytes)[kCodes], const float* values,
                                         float absmax, int64_t n, float* out) {
  __m512i t[4][4];
  for (int b = 0; b < 4; ++b) {
    for (int q = 0; q < 4; ++q) t[b][q] = _mm512_loadu_si512(bytes[b] + 64 * q);
  }
  const __m512i order = _mm512_loadu_si512(kVbmiOrder);
  const __m512 a = _mm512_set1_ps(absmax);
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    const __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes + j));
    const __mmask64 top = _mm512_movepi8_mask(c);
    __m512i by[4];
    for (int b = 0; b < 4; ++b) {
      by[b] = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(t[b][0], c, t[b][1]),
                                     _mm512_permutex2var_epi8(t[b][2], c, t[b][3]));
    }
    const __m512i lo01 = _mm512_unpacklo_epi8(by[0], by[1]), hi01 = _mm512_unpackhi_epi8(by[0], by[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(by[2], by[3]), hi23 = _mm512_unpackhi_epi8(by[2], by[3]);
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23)), a));
    _mm512_storeu_ps(out + j + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23)), a));
    _mm512_storeu_ps(out + j + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23)), a));
    _mm512_storeu_ps(out + j + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23)), a));
  }
  for (; j < n; ++j) out[j] = values[codes[j]] * absmax;
}
#pragma GCC diagnostic pop

// Sixteen Philox counters in AVX-512 lanes: philox_rounds (math/philox.h) runs on them through these
// two lane operations. A 32x32->64 multiply is two vpmuludq (even and odd lanes), so the words are the
// scalar generator's exactly.
struct Lanes16 {
  __m512i v;
};

DISTOPT_AVX512_TARGET inline void philox_mulhilo(uint32_t m, Lanes16 c, Lanes16& hi, Lanes16& lo) {
  const __m512i mm = _mm512_set1_epi64(m);
  const __mmask16 odd = 0xAAAA;
  const __m512i even_p = _mm512_mul_epu32(mm, c.v), odd_p = _mm512_mul_epu32(mm, _mm512_srli_epi64(c.v, 32));
  hi.v = _mm512_mask_blend_epi32(odd, _mm512_srli_epi64(even_p, 32), odd_p);
  lo.v = _mm512_mask_blend_epi32(odd, even_p, _mm512_slli_epi64(odd_p, 32));
}

DISTOPT_AVX512_TARGET inline Lanes16 philox_xor3(Lanes16 a, Lanes16 b, uint32_t k) {
  return Lanes16{_mm512_ternarylogic_epi32(a.v, b.v, _mm512_set1_epi32(static_cast<int>(k)), 0x96)};
}

// GCC 12 warns inside its own 64-bit shift and multiply intrinsics (their undefined pass-through
// operand) once they are inlined here; the operand is never read.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// rounding_bits(keys, key, lo + j) for j in [0, n): words 0, 1 and 2 into w0, w1, w2, 16 counters at a
// time. `flatten`: philox_rounds and the lane operations are inlined into this AVX-512 function (the
// template itself has no target, so they could not be inlined into it).
DISTOPT_AVX512_TARGET __attribute__((flatten)) void rounding_bits_avx512(const PhiloxKeys& keys,
                                                                        const RoundingKey& key, int64_t lo,
                                                                        int64_t n, uint32_t* w0, uint32_t* w1,
                                                                        uint32_t* w2) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i pid = _mm512_set1_epi32(static_cast<int>(key.param_id)), stp = _mm512_set1_epi32(static_cast<int>(key.step));
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const uint64_t e = key.offset + static_cast<uint64_t>(lo + j);
    const __m512i e_lo = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(e)));
    Lanes16 c0{_mm512_add_epi32(e_lo, lane)};
    const __mmask16 carry = _mm512_cmplt_epu32_mask(c0.v, e_lo);
    const __m512i e_hi = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(e >> 32)));
    Lanes16 c1{_mm512_mask_add_epi32(e_hi, carry, e_hi, _mm512_set1_epi32(1))};
    Lanes16 c2{pid}, c3{stp};
    philox_rounds(c0, c1, c2, c3, keys);
    _mm512_storeu_si512(w0 + j, c0.v);
    _mm512_storeu_si512(w1 + j, c1.v);
    _mm512_storeu_si512(w2 + j, c2.v);
  }
  for (; j < n; ++j) {
    const Philox4 r = rounding_bits(keys, key, lo + j);
    w0[j] = r.w[0];
    w1[j] = r.w[1];
    w2[j] = r.w[2];
  }
}
#pragma GCC diagnostic pop

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

// codes[j] = quantize_by_buckets(x[j] * inv) (math/quant_tables.h), 16 lanes at a time: the bucket
// load is a gather, the count one add (Note [Quantisation by buckets]).
DISTOPT_AVX512_TARGET void quantize_avx512(const float* x, float inv, int64_t n, const uint32_t* buckets,
                                          uint32_t key_min, bool is_signed, uint8_t* codes) {
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i lo_clamp = _mm512_set1_epi32(static_cast<int>(key_min << 16));
  const __m512i hi_clamp = _mm512_set1_epi32(static_cast<int>(kBucketKeyMax << 16));
  const __m512i kmin = _mm512_set1_epi32(static_cast<int>(key_min));
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf_bits = _mm512_set1_epi32(0x7f800000);
  const __m512i c254 = _mm512_set1_epi32(254), zero_c = _mm512_set1_epi32(zero_code(is_signed));
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(x + j), vinv));
    const __m512i a = _mm512_and_si512(u, abs_mask);
    const __m512i ac = _mm512_min_epu32(_mm512_max_epu32(a, lo_clamp), hi_clamp);
    const __m512i idx = _mm512_sub_epi32(_mm512_srli_epi32(ac, 16), kmin);
    const __m512i e = _mm512_i32gather_epi32(idx, reinterpret_cast<const int*>(buckets), 4);
    const __m512i c = _mm512_srli_epi32(_mm512_add_epi32(ac, e), 16);  // the code of |y|
    const __mmask16 negative = _mm512_cmpneq_epu32_mask(u, a);
    __m512i code;
    if (is_signed) {  // negatives: 254 - c, at least 0
      code = _mm512_mask_blend_epi32(negative, c, _mm512_max_epi32(_mm512_sub_epi32(c254, c), _mm512_setzero_si512()));
    } else {
      code = _mm512_maskz_mov_epi32(static_cast<__mmask16>(~negative), c);
    }
    code = _mm512_mask_blend_epi32(_mm512_cmpgt_epu32_mask(a, inf_bits), code, zero_c);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j), _mm512_cvtepi32_epi8(code));
  }
  for (; j < n; ++j) codes[j] = static_cast<uint8_t>(quantize_by_buckets(x[j] * inv, buckets, key_min, is_signed));
}
#endif

// One moment list as the blocks read and write it.
struct MomentList {
  StateFormat format;
  const std::vector<void*>* data;    // per entry: float, bf16 or uint8 codes
  const std::vector<void*>* scales;  // 8-bit: per entry, the fp32 absmax of each block
  const float* values;               // 8-bit: the map
  const uint8_t (*value_bytes)[kCodes];  // 8-bit: the map as byte tables (dequantize_vbmi)
  const uint32_t* buckets;           // 8-bit: the bucket table (Note [Quantisation by buckets])
  uint32_t key_min;
  bool is_signed;
  bool avx512;  // the 8-bit loops' AVX-512 versions (else the scalar ones, which GCC vectorises less)
  bool vbmi;    // with AVX-512: the map read by byte permutes (dequantize_vbmi)
};

struct StatesCtx {
  AdamCall call;
  const std::vector<int64_t>* block_offsets;  // flat_offsets of each tensor's block count
  MomentList m, v;
  const AdamArgs* args;  // stochastic rounding: param ids and offsets
  PhiloxKeys keys;       // stochastic rounding: the seed's round keys
};

MomentList moment_list(StateFormat format, const TensorList& data, const TensorList& scales, bool is_signed) {
  const bool avx512 = cpu_isa() == CpuIsa::Avx512;
  MomentList l{format, &data.data, &scales.data, nullptr, nullptr, nullptr, 0, is_signed, avx512, false};
#if defined(DISTOPT_CPU_HAS_AVX512_PATH)
  l.vbmi = avx512 && cpu_vbmi();
#endif
  if (format == StateFormat::Blockwise8) {
    l.values = is_signed ? kSignedQuantMap.values : kUnsignedQuantMap.values;
    l.value_bytes = is_signed ? kSignedQuantBytes.b : kUnsignedQuantBytes.b;
    l.buckets = is_signed ? kSignedQuantMap.buckets : kUnsignedQuantMap.buckets;
    l.key_min = is_signed ? kSignedQuantMap.kKeyMin : kUnsignedQuantMap.kKeyMin;
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
      if (l.vbmi) {
        dequantize_vbmi(codes, l.value_bytes, values, absmax, n, buf);
        return buf;
      }
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
      // block_absmax_of_bits: one integer maximum of the bits & 0x7fffffff.
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
      const float absmax = block_absmax_of_bits(max_bits);
      static_cast<float*>((*l.scales)[i])[block] = absmax;
      const float inv = absmax_inverse(absmax);
      uint8_t* codes = static_cast<uint8_t*>(base) + lo;
      const uint32_t* __restrict buckets = l.buckets;
      const uint32_t key_min = l.key_min;
      const bool is_signed = l.is_signed;
#if defined(DISTOPT_CPU_HAS_AVX512_PATH)
      if (l.avx512) {
        quantize_avx512(x, inv, n, buckets, key_min, is_signed, codes);
        return;
      }
#endif
      for (int64_t j = 0; j < n; ++j) {
        codes[j] = static_cast<uint8_t>(quantize_by_buckets(x[j] * inv, buckets, key_min, is_signed));
      }
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
    const TensorLists& tl = *ctx->call.tl;
    const std::vector<int64_t>& offsets = *ctx->block_offsets;
    const bool sr = ctx->args->stochastic_rounding;
    // Random words only where a bf16 store takes them (Philox is the costliest part of a rounded update).
    const bool bits_needed = sr && (kRoundParam || ctx->m.format == StateFormat::BFloat16 ||
                                    ctx->v.format == StateFormat::BFloat16);
    const bool direct_bf16 =
        !sr && ctx->m.format == StateFormat::BFloat16 && ctx->v.format == StateFormat::BFloat16;
    alignas(64) float mbuf[kQuantBlock], vbuf[kQuantBlock], pbuf[kQuantBlock];
    alignas(64) uint32_t rnd[3][kQuantBlock];
    for (int64_t i = tensor_at(offsets, b); b < e; ++i) {
      const int64_t first = offsets[i];
      const int64_t block_hi = (e < offsets[i + 1] ? e : offsets[i + 1]) - first;
      const AdamCall& call = ctx->call;
      const double step = call.step_of(i);
      const AdamCoeffs c = call.coeffs_of(step);
      const float gf = grad_factor(call.grad_scale, c);
      RoundingKey key{};
      if (sr) {
        key.step = rounding_step(step);
        key.param_id = ctx->args->param_ids[i];
        key.offset = ctx->args->param_offsets.empty() ? 0 : ctx->args->param_offsets[i];
      }
      const int64_t numel = tl.numel[i];
      const ParamLists<P, G, O, kRem> lists(tl, i);

      if (direct_bf16) {
        // Both moments bf16, rounded to nearest: no block structure to keep, the loop converts in place.
        const int64_t lo = (b - first) * kQuantBlock;
        const int64_t hi = block_hi * kQuantBlock < numel ? block_hi * kQuantBlock : numel;
        lists.update(lo, hi - lo, static_cast<bf16_t*>((*ctx->m.data)[i]) + lo,
                     static_cast<bf16_t*>((*ctx->v.data)[i]) + lo, c, gf);
        b = first + block_hi;
        continue;
      }
      for (int64_t blk = b - first; blk < block_hi; ++blk) {
        const int64_t lo = blk * kQuantBlock;
        const int64_t n = numel - lo < kQuantBlock ? numel - lo : kQuantBlock;
        bool drawn = !bits_needed;
#if defined(DISTOPT_CPU_HAS_AVX512_PATH)
        if (!drawn && ctx->m.avx512) {
          rounding_bits_avx512(ctx->keys, key, lo, n, rnd[0], rnd[1], rnd[2]);
          drawn = true;
        }
#endif
        if (!drawn) {
          for (int64_t j = 0; j < n; ++j) {
            const Philox4 r = rounding_bits(ctx->keys, key, lo + j);
            rnd[0][j] = r.w[0];
            rnd[1][j] = r.w[1];
            rnd[2][j] = r.w[2];
          }
        }
        float* m = read_moment(ctx->m, i, lo, blk, n, mbuf);
        float* v = read_moment(ctx->v, i, lo, blk, n, vbuf);
        bool rounded = false;
        if constexpr (kRoundParam) {
          if (sr) {
            P* p = lists.p + lo;
            for (int64_t j = 0; j < n; ++j) pbuf[j] = to_float(p[j]);
            adam_piece<float, G, NoList, false>(pbuf, lists.g + lo, m, v, nullptr, nullptr, n, c, gf);
            for (int64_t j = 0; j < n; ++j) {
              const uint16_t bits = bf16_bits_stochastic(pbuf[j], rnd[0][j]);
              p[j] = P(bits, P::from_bits());
              pbuf[j] = float_from_bf16_bits(bits);
            }
            if constexpr (is_present<O>) {
              if (lists.out != nullptr) {
                O* out = lists.out + lo;
                for (int64_t j = 0; j < n; ++j) out[j] = from_float<O>(pbuf[j]);
              }
            }
            rounded = true;
          }
        }
        if (!rounded) lists.update(lo, n, m, v, c, gf);
        write_moment(ctx->m, i, lo, blk, n, m, bits_needed ? rnd[1] : nullptr);
        write_moment(ctx->v, i, lo, blk, n, v, bits_needed ? rnd[2] : nullptr);
      }
      b = first + block_hi;
    }
  }
};

}  // namespace

void adam_states_cpu(const TensorLists& tl, const AdamArgs& args) {
  std::vector<int64_t> blocks(tl.numel.size());
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = (tl.numel[i] + kQuantBlock - 1) / kQuantBlock;
  const std::vector<int64_t> block_offsets = flat_offsets(blocks);
  const StatesCtx ctx{AdamCall(tl, args), &block_offsets,
                      moment_list(args.exp_avg_format, tl.lists[kExpAvg], tl.lists[kExpAvgScale], true),
                      moment_list(args.exp_avg_sq_format, tl.lists[kExpAvgSq], tl.lists[kExpAvgSqScale], false), &args,
                      philox_keys(args.seed)};
  run_adam_ranges<StatesRange>(tl, ctx, block_offsets.back(), kGrainElements / kQuantBlock);
}

}  // namespace distopt
