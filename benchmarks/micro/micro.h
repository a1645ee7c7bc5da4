// What the micro-benchmarks share: the clock, and (with AVX-512) a bf16 block in the kernel's pair
// order as the AVX-512 kernel widens, rounds and narrows it (the kernel's own code:
// csrc/cpu/bf16_avx512.h). Not part of the extension; each program includes it.
#pragma once

#include <immintrin.h>

#include <chrono>

#include "../../csrc/core_clock.h"
#if defined(__AVX512F__)
#include "../../csrc/cpu/bf16_avx512.h"
#endif

namespace micro {

inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// ns per cycle, from csrc/core_clock.h's chain of dependent adds.
inline double cycle_ns() { return 1 / custom_ops::core_clock_ghz(); }

#if defined(__AVX512F__)
// 16 bf16 of pair order widened by one zero-masked vpermw of a 256-bit load.
inline __m512 widen_pairs(const void* p) {
  return custom_ops::cpu::bf16_avx512::widen(_mm256_loadu_si256((const __m256i*)p));
}

using custom_ops::cpu::bf16_avx512::round_high_no_nan;
using custom_ops::cpu::bf16_avx512::words_pair;
#endif

}  // namespace micro
