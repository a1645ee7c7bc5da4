// Which part of the AVX-512 bf16 kernel's pattern costs time with the state streaming from DRAM,
// one thread: the kernel's loads, stores, ring and prefetches step by step, then its block
// arithmetic, against an in-place read-modify-write of the same bytes. A task is one value head of
// a slot (128 rows of 128 bf16, 32 KiB); a call is B = 8 slots x 32 heads (Qwen3-Next's Hv) on
// fresh slots of a pool of 1280 MiB (a second argument: of that many 1 MiB slots; 1: in L2):
//   R   rmw: x |= 0 over each 64-byte line in order, 512 bits at a time
//   Rp  R with the kernel's prefetches: each line prefetched into L2 8 KiB ahead and into L1
//       3 KiB ahead
//   G   R in the kernel's order: groups of four rows, each 64-byte block of the four rows in turn
//   Gp  G with the prefetches
//   T   the kernel's two passes, block by block: pass one of group n + 2 loads its rows' 32-byte
//       blocks (four rows interleaved, with the prefetches) into a sink; pass two of group n
//       loads each line again, ORs zero and stores it
//   Tr  T with the kernel's ring: pass one widens each 32-byte block (zero-masked vpermw) and
//       stores it to an L1 ring of three groups; pass two reads a line's two blocks there, narrows
//       them (one vpermt2w) and stores the line: no arithmetic
//   Rn  Tr without the shuffles (the ring's stores and loads alone)
//   Sh  T with the shuffles (a vpermw per block, a vpermt2w per line) but no ring
//   A   Tr with the kernel's block arithmetic: pass one a multiply and an FMA, pass two two FMAs
//       and the bf16 rounding (shift, and, two adds) before the vpermt2w; no per-group tails
//   A0  A without prefetches; A6 and A4 with only a prefetch into L2, 6 or 4 KiB ahead
// Values are not the kernel's; the instruction mix and the memory pattern are. Prints each way's
// median us per call, interleaved, and R's time as a % of each. Needs AVX-512 F/BW/VL/DQ:
//
//   g++ -O2 -std=c++20 -mavx512f -mavx512bw -mavx512vl -mavx512dq -o /tmp/stream_patterns benchmarks/micro/stream_patterns.cpp && /tmp/stream_patterns [reps [slots [ring offset]]]
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "micro.h"

namespace {

constexpr int K = 128, Rows = 128, Hv = 32, B = 8;
constexpr size_t RowBytes = K * 2, TaskBytes = size_t(Rows) * RowBytes, SlotBytes = TaskBytes * Hv;
constexpr size_t PoolSlots = 1280;

volatile uint32_t g_zero = 0;
volatile float g_sink;

// Prefetch modes: 0 none, 1 the kernel's (into L2 8 KiB ahead and into L1 3 KiB ahead), 2 into
// L2 6 KiB ahead only, 3 into L2 4 KiB ahead only. asm statements, as the kernel's: GCC 12 drops
// both of mode 1's _mm_prefetch from the unrolled two-pass tasks (objdump shows none).
template <int Pf>
inline void prefetch_both(const char* p) {
  if constexpr (Pf == 1) {
    asm volatile("prefetcht1 8192(%0)" : : "r"(p));
    asm volatile("prefetcht0 3072(%0)" : : "r"(p));
  } else if constexpr (Pf == 2) {
    asm volatile("prefetcht1 6144(%0)" : : "r"(p));
  } else if constexpr (Pf == 3) {
    asm volatile("prefetcht1 4096(%0)" : : "r"(p));
  }
}

template <int Pf>
void task_r(char* t, __m512i z) {
  for (size_t o = 0; o < TaskBytes; o += 64) {
    prefetch_both<Pf>(t + o);
    auto* p = reinterpret_cast<__m512i*>(t + o);
    _mm512_store_si512(p, _mm512_or_si512(_mm512_load_si512(p), z));
  }
}

template <int Pf>
void task_g(char* t, __m512i z) {
  for (int g = 0; g < Rows; g += 4) {
    for (size_t o = 0; o < RowBytes; o += 64) {
      for (int r = 0; r < 4; ++r) {
        char* l = t + (g + r) * RowBytes + o;
        prefetch_both<Pf>(l);
        auto* p = reinterpret_cast<__m512i*>(l);
        _mm512_store_si512(p, _mm512_or_si512(_mm512_load_si512(p), z));
      }
    }
  }
}

// The ring: three slots of four widened rows, each a block longer than its rows, as the kernel's
// (so that the slot pass one writes is never a multiple of 4 KiB from the one pass two reads), at
// an offset from a 4 KiB boundary (a third argument, in bytes, rounded down to a multiple of 64).
constexpr int kRingSlot = 4 * K + 16;
float* ring_base;
inline float* ring(int g, int r, int t) {
  return ring_base + (g / 4) % 3 * kRingSlot + r * K + t;
}
alignas(64) float kk[K], qq[K];

// Modes of the two-pass tasks: 0 no ring (T), 1 the ring (Tr), 2 the ring and the arithmetic
// (A), 3 the ring without shuffles (Rn), 4 the shuffles without the ring (Sh).
struct Acc {
  __m512 u[4], y[4];
};

template <int Mode, int Pf>
__attribute__((always_inline)) inline void one_block(char* t, int g, int b, Acc& acc, __m512 eg) {
  #pragma GCC unroll 16
  for (int r = 0; r < 4; ++r) {
    char* l = t + (g + r) * RowBytes + b * 32;
    if (b % 2 == 0) prefetch_both<Pf>(l);
    if constexpr (Mode == 0 || Mode == 3) {
      const __m512 h = _mm512_castsi512_ps(
          _mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(l))));
      if constexpr (Mode == 3) {
        _mm512_store_ps(ring(g, r, b * 16), h);
      } else {
        acc.u[r] = _mm512_or_ps(acc.u[r], h);
      }
    } else if constexpr (Mode == 4) {
      acc.u[r] = _mm512_or_ps(acc.u[r], micro::widen_pairs(l));
    } else {
      __m512 w = micro::widen_pairs(l);
      if constexpr (Mode == 2) {
        w = _mm512_mul_ps(w, eg);
        acc.u[r] = _mm512_fmadd_ps(w, _mm512_load_ps(&kk[b * 16]), acc.u[r]);
      }
      _mm512_store_ps(ring(g, r, b * 16), w);
    }
  }
}

template <int Mode>
__attribute__((always_inline)) inline void two_pair(char* t, int g, int b, __m512i z, Acc& acc,
                                                 __m512 delta) {
  #pragma GCC unroll 16
  for (int r = 0; r < 4; ++r) {
    auto* p = reinterpret_cast<__m512i*>(t + (g + r) * RowBytes + b * 32);
    if constexpr (Mode == 3) {
      const __m512i lo = _mm512_castps_si512(_mm512_load_ps(ring(g, r, b * 16)));
      const __m512i hi = _mm512_castps_si512(_mm512_load_ps(ring(g, r, b * 16 + 16)));
      _mm512_store_si512(p, _mm512_or_si512(lo, hi));
    } else if constexpr (Mode == 4) {
      const __m512i x = _mm512_or_si512(_mm512_load_si512(p), z);
      _mm512_store_si512(p, micro::words_pair(x, x));
    } else if constexpr (Mode >= 1) {
      __m512i bits[2];
      #pragma GCC unroll 16
      for (int i = 0; i < 2; ++i) {
        const __m512 d = _mm512_load_ps(ring(g, r, b * 16 + 16 * i));
        if constexpr (Mode == 2) {
          const __m512 s = _mm512_fmadd_ps(delta, _mm512_load_ps(&kk[b * 16 + 16 * i]), d);
          acc.y[r] = _mm512_fmadd_ps(s, _mm512_load_ps(&qq[b * 16 + 16 * i]), acc.y[r]);
          bits[i] = micro::round_high_no_nan(s);
        } else {
          bits[i] = _mm512_or_si512(_mm512_castps_si512(d), z);
        }
      }
      _mm512_store_si512(p, micro::words_pair(bits[0], bits[1]));
    } else {
      _mm512_store_si512(p, _mm512_or_si512(_mm512_load_si512(p), z));
    }
  }
}

// Pass one of group g and pass two of group g - 8, block by block, as the kernel interleaves them.
template <int Mode, int Pf>
__attribute__((always_inline)) inline void step(char* t, int g, __m512i z, Acc& acc, __m512 eg,
                                             __m512 delta) {
  #pragma GCC unroll 16
  for (int b = 0; b < K / 16; ++b) {
    if (g < Rows) one_block<Mode, Pf>(t, g, b, acc, eg);
    if (g >= 8 && b % 2 == 1) two_pair<Mode>(t, g - 8, b - 1, z, acc, delta);
  }
}

template <int Mode, int Pf>
void task_t(char* t, __m512i z) {
  const __m512 eg = _mm512_set1_ps(0.9f + g_zero), delta = _mm512_set1_ps(0.01f + g_zero);
  Acc acc;
  #pragma GCC unroll 16
  for (int r = 0; r < 4; ++r) acc.u[r] = acc.y[r] = _mm512_setzero_ps();
  for (int g = 0; g < Rows + 8; g += 4) step<Mode, Pf>(t, g, z, acc, eg, delta);
  __m512 sum = _mm512_setzero_ps();
  #pragma GCC unroll 16
  for (int r = 0; r < 4; ++r) sum = _mm512_add_ps(sum, _mm512_add_ps(acc.u[r], acc.y[r]));
  g_sink = _mm512_reduce_add_ps(sum);
}

using Task = void (*)(char*, __m512i);
struct Way {
  const char* name;
  Task task;
};
const Way kWays[] = {
    {"R", task_r<0>},     {"Rp", task_r<1>},    {"G", task_g<0>},     {"Gp", task_g<1>},
    {"T", task_t<0, 1>},  {"Tr", task_t<1, 1>}, {"Rn", task_t<3, 1>}, {"Sh", task_t<4, 1>},
    {"A", task_t<2, 1>},  {"A0", task_t<2, 0>}, {"A6", task_t<2, 2>}, {"A4", task_t<2, 3>},
};
constexpr int kNumWays = sizeof(kWays) / sizeof(kWays[0]);

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 200;
  // A second argument: the pool's slots (1: its 1 MiB stays in L2).
  const size_t pool_slots = argc > 2 ? std::atoi(argv[2]) : PoolSlots;
  const size_t bytes = pool_slots * SlotBytes;
  char* pool = static_cast<char*>(std::aligned_alloc(4096, bytes));
  std::memset(pool, 1, bytes);
  const size_t ring_offset = argc > 3 ? std::atoi(argv[3]) % 4096 / 64 * 64 : 0;
  // Whole pages (aligned_alloc's rule), room for the offset.
  const size_t ring_bytes = (sizeof(float) * 3 * kRingSlot + 4095) / 4096 * 4096 + 4096;
  ring_base = reinterpret_cast<float*>(
      static_cast<char*>(std::aligned_alloc(4096, ring_bytes)) + ring_offset);
  std::vector<int> order(pool_slots);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(1));
  size_t cursor = 0;
  const __m512i z = _mm512_set1_epi32(g_zero);
  std::vector<std::vector<double>> us(kNumWays);
  for (int rep = 0; rep < reps + 2; ++rep) {
    for (int i = 0; i < kNumWays; ++i) {
      const Way& w = kWays[(i + rep) % kNumWays];
      int slots[B];
      for (int& s : slots) s = order[cursor++ % pool_slots];
      const double t0 = micro::now();
      for (int s : slots) {
        for (int h = 0; h < Hv; ++h) w.task(pool + s * SlotBytes + h * TaskBytes, z);
      }
      const double d = micro::now() - t0;
      if (rep >= 2) us[(i + rep) % kNumWays].push_back(d * 1e6);
    }
  }
  std::vector<double> med(kNumWays);
  for (int i = 0; i < kNumWays; ++i) {
    std::sort(us[i].begin(), us[i].end());
    med[i] = us[i][us[i].size() / 2];
  }
  std::printf("B=%d Hv=%d rows of %d bf16, 1 thread, fresh slots of %zu MiB, ring at 4 KiB + %zu, "
              "median of %d\n", B, Hv, K, bytes >> 20, ring_offset, reps);
  for (int i = 0; i < kNumWays; ++i) {
    std::printf("%-4s %8.1f us  %6.2f ns/row  %5.1f %% of R's time\n", kWays[i].name, med[i],
                med[i] * 1e3 / (B * Hv * Rows), 100 * med[0] / med[i]);
  }
}
