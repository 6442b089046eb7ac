// Philox4x32-10, the generator of stochastic rounding's bits: one definition of its rounds, run on one
// counter at a time (uint32_t lanes: the CUDA kernels and every scalar loop) or on 16 counters at once
// (the CPU's AVX-512 lanes, cpu/adam_states.cpp), which supply their own multiply and xor.
//
// Note [Stochastic rounding bits]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every stochastic rounding takes its random bits from Philox4x32-10 (Salmon et al., SC'11: the
// generator of curand and of torch's CUDA RNG) keyed by the seed, with the counter (element index
// low, element index high, param id, step). The element index counts from the param's first element
// (a tensor that is a slice of a param passes its offset), so the bits depend only on (seed, step,
// param, element): never on threads, launches, chunks, buckets or ranks. The four output words are
// the element's: word 0 rounds the param, 1 the exp_avg, 2 the exp_avg_sq.
//
// The key schedule (round r XORs k0 + r W0 and k1 + r W1) depends on the seed alone, so it is computed
// once per update (philox_keys) instead of in every call: the CUDA kernels take it as a kernel
// argument (uniform registers, loaded once), and a call is then two 32x32->64 multiplies and two
// three-input xors per round. The same words as computing it in the rounds.
#pragma once

#include <cstdint>

#include "../common/types.h"

namespace distopt {

// Philox4x32-10's multipliers and key increments (Salmon et al., 2011).
constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u, kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

// The round keys of a seed: round r uses k0[r], k1[r].
struct PhiloxKeys {
  uint32_t k0[kPhiloxRounds];
  uint32_t k1[kPhiloxRounds];
};

DISTOPT_HD constexpr PhiloxKeys philox_keys(uint64_t seed) {
  PhiloxKeys k{};
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int r = 0; r < kPhiloxRounds; ++r) {
    k.k0[r] = k0;
    k.k1[r] = k1;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  return k;
}

// The lane operations of the scalar rounds: hi:lo = m * c (32x32->64), and a ^ b ^ k.
DISTOPT_HD void philox_mulhilo(uint32_t m, uint32_t c, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(m) * static_cast<uint64_t>(c);
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

DISTOPT_HD uint32_t philox_xor3(uint32_t a, uint32_t b, uint32_t k) { return a ^ b ^ k; }

// Rounds first..9 on the counter (c0, c1, c2, c3), in place: Lanes is uint32_t, or a vector of
// counters with philox_mulhilo(uint32_t, Lanes, Lanes&, Lanes&) and philox_xor3(Lanes, Lanes, uint32_t)
// overloads (found by argument-dependent lookup).
template <typename Lanes>
DISTOPT_HD void philox_rounds(Lanes& c0, Lanes& c1, Lanes& c2, Lanes& c3, const PhiloxKeys& key, int first = 0) {
DISTOPT_UNROLL
  for (int r = first; r < kPhiloxRounds; ++r) {
    Lanes hi0, lo0, hi1, lo1;
    philox_mulhilo(kPhiloxM0, c0, hi0, lo0);
    philox_mulhilo(kPhiloxM1, c2, hi1, lo1);
    c0 = philox_xor3(hi1, c1, key.k0[r]);
    c1 = lo1;
    c2 = philox_xor3(hi0, c3, key.k1[r]);
    c3 = lo0;
  }
}

struct Philox4 {
  uint32_t w[4];
};

// Philox4x32-10 of one counter and key (Random123's known answers: tests/ops/test_ops_adam_states.py).
DISTOPT_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, const PhiloxKeys& key) {
  philox_rounds(c0, c1, c2, c3, key);
  return Philox4{{c0, c1, c2, c3}};
}

// What a tensor's roundings are keyed by besides the seed's round keys: the step (the same for every
// element of a call), the param id, and the tensor's first element within its param.
struct RoundingKey {
  uint32_t step;
  uint32_t param_id;
  uint64_t offset;
};

// The random words of element `index` of the tensor keyed by `key` (Note [Stochastic rounding bits]).
DISTOPT_HD Philox4 rounding_bits(const PhiloxKeys& keys, const RoundingKey& key, int64_t index) {
  const uint64_t e = key.offset + static_cast<uint64_t>(index);
  return philox4x32_10(static_cast<uint32_t>(e), static_cast<uint32_t>(e >> 32), key.param_id, key.step, keys);
}

// rounding_bits for the elements of one tensor: what rounds 0 and 1 take from terms that are the same
// for all of them (the param id's product, the step, their round keys) combined once. The same xors,
// grouped otherwise, so the same words; a call is then the two multiplies and two xors of each round
// but round 0's (one and two).
struct RoundingStream {
  uint64_t offset;  // the tensor's first element within its param
  uint32_t c0_key;  // hi(M1 * param id) ^ k0[0]: round 0's c0 is it ^ the index's high word
  uint32_t c1_key;  // lo(M1 * param id) ^ k0[1]: round 0's c1, with round 1's key
  uint32_t c2_key;  // step ^ k1[0]: round 0's c2 is it ^ hi(M0 * the index's low word)
};

DISTOPT_HD RoundingStream rounding_stream(const PhiloxKeys& keys, const RoundingKey& key) {
  uint32_t hi1 = 0, lo1 = 0;
  philox_mulhilo(kPhiloxM1, key.param_id, hi1, lo1);
  return RoundingStream{key.offset, hi1 ^ keys.k0[0], lo1 ^ keys.k0[1], key.step ^ keys.k1[0]};
}

// The words of the element whose index within its param is e (the stream's offset plus its index in the
// tensor: a caller may add the offset once for many elements).
DISTOPT_HD Philox4 rounding_bits_at(const PhiloxKeys& keys, const RoundingStream& s, uint64_t e) {
  uint32_t hi0 = 0, lo0 = 0;
  philox_mulhilo(kPhiloxM0, static_cast<uint32_t>(e), hi0, lo0);  // round 0
  uint32_t c0 = s.c0_key ^ static_cast<uint32_t>(e >> 32), c2 = s.c2_key ^ hi0, c3 = lo0;
  uint32_t hi1 = 0, lo1 = 0;  // round 1, its c1 (round 0's) a constant
  philox_mulhilo(kPhiloxM0, c0, hi0, lo0);
  philox_mulhilo(kPhiloxM1, c2, hi1, lo1);
  c0 = hi1 ^ s.c1_key;
  uint32_t c1 = lo1;
  c2 = philox_xor3(hi0, c3, keys.k1[1]);
  c3 = lo0;
  philox_rounds(c0, c1, c2, c3, keys, 2);
  return Philox4{{c0, c1, c2, c3}};
}

DISTOPT_HD Philox4 rounding_bits(const PhiloxKeys& keys, const RoundingStream& s, int64_t index) {
  return rounding_bits_at(keys, s, s.offset + static_cast<uint64_t>(index));
}

// The step as the counter word: whole steps (the eager step, or a capturable float32 step tensor).
DISTOPT_HD uint32_t rounding_step(double step) { return static_cast<uint32_t>(static_cast<uint64_t>(step)); }

}  // namespace distopt
