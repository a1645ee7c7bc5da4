// The AVX-512 bf16 state row's block work alone, in four layouts, in L1: what the row kernel's
// vector work costs without its per-group tails (sums, deltas, outputs), prefetches and calls.
// Per block of 16 elements of four rows: pass two of group n (the update, the output's FMA, the
// narrowing and store) and pass one of group n + 2 (the widening and the dot product's FMA),
// as csrc/cpu/kernel_impl.h interleaves them:
//   A  ring + pairs  the kernel's: pass one widens with a zero-masked vpermw and keeps the decayed
//                    fp32 block in an L1 ring, pass two reads it there; blocks stored in pairs
//                    (one vpermt2w, one 64-byte store)
//   B  rewiden       no ring: pass two widens the state again (a second vpermw)
//   C  units         the 32-element unit order (branch bf16-units): one 64-byte load widened by a
//                    shift and an and, no ring, narrowed without a shuffle
//   D  units + ring  C with the ring
// Prints ns and cycles per row of 128 (the clock from a chain of dependent adds). The values are
// not the kernel's (no finite test, no NaN handling); only the instruction mix is. Needs AVX-512
// F/BW/VL/DQ:
//
//   g++ -O2 -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -ffp-contract=off -o /tmp/bf16_blocks benchmarks/micro/bf16_blocks.cpp && /tmp/bf16_blocks
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>

#include "../../csrc/core_clock.h"

namespace {

constexpr int K = 128, R = 4;
alignas(64) uint16_t state[3][R][K];  // three groups of rows: pass two's and pass one's
alignas(64) float ring[3][R][K + 16];
alignas(64) float kk[K], qq[K];

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// ns per cycle, from csrc/core_clock.h's chain of dependent adds.
double cycle_ns() { return 1 / custom_ops::core_clock_ghz(); }

// bits + 0x7fff + bit 16: round to nearest even in the high half (the kernel's, NaN aside).
__m512i round_high(__m512 a) {
  const __m512i b = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), odd);
}

__m512 widen_pairs(const uint16_t* p) {
  const __m512i order = _mm512_set_epi32(15 << 16, 13 << 16, 11 << 16, 9 << 16, 7 << 16,
                                         5 << 16, 3 << 16, 1 << 16, 14 << 16, 12 << 16, 10 << 16,
                                         8 << 16, 6 << 16, 4 << 16, 2 << 16, 0);
  return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(
      0xaaaaaaaau, order, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p))));
}

__m512i narrow_pair(__m512 a, __m512 b) {
  const __m512i order = _mm512_set_epi32(
      (63 << 16) | 47, (61 << 16) | 45, (59 << 16) | 43, (57 << 16) | 41, (55 << 16) | 39,
      (53 << 16) | 37, (51 << 16) | 35, (49 << 16) | 33, (31 << 16) | 15, (29 << 16) | 13,
      (27 << 16) | 11, (25 << 16) | 9, (23 << 16) | 7, (21 << 16) | 5, (19 << 16) | 3,
      (17 << 16) | 1);
  return _mm512_permutex2var_epi16(round_high(a), order, round_high(b));
}

template <int kLayout>  // 0 A, 1 B, 2 C, 3 D
__attribute__((noinline)) void run(long groups, float* sink) {
  const __m512 decay = _mm512_set1_ps(0.9f);
  __m512 delta[R];
  for (int r = 0; r < R; ++r) {
    delta[r] = _mm512_set1_ps(0.01f * (r + 1));
  }
  __m512 total = _mm512_setzero_ps();
  for (long n = 0; n < groups; ++n) {
    const int cur = n % 3, ahead = (n + 2) % 3;
    __m512 u[R], acc[R];
    for (int r = 0; r < R; ++r) {
      u[r] = _mm512_setzero_ps();
      acc[r] = _mm512_setzero_ps();
    }
    if constexpr (kLayout <= 1) {
      __m512 held[R];
#pragma GCC unroll 8
      for (int t = 0; t < K; t += 16) {
        const __m512 kb = _mm512_load_ps(kk + t), qb = _mm512_load_ps(qq + t);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          __m512 x = kLayout == 0 ? _mm512_load_ps(&ring[cur][r][t])
                                  : _mm512_mul_ps(widen_pairs(&state[cur][r][t]), decay);
          x = _mm512_fmadd_ps(delta[r], kb, x);
          acc[r] = _mm512_fmadd_ps(x, qb, acc[r]);
          if ((t / 16) % 2 == 1) {
            _mm512_storeu_si512(&state[cur][r][t - 16], narrow_pair(held[r], x));
          } else {
            held[r] = x;
          }
          const __m512 y = _mm512_mul_ps(widen_pairs(&state[ahead][r][t]), decay);
          if (kLayout == 0) {
            _mm512_store_ps(&ring[ahead][r][t], y);
          }
          u[r] = _mm512_fmadd_ps(y, kb, u[r]);
        }
      }
    } else {
      const __m512i high = _mm512_set1_epi32(0xffff0000);
#pragma GCC unroll 4
      for (int t = 0; t < K; t += 32) {
        const __m512 kb0 = _mm512_load_ps(kk + t), qb0 = _mm512_load_ps(qq + t);
        const __m512 kb1 = _mm512_load_ps(kk + t + 16), qb1 = _mm512_load_ps(qq + t + 16);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          __m512 x0, x1;
          if (kLayout == 2) {
            const __m512i w = _mm512_loadu_si512(&state[cur][r][t]);
            x0 = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), decay);
            x1 = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(w, high)), decay);
          } else {
            x0 = _mm512_load_ps(&ring[cur][r][t]);
            x1 = _mm512_load_ps(&ring[cur][r][t + 16]);
          }
          x0 = _mm512_fmadd_ps(delta[r], kb0, x0);
          x1 = _mm512_fmadd_ps(delta[r], kb1, x1);
          acc[r] = _mm512_fmadd_ps(x0, qb0, acc[r]);
          acc[r] = _mm512_fmadd_ps(x1, qb1, acc[r]);
          // (x1's high half) | (x0's high half >> 16)
          _mm512_storeu_si512(&state[cur][r][t],
                              _mm512_ternarylogic_epi32(_mm512_srli_epi32(round_high(x0), 16),
                                                        round_high(x1), high, 0xf8));
          const __m512i v = _mm512_loadu_si512(&state[ahead][r][t]);
          const __m512 y0 = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), decay);
          const __m512 y1 = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(v, high)), decay);
          if (kLayout == 3) {
            _mm512_store_ps(&ring[ahead][r][t], y0);
            _mm512_store_ps(&ring[ahead][r][t + 16], y1);
          }
          u[r] = _mm512_fmadd_ps(y0, kb0, u[r]);
          u[r] = _mm512_fmadd_ps(y1, kb1, u[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      total = _mm512_add_ps(total, _mm512_add_ps(u[r], acc[r]));
    }
  }
  _mm512_storeu_ps(sink, total);
}

} // namespace

int main() {
  for (int i = 0; i < K; ++i) {
    kk[i] = 0.01f * i;
    qq[i] = 0.02f;
  }
  std::fill(&state[0][0][0], &state[0][0][0] + 3 * R * K, uint16_t{0x3f80});  // bf16 1.0
  const char* names[] = {"A ring + pairs (kernel)", "B rewiden + pairs", "C units, no ring",
                         "D units + ring"};
  void (*layouts[])(long, float*) = {run<0>, run<1>, run<2>, run<3>};
  float sink[16];
  const long groups = 200000;
  for (int round = 0; round < 3; ++round) {
    for (int m = 0; m < 4; ++m) {
      const double before = cycle_ns();
      double best = 1e9;
      for (int k = 0; k < 7; ++k) {
        const double t = now();
        layouts[m](groups, sink);
        best = std::min(best, (now() - t) / groups / R * 1e9);
      }
      const double c = (before + cycle_ns()) / 2;
      std::printf("%-24s %6.2f ns/row  %5.1f cycles/row  (%.2f GHz)\n", names[m], best, best / c,
                  1 / c);
    }
  }
  return sink[0] == 12345.f;  // keeps the results live
}
