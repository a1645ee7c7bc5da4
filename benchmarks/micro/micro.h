// What the micro-benchmarks share: the clock, and a bf16 block in the kernel's pair order as the
// AVX-512 kernel widens, rounds and narrows it (csrc/cpu/vec.h: widen_bf16,
// round_bf16_high_no_nan, bf16_words_pair). Not part of the extension; each program includes it.
#pragma once

#include <immintrin.h>

#include <chrono>

#include "../../csrc/core_clock.h"

namespace micro {

inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// ns per cycle, from csrc/core_clock.h's chain of dependent adds.
inline double cycle_ns() { return 1 / custom_ops::core_clock_ghz(); }

// 16 bf16 of pair order widened by one zero-masked vpermw of a 256-bit load.
inline __m512 widen_pairs(const void* p) {
  const __m512i order = _mm512_set_epi32(15 << 16, 13 << 16, 11 << 16, 9 << 16, 7 << 16,
                                         5 << 16, 3 << 16, 1 << 16, 14 << 16, 12 << 16, 10 << 16,
                                         8 << 16, 6 << 16, 4 << 16, 2 << 16, 0);
  return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(
      0xaaaaaaaau, order, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p))));
}

// bits + 0x7fff + bit 16: round to nearest even in the high half (the kernel's, NaN aside).
inline __m512i round_high(__m512 a) {
  const __m512i b = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), odd);
}

// The high words of two rounded blocks (a: elements [0, 16), b: [16, 32)) in memory order, for one
// 64-byte store: one vpermt2w.
inline __m512i pair_words(__m512i a_high, __m512i b_high) {
  const __m512i order = _mm512_set_epi32(
      (63 << 16) | 47, (61 << 16) | 45, (59 << 16) | 43, (57 << 16) | 41, (55 << 16) | 39,
      (53 << 16) | 37, (51 << 16) | 35, (49 << 16) | 33, (31 << 16) | 15, (29 << 16) | 13,
      (27 << 16) | 11, (25 << 16) | 9, (23 << 16) | 7, (21 << 16) | 5, (19 << 16) | 3,
      (17 << 16) | 1);
  return _mm512_permutex2var_epi16(a_high, order, b_high);
}

}  // namespace micro
