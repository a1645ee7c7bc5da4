// The AVX-512 bf16 state row's block work alone, in several layouts, in L1: what the row kernel's
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
//   E  registers     no ring: groups of two (or one) rows, pass one one group ahead, the decayed
//                    blocks of a group kept in registers until pass two; the deltas from the lane
//                    sums of u, so pass two waits for pass one's reduction (A to D have no tails)
//   F  registers, lead 2  one row at a time, pass one two rows ahead, the decayed blocks of the two
//                    rows in flight in registers (16 of 32); a tail per row as E's
//   G  A, rounded without a shift: (bits + 0x8000) with bit 16 cleared at a tie, by two ternary
//                    logic operations and two adds instead of a shift, an and and two adds
// Layouts with the block loop unrolled by an index sequence, as the kernel's (for_blocks), so that
// which blocks use the ring is known at compile time:
//   A' the kernel's layout A in this form (the baseline of those below)
//   H  A', rounded by a bit-16 test into a mask and a masked add of 1 to bits + 0x7fff
//   I  A', rounded by bits + (bit 16 ? 0x8000 : 0x7fff), the constant picked by a masked move
//   J  A' with the ring on even blocks only: pass two widens the odd blocks again
//   K  the ring on three blocks of four (not the last of each four)
//   L  the ring on one block of four
// GCC 12 keeps part of E's and F's "registers" on the stack (objdump): what they show is what the
// kernel's compiler would make of them.
// Prints ns and cycles per row of 128 (the clock from a chain of dependent adds). The values are
// not the kernel's (no finite test, no NaN handling); only the instruction mix is. Needs AVX-512
// F/BW/VL/DQ:
//
//   g++ -O2 -std=c++20 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -ffp-contract=off -o /tmp/bf16_blocks benchmarks/micro/bf16_blocks.cpp && /tmp/bf16_blocks
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <utility>

#include "micro.h"

namespace {

constexpr int K = 128, R = 4;
alignas(64) uint16_t state[3][R][K];  // three groups of rows: pass two's and pass one's
alignas(64) float ring[3][R][K + 16];
alignas(64) float kk[K], qq[K];

using micro::cycle_ns;
using micro::now;
using micro::round_high_no_nan;
using micro::widen_pairs;

// The same rounding without a shift: bits + 0x8000 carries into the high half from 0x8000 up;
// at a tie (low half 0x8000) bit 16 of the sum is cleared, which undoes the carry from an even
// value and leaves that from an odd one.
__m512i round_high_noshift(__m512 a) {
  const __m512i b = _mm512_castps_si512(a);
  // (b & 0xffff) ^ 0x8000 is 0 exactly at a tie; + 0xffff sets bit 16 everywhere else
  const __m512i y = _mm512_ternarylogic_epi32(b, _mm512_set1_epi32(0xffff),
                                              _mm512_set1_epi32(0x8000), 0x6a);
  const __m512i z = _mm512_add_epi32(y, _mm512_set1_epi32(0xffff));
  const __m512i s = _mm512_add_epi32(b, _mm512_set1_epi32(0x8000));
  return _mm512_ternarylogic_epi32(s, z, _mm512_set1_epi32(0xfffeffff), 0xe0);  // s & (z | c)
}

// H: bits + 0x7fff, plus 1 where bit 16 is set (a mask from a test, a masked add).
__m512i round_high_test_add(__m512 a) {
  const __m512i b = _mm512_castps_si512(a);
  const __mmask16 odd = _mm512_test_epi32_mask(b, _mm512_set1_epi32(0x10000));
  const __m512i t = _mm512_add_epi32(b, _mm512_set1_epi32(0x7fff));
  return _mm512_mask_add_epi32(t, odd, t, _mm512_set1_epi32(1));
}

// I: bits + (bit 16 ? 0x8000 : 0x7fff), the constant picked by a masked move.
__m512i round_high_test_pick(__m512 a) {
  const __m512i b = _mm512_castps_si512(a);
  const __mmask16 odd = _mm512_test_epi32_mask(b, _mm512_set1_epi32(0x10000));
  return _mm512_add_epi32(
      b, _mm512_mask_mov_epi32(_mm512_set1_epi32(0x7fff), odd, _mm512_set1_epi32(0x8000)));
}

// Whether f's high halves equal round_high_no_nan's for every 32-bit pattern.
template <__m512i (*f)(__m512)>
bool same_rounding() {
  const __m512i high = _mm512_set1_epi32(0xffff0000), step = _mm512_set1_epi32(16);
  __m512i b = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (uint64_t i = 0; i < (uint64_t{1} << 32); i += 16, b = _mm512_add_epi32(b, step)) {
    const __m512 a = _mm512_castsi512_ps(b);
    const __m512i d = _mm512_and_si512(_mm512_xor_si512(round_high_no_nan(a), f(a)), high);
    if (_mm512_test_epi32_mask(d, d) != 0) {
      return false;
    }
  }
  return true;
}

// Each layout's rows' deltas (row r: 0.01 (r + 1)).
void set_deltas(__m512* delta, int rows) {
  for (int r = 0; r < rows; ++r) {
    delta[r] = _mm512_set1_ps(0.01f * (r + 1));
  }
}

template <bool kNoShift = false, __m512i (*round)(__m512) = round_high_no_nan>
__m512i narrow_pair(__m512 a, __m512 b) {
  if constexpr (kNoShift) {
    return micro::words_pair(round_high_noshift(a), round_high_noshift(b));
  }
  return micro::words_pair(round(a), round(b));
}

// E: groups of kRows rows, pass one one group ahead, the decayed blocks kept in registers from
// pass one to pass two; k and q read from memory by the FMAs. The deltas come from the lane sums
// of u (as the kernel's tails), so pass two waits for pass one's reduction.
template <int R2>
__attribute__((noinline)) void run_regs(long groups, float* sink) {
  constexpr int NB = K / 16;
  const __m512 decay = _mm512_set1_ps(0.9f);
  __m512 delta[R2];
  set_deltas(delta, R2);
  __m512 total = _mm512_setzero_ps();
  __m512 d[R2][NB];
#pragma GCC unroll 8
  for (int b = 0; b < NB; ++b) {
#pragma GCC unroll 2
    for (int r = 0; r < R2; ++r) {
      d[r][b] = _mm512_mul_ps(widen_pairs(&state[0][r][b * 16]), decay);
    }
  }
  for (long n = 0; n < groups; ++n) {
    const int cur = n % 3, ahead = (n + 1) % 3;
    __m512 u[R2], acc[R2], held[R2];
    for (int r = 0; r < R2; ++r) {
      u[r] = _mm512_setzero_ps();
      acc[r] = _mm512_setzero_ps();
    }
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {
      const int t = b * 16;
#pragma GCC unroll 2
      for (int r = 0; r < R2; ++r) {
        __m512 x = _mm512_fmadd_ps(delta[r], _mm512_load_ps(kk + t), d[r][b]);
        acc[r] = _mm512_fmadd_ps(x, _mm512_load_ps(qq + t), acc[r]);
        if (b % 2 == 1) {
          _mm512_storeu_si512(&state[cur][r][t - 16], narrow_pair(held[r], x));
        } else {
          held[r] = x;
        }
        d[r][b] = _mm512_mul_ps(widen_pairs(&state[ahead][r][t]), decay);
        u[r] = _mm512_fmadd_ps(d[r][b], _mm512_load_ps(kk + t), u[r]);
      }
    }
    for (int r = 0; r < R2; ++r) {
      delta[r] = _mm512_set1_ps(0.5f * (1.f - _mm512_reduce_add_ps(u[r])));
      total = _mm512_add_ps(total, acc[r]);
    }
  }
  _mm512_storeu_ps(sink, total);
}

// F: one row at a time, pass one two rows ahead; the decayed blocks of the two rows in flight
// kept in registers (16), k and q from memory. Deltas from the lane sums of u.
template <int N, typename F>
__attribute__((always_inline)) inline void unrolled(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) __attribute__((always_inline)) {
    (f(std::integral_constant<int, I>{}), ...);
  }(std::make_integer_sequence<int, N>{});
}

__attribute__((always_inline)) inline void row_step(__m512 (&d)[K / 16], __m512& delta,
                                                    uint16_t* cur, const uint16_t* ahead,
                                                    __m512 decay, __m512& total) {
  __m512 u = _mm512_setzero_ps(), acc = _mm512_setzero_ps(), held;
  unrolled<K / 16>([&](auto bc) __attribute__((always_inline)) {
    constexpr int b = bc, t = b * 16;
    __m512 x = _mm512_fmadd_ps(delta, _mm512_load_ps(kk + t), d[b]);
    acc = _mm512_fmadd_ps(x, _mm512_load_ps(qq + t), acc);
    if constexpr (b % 2 == 1) {
      _mm512_storeu_si512(cur + t - 16, narrow_pair(held, x));
    } else {
      held = x;
    }
    d[b] = _mm512_mul_ps(widen_pairs(ahead + t), decay);
    u = _mm512_fmadd_ps(d[b], _mm512_load_ps(kk + t), u);
  });
  delta = _mm512_set1_ps(0.5f * (1.f - _mm512_reduce_add_ps(u)));
  total = _mm512_add_ps(total, acc);
}

__attribute__((noinline)) void run_regs_lead2(long groups, float* sink) {
  const __m512 decay = _mm512_set1_ps(0.9f);
  __m512 da[K / 16], db[K / 16];
  __m512 delta_a = _mm512_set1_ps(0.01f), delta_b = _mm512_set1_ps(0.02f);
  for (int b = 0; b < K / 16; ++b) {
    da[b] = _mm512_mul_ps(widen_pairs(&state[0][0][b * 16]), decay);
    db[b] = _mm512_mul_ps(widen_pairs(&state[0][1][b * 16]), decay);
  }
  __m512 total = _mm512_setzero_ps();
  uint16_t* rows = &state[0][0][0];  // 12 rows of K, used as a ring
  for (long n = 0; n < groups; n += 2) {
    const int i = n % 12;
    row_step(da, delta_a, rows + i * K, rows + ((i + 2) % 12) * K, decay, total);
    row_step(db, delta_b, rows + (i + 1) * K, rows + ((i + 3) % 12) * K, decay, total);
  }
  _mm512_storeu_ps(sink, total);
}

// The loop of the four-row layouts (A to D, A' to L): group n's pass two on ring and state slot
// n % 3 and pass one of group n + 2 on slot (n + 2) % 3, by `step`, with u and acc zeroed before
// it and summed after, so that the work stays live.
template <typename Step>
__attribute__((always_inline)) inline void each_group(long groups, float* sink, Step&& step) {
  const __m512 decay = _mm512_set1_ps(0.9f);
  __m512 delta[R];
  set_deltas(delta, R);
  __m512 total = _mm512_setzero_ps();
  for (long n = 0; n < groups; ++n) {
    __m512 u[R], acc[R];
    for (int r = 0; r < R; ++r) {
      u[r] = _mm512_setzero_ps();
      acc[r] = _mm512_setzero_ps();
    }
    step(static_cast<int>(n % 3), static_cast<int>((n + 2) % 3), decay, delta, u, acc);
    for (int r = 0; r < R; ++r) {
      total = _mm512_add_ps(total, _mm512_add_ps(u[r], acc[r]));
    }
  }
  _mm512_storeu_ps(sink, total);
}

template <int kLayout>  // 0 A, 1 B, 2 C, 3 D, 4 A without the shift
__attribute__((noinline)) void run(long groups, float* sink) {
  each_group(groups, sink, [&](int cur, int ahead, __m512 decay, const __m512(&delta)[R],
                               __m512(&u)[R], __m512(&acc)[R]) __attribute__((always_inline)) {
    if constexpr (kLayout <= 1 || kLayout == 4) {
      __m512 held[R];
#pragma GCC unroll 8
      for (int t = 0; t < K; t += 16) {
        const __m512 kb = _mm512_load_ps(kk + t), qb = _mm512_load_ps(qq + t);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          __m512 x = kLayout != 1 ? _mm512_load_ps(&ring[cur][r][t])
                                  : _mm512_mul_ps(widen_pairs(&state[cur][r][t]), decay);
          x = _mm512_fmadd_ps(delta[r], kb, x);
          acc[r] = _mm512_fmadd_ps(x, qb, acc[r]);
          if ((t / 16) % 2 == 1) {
            _mm512_storeu_si512(&state[cur][r][t - 16], narrow_pair<kLayout == 4>(held[r], x));
          } else {
            held[r] = x;
          }
          const __m512 y = _mm512_mul_ps(widen_pairs(&state[ahead][r][t]), decay);
          if (kLayout != 1) {
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
          const __m512i low = _mm512_srli_epi32(round_high_no_nan(x0), 16);
          _mm512_storeu_si512(&state[cur][r][t],
                              _mm512_ternarylogic_epi32(low, round_high_no_nan(x1), high, 0xf8));
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
  });
}

// A', H, I, J, K, L (above): pass two of group n and pass one of group n + 2, block by block
// (an index sequence, as the kernel's for_blocks), rounded by `round`; block b goes through the
// ring where b % kRingOf < kRingEvery.
template <__m512i (*round)(__m512), int kRingEvery, int kRingOf>
__attribute__((noinline)) void run_blocks(long groups, float* sink) {
  each_group(groups, sink, [&](int cur, int ahead, __m512 decay, const __m512(&delta)[R],
                               __m512(&u)[R], __m512(&acc)[R]) __attribute__((always_inline)) {
    __m512 held[R];
    auto block = [&]<int b>(std::integral_constant<int, b>) __attribute__((always_inline)) {
      constexpr int t = b * 16;
      constexpr bool ring_on = b % kRingOf < kRingEvery;
      const __m512 kb = _mm512_load_ps(kk + t), qb = _mm512_load_ps(qq + t);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __m512 x = ring_on ? _mm512_load_ps(&ring[cur][r][t])
                           : _mm512_mul_ps(widen_pairs(&state[cur][r][t]), decay);
        x = _mm512_fmadd_ps(delta[r], kb, x);
        acc[r] = _mm512_fmadd_ps(x, qb, acc[r]);
        if constexpr (b % 2 == 1) {
          _mm512_storeu_si512(&state[cur][r][t - 16], narrow_pair<false, round>(held[r], x));
        } else {
          held[r] = x;
        }
        const __m512 y = _mm512_mul_ps(widen_pairs(&state[ahead][r][t]), decay);
        if constexpr (ring_on) {
          _mm512_store_ps(&ring[ahead][r][t], y);
        }
        u[r] = _mm512_fmadd_ps(y, kb, u[r]);
      }
    };
    [&]<int... I>(std::integer_sequence<int, I...>) __attribute__((always_inline)) {
      (block(std::integral_constant<int, I>{}), ...);
    }(std::make_integer_sequence<int, K / 16>{});
  });
}

} // namespace

int main() {
  std::printf("G's rounding equals A's for all 2^32 bit patterns: %s\n",
              same_rounding<round_high_noshift>() ? "yes" : "NO");
  std::printf("H's: %s; I's: %s\n", same_rounding<round_high_test_add>() ? "yes" : "NO",
              same_rounding<round_high_test_pick>() ? "yes" : "NO");
  for (int i = 0; i < K; ++i) {
    kk[i] = 0.01f * i;
    qq[i] = 0.02f;
  }
  std::fill(&state[0][0][0], &state[0][0][0] + 3 * R * K, uint16_t{0x3f80});  // bf16 1.0
  const char* names[] = {"A ring + pairs (kernel)", "B rewiden + pairs", "C units, no ring",
                         "D units + ring", "E registers, 2 rows", "E registers, 1 row", "F registers, 1 row, lead 2", "G A, rounding without shift",
                         "A' kernel, block sequence", "H A', test and masked add", "I A', test and masked move",
                         "J A', ring on even blocks", "K A', ring on 3 of 4", "L A', ring on 1 of 4"};
  void (*layouts[])(long, float*) = {run<0>, run<1>, run<2>, run<3>, run_regs<2>, run_regs<1>, run_regs_lead2, run<4>,
                                     run_blocks<round_high_no_nan, 1, 1>, run_blocks<round_high_test_add, 1, 1>,
                                     run_blocks<round_high_test_pick, 1, 1>, run_blocks<round_high_no_nan, 1, 2>,
                                     run_blocks<round_high_no_nan, 3, 4>, run_blocks<round_high_no_nan, 1, 4>};
  const int rows[] = {R, R, R, R, 2, 1, 1, R, R, R, R, R, R, R};
  constexpr int kLayouts = sizeof(rows) / sizeof(rows[0]);
  float sink[16];
  const long groups = 200000;
  for (int round = 0; round < 3; ++round) {
    for (int m = 0; m < kLayouts; ++m) {
      const double before = cycle_ns();
      double best = 1e9;
      for (int k = 0; k < 7; ++k) {
        const double t = now();
        layouts[m](groups, sink);
        best = std::min(best, (now() - t) / groups / rows[m] * 1e9);
      }
      const double c = (before + cycle_ns()) / 2;
      std::printf("%-28s %6.2f ns/row  %5.1f cycles/row  (%.2f GHz)\n", names[m], best, best / c,
                  1 / c);
    }
  }
  return sink[0] == 12345.f;  // keeps the results live
}
