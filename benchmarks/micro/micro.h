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

// What the instruction loops (MICRO_LOOP) read and write.
alignas(64) inline char buf[1 << 14];

// An instruction loop timed: the best of five runs of n iterations, in ns per iteration, and the
// clock read around them, in ns per cycle.
struct Best {
  double ns, cycle_ns;
};
inline Best best_of_five(double (*loop)(long), long n) {
  const double before = cycle_ns();
  double best = 1e9;
  for (int r = 0; r < 5; ++r) {
    const double t = loop(n);
    best = t < best ? t : best;
  }
  return {best, (before + cycle_ns()) / 2};
}

#if defined(__AVX512F__)
// 16 bf16 of pair order widened by one zero-masked vpermw of a 256-bit load.
inline __m512 widen_pairs(const void* p) {
  return custom_ops::cpu::bf16_avx512::widen(_mm256_loadu_si256((const __m256i*)p));
}

using custom_ops::cpu::bf16_avx512::round_high_no_nan;
using custom_ops::cpu::bf16_avx512::words_pair;
#endif

}  // namespace micro

// double NAME(long n): n iterations of one asm statement (INSTRS; %0 is micro::buf), timed, in ns
// per iteration. The including file defines CLOBBERS, the registers its statements write.
#define MICRO_LOOP(NAME, INSTRS)                  \
  double NAME(long n) {                           \
    char* p = micro::buf;                         \
    const double t = micro::now();                \
    for (long i = 0; i < n; ++i) {                \
      asm volatile(INSTRS : : "r"(p) : CLOBBERS); \
    }                                             \
    return (micro::now() - t) / n * 1e9;          \
  }
