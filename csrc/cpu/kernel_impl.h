// The fused CPU kernel body. Included once per instruction set by kernel_<isa>.cpp, each compiled
// with its own CPU_CAPABILITY and instruction-set flags (see setup.py); vec.h supplies that ISA's
// blocks, so this file reads as math and computes the same bits for every ISA.
//
// Memory-bound: the state is B*Hv*V*K elements and each element is loaded once from memory and
// stored once. Per state row (K elements) we make two passes that both hit L1: the first computes
// u = (exp(g) S) k, the second writes S' = exp(g) S + delta k^T and accumulates out = S' q.
#pragma once

#define CUSTOM_OPS_CONCAT_(a, b) a##b
#define CUSTOM_OPS_CONCAT(a, b) CUSTOM_OPS_CONCAT_(a, b)

#if defined(CUSTOM_OPS_CPU_VARIANT_OFF)
// A variant this build leaves out (setup.py): compiled without its instruction-set flags, with
// kernel bodies that the dispatch never calls (kernel_built_<CAPABILITY> is false).
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdlib>

#include "cpu/kernel.h"

namespace custom_ops::cpu {
const bool CUSTOM_OPS_CONCAT(kernel_built_, CPU_CAPABILITY) = false;
template <typename T, typename S>
void CUSTOM_OPS_CONCAT(fused_gdn_decode_kernel_, CPU_CAPABILITY)(const GdnParams&) {
  std::abort();
}
#else
// vec.h first: it includes the intrinsic headers ahead of ATen (see there).
#include "cpu/vec.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>

#include "cpu/kernel.h"

namespace custom_ops::cpu {
namespace CPU_CAPABILITY {
namespace {

// Below this many state elements a parallel chunk is not worth a thread.
constexpr int64_t kGrainElements = 1 << 14;
constexpr float kNormEps = 1e-6f;

// The element order StateIo<S>::load produces within one block: order[l] is the memory index of
// the element in lane l. Found by loading the indices themselves.
template <typename S>
void element_order(int32_t order[kBlock]) {
  S idx[kBlock];
  for (int64_t e = 0; e < kBlock; ++e) {
    idx[e] = static_cast<S>(static_cast<float>(e));  // exact: e < 2^8
  }
  Blk b;
  StateIo<S>::load(idx, b);
  float f[kBlock];
  blk_store(f, b);
  for (int64_t l = 0; l < kBlock; ++l) {
    order[l] = static_cast<int32_t>(f[l]);
  }
}

inline int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

// How far ahead of pass one (in bytes of state) to prefetch, so that more misses are in flight
// than the hardware prefetchers alone keep when the state streams from DRAM: 8 KiB. On AMD Zen 3
// (avx2, prefetches into L1 then) 8 KiB brought fp32 about 3 points of rmw nearer it from DRAM
// than 4 KiB, 16-bit states within the runs' spread (docs/bench_ab_avx2_prefetch.txt).
constexpr int64_t kPrefetchBytes = 8192;

// How far ahead a 16-bit state's pass one also prefetches into L1 (prefetch_line), on AVX-512,
// which prefetches into L2 kPrefetchBytes ahead: 3 KiB, so a line's prefetch into L1 comes
// 5 KiB of pass one after the one into L2. 0: none (AVX2 and the portable code).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kNearPrefetchBytes = 3072;
#else
constexpr int64_t kNearPrefetchBytes = 0;
#endif

// kGroupRows: rows updated together (one group). A group's scalar tail (horizontal sums, v,
// deltas, the finite test, the outputs) is one vector step for four rows (Quad) instead of four
// scalar ones. kSerialRows: whether the group's rows run their block loops one after another
// (one row's accumulators live at a time) instead of interleaved block by block (the dependency
// chains of four rows overlap).
// - AVX-512 has 32 registers of a whole block each and keeps four rows' accumulators of both
//   passes in them: interleaved.
// - AVX2, with 16, spills when more than one row is live, so its rows run serially. Against
//   single rows on AMD Zen 3 (docs/bench_ab_avx2_rows.txt), from DRAM at two threads fp32 came
//   1.5-5.7 points of rmw nearer it and fp16 2.2-11.6, bf16 within the runs' spread (-1.9 to
//   +2.3); in L1/L2 bf16 took 10-13 % and fp16 5-8 % fewer ns per row, fp32 7-8 % more. Two
//   rows at a time, on AMD Zen 2: 16-bit states 4-14 % more ns per row, fp32 2-6 % fewer in L1/L2
//   but 4-13 points further from rmw from DRAM (docs/bench_ab_zen2_pairs.txt).
// The bits depend on neither.
//
// kFp32LeadOne: whether pass one of an fp32 state runs one group ahead of pass two, not two
// (RowGroups::kLead, which says why). Same bits.
//
// kVectorHalfLoads: whether fp16 q and k are widened a block at a time (widen_unit_stride, which
// says why). Same bits.
//
// kAheadFirst16: whether, for a 16-bit state, each block of pass one (of the group ahead) runs
// before the same block of pass two, not after (RowGroups::update_rows, which says why). Same bits.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kGroupRows = 4;
constexpr bool kSerialRows = false;
constexpr bool kFp32LeadOne = true;
constexpr bool kVectorHalfLoads = true;
constexpr bool kAheadFirst16 = false;
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int kGroupRows = 4;
constexpr bool kSerialRows = true;
constexpr bool kFp32LeadOne = false;
constexpr bool kVectorHalfLoads = true;
constexpr bool kAheadFirst16 = true;
#else
constexpr int kGroupRows = 1;
constexpr bool kSerialRows = false;
constexpr bool kFp32LeadOne = false;
constexpr bool kVectorHalfLoads = false;
constexpr bool kAheadFirst16 = false;
#endif

// Lanes of the last partial block (K % kBlock elements) that hold real elements: all bits set
// there, zero in the padding.
inline Blk tail_mask(const int32_t order[kBlock], int64_t tail) {
  uint32_t bits[kBlock];
  for (int64_t l = 0; l < kBlock; ++l) {
    bits[l] = order[l] < tail ? 0xffffffffu : 0u;
  }
  float f[kBlock];
  std::memcpy(f, bits, sizeof(f));
  return blk_load(f);
}

// Prefetch the cache line `offset` bytes past base: into L2 (prefetcht1) by an asm statement on
// AVX2 and AVX-512, a builtin into L1 in the portable code. Into L2: on AMD Zen 4 pass one's
// prefetches into L1 kept fp32 at 25-56 % of rmw from DRAM whether they ran 4, 8, 16 or 32 KiB
// ahead (no prefetch: 29-47 %), where into L2, 8 KiB ahead, it came to 74-99 % and 16-bit states
// 7-36 points nearer rmw (docs/bench_ab_zen4_prefetch.txt), likely because a prefetch into L1 holds
// one of L1's few miss buffers for a whole DRAM latency; the hardware prefetchers bring the lines
// on from L2 to L1. The avx2 variant on Zen 4 came 13-31 points nearer rmw with it for fp32
// (docs/bench_ab_zen4_avx2_prefetch.txt). On Zen 2 prefetcht1 and prefetcht0 timed alike (likely
// both fill L1 there, as AMD documents for cores before Zen 4); what the asm statement brought
// there is where the prefetches go in the code. An asm statement, not __builtin_prefetch: GCC's
// scheduler moves the builtin's prefetches of a four-row group to the group's top, one burst of 32,
// where a volatile asm stays next to the loads it is written with. Where the offset is a constant
// (K known at compile time) the asm takes it as an immediate, so that the address is the group's
// base register plus a displacement, as the state loads' are: given the address as one memory
// operand, GCC computed a group's addresses ahead into registers and, short of registers, kept them
// on the stack and in xmm registers, a reload or a move per prefetch; without them an fp32 row took
// 18 % fewer ns in L1 on Zen 4, bf16 7-8 % and fp16 7-9 % (docs/bench_ab_zen4_prefetch_disp.txt).
// On AMD Zen 2 the avx2 variant took 3-7 % fewer ns per fp32 row in L1/L2 (8-12 % with the state in
// L1) and 1-3 % per fp16 row in two runs of three (2 % more in the third) with the asm statement
// than with the builtin, and came up to 7 points nearer rmw from DRAM, never further beyond the
// runs' spread (docs/bench_ab_zen2_prefetch.txt). tests/test_cpu_codegen.py checks all of it.
// kIntoL1: prefetcht0 instead (AVX-512 only; kNearPrefetchBytes says where).
template <bool kIntoL1 = false>
__attribute__((always_inline)) inline void prefetch_at(const void* base, int64_t offset) {
  // Integer arithmetic: the address may lie past the state; a prefetch never faults.
  const uintptr_t a = reinterpret_cast<uintptr_t>(base) + offset;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#if defined(__OPTIMIZE__)
  if (__builtin_constant_p(offset)) {
    if constexpr (kIntoL1) {
      asm volatile("prefetcht0 %c1(%0)" : : "r"(base), "i"(offset));
    } else {
      asm volatile("prefetcht1 %c1(%0)" : : "r"(base), "i"(offset));
    }
    return;
  }
#endif
  if constexpr (kIntoL1) {
    asm volatile("prefetcht0 %0" : : "m"(*reinterpret_cast<const char*>(a)));
  } else {
    asm volatile("prefetcht1 %0" : : "m"(*reinterpret_cast<const char*>(a)));
  }
#else
  __builtin_prefetch(reinterpret_cast<const void*>(a), 1, 3);
#endif
}

// Prefetch the cache line kPrefetchBytes past element `at` of base (in block t), once per line;
// for a 16-bit state also the line kNearPrefetchBytes past it, into L1. With the state streaming
// from DRAM on AMD Zen 4 that brought 16-bit states nearer rmw: one thread bf16 3-9 points,
// fp16 1-8; two threads up to 9, with rmw at either of its two speeds on that VM (at 6 KiB ahead
// fp16 was 2-4 points further from it at the slower one); in L1/L2 the same ns per row, in L3 up
// to 2 % more (docs/bench_ab_zen4_near_prefetch.txt). Not for fp32, where a prefetch into L1
// 1-2 KiB ahead was 3-7 points further from rmw (docs/bench_ab_zen4_bf16_pairs.txt).
template <typename S>
__attribute__((always_inline)) inline void prefetch_line(const S* base, int64_t at, int64_t t) {
  const int64_t here = at * static_cast<int64_t>(sizeof(S));
  constexpr int64_t kBlockBytes = kBlock * sizeof(S);
  if constexpr (kBlockBytes >= 64) {
    for (int64_t b = 0; b < kBlockBytes; b += 64) {
      prefetch_at(base, here + kPrefetchBytes + b);
    }
  } else if ((t * static_cast<int64_t>(sizeof(S))) % 64 == 0) {
    prefetch_at(base, here + kPrefetchBytes);
    if constexpr (kNearPrefetchBytes != 0) {
      prefetch_at<true>(base, here + kNearPrefetchBytes);
    }
  }
}

// f(t) for every full block t = 0, kBlock, .. < full: unrolled when K is known at compile time.
template <int KC, typename F>
__attribute__((always_inline)) inline void for_blocks(int64_t full, F&& f) {
  if constexpr (KC != 0) {
    [&]<size_t... I>(std::index_sequence<I...>) __attribute__((always_inline)) {
      (f(static_cast<int64_t>(I) * kBlock), ...);
    }(std::make_index_sequence<KC / kBlock>{});
  } else {
    for (int64_t t = 0; t < full; t += kBlock) {
      f(t);
    }
  }
}

// f(std::integral_constant<int, r>{}) for r = 0 .. N - 1, unrolled in the source. A plain loop
// over a group's rows is unrolled only after GCC's scalar replacement of aggregates has run, so
// arrays of four rows' accumulators indexed by it stay on the stack: every FMA of a dot product
// would then go through a store and a load. Constant indices keep them in registers.
template <int N, typename F>
__attribute__((always_inline)) inline void for_rows(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) __attribute__((always_inline)) {
    (f(std::integral_constant<int, I>{}), ...);
  }(std::make_integer_sequence<int, N>{});
}

// What one value head's rows meet: fp32 vectors in the state's element order, zero-padded to a
// multiple of kBlock (the padded lanes add exact zeros, so the last partial block needs no scalar
// tail), the gates, and the head's v and output.
template <typename T>
struct HeadVectors {
  const float* q;          // scale * q / |q|
  const float* k;          // k / |k|
  float decay;             // exp(g)
  float beta;
  const T* v;              // v[r * v_stride] is row r's value
  int64_t v_stride;
  T* out;                  // out[r]: row r's output
  Blk tail_lanes;          // all bits set in the lanes of the last partial block that hold elements
};

// The rows [0, rows) of one value head's state (each head_k elements, rows a multiple of
// kGroupSize) and their outputs:
//   D = exp(g) S (each element rounded); u = D k; delta = beta (v - u); S' = D + delta k^T;
//   o = S' q.
// The contract's order (docs/spec.md): the decay multiplies each state element before the dot
// product, so u's terms are (exp(g) s[t]) k[t], not s[t] (exp(g) k[t]): the two round
// differently, and where exp(g) k[t] underflows to zero an infinite s[t] would give NaN where the
// contract gives +-Inf.
//
// Rows go in groups of kGroupSize, and each group in two passes over its state, both hitting L1:
// pass one (the dot products u) and pass two (the update and the output). Pass one of group
// n + kLead runs interleaved with pass two of group n, so that a group's reductions and scalar
// deltas have vector work to hide behind before pass two needs them; the deltas of groups n and
// n + kLead are in flight (group n's in slot n % 2). kHeadK is K when known at compile time (the
// block loops unroll), else 0. Every row's arithmetic and its order are the same whatever kHeadK,
// kGroupSize, kLead, the interleaving or the ISA.
//
// Every step is always_inline into the one out-of-line update(): the accumulators then stay in
// registers (the codegen test checks it), which they do not once a step is compiled out of line.
template <typename S, int kGroupSize, int kHeadK, typename T>
class RowGroups {
 public:
  // A 16-bit state's rows are widened once: pass one keeps its fp32 blocks, multiplied by exp(g),
  // in an L1 ring of three groups (group n in ring slot n % 3; pass one runs at most two groups
  // ahead of pass two), which pass two reads instead of widening and multiplying again. Widening is
  // exact and the product the same, so the bits are the same either way. A store and a reload cost
  // less than widening again where that is a shuffle on the FMA ports (AVX-512) or a conversion per
  // element (portable), and on AVX2 (a shift or and per bf16 vector, a vcvtph2ps per fp16 one) as
  // well: on AMD Zen 2 a row took 12 % (bf16) and 19 % (fp16) fewer ns in L1/L2 with the ring and
  // came up to 4 points (bf16) and 6 (fp16) nearer rmw from DRAM, none further beyond the runs'
  // spread (docs/bench_ab_zen2_widen.txt). On Zen 3, before pass one multiplied each element by
  // exp(g) (it folded exp(g) into k, so the ring's product was work pass one did not otherwise
  // need), widening again had been 16-21 % faster (docs/bench_ab_avx2_widen.txt).
  // Not an fp32 state: there the ring's 64-byte store cost more than loading and multiplying
  // again (AMD Zen 4, docs/bench_ab_zen4_fp32_ring.txt).
  static constexpr bool kKeepWidened = !std::is_same_v<S, float>;

  // Floats of one slot of the ring of widened rows: a block more than a group's rows, so that the
  // slot pass one writes is never a multiple of 4 KiB away from the one pass two reads (a load
  // after a store with the same low 12 address bits waits for it).
  static int64_t ring_slot(int64_t head_k) {
    return kGroupSize * round_up(head_k, kBlock) + kBlock;
  }
  // Floats of the whole ring (none where rows are not kept widened).
  static int64_t ring_floats(int64_t head_k) { return kKeepWidened ? 3 * ring_slot(head_k) : 0; }

  // widened: room for ring_floats(head_k) floats.
  RowGroups(S* rows, int64_t head_k, const HeadVectors<T>& h, float* widened)
      : s_(rows), head_k_(head_k), h_(h), decay_(blk_set1(h.decay)), widened_(widened) {}

  // The whole of it, out of line (one function per row kernel, which the codegen test reads). The
  // object is local to it and every member inlined, so its members live in registers.
  static __attribute__((noinline)) void update(S* rows, int64_t head_k, int64_t n,
                                               const HeadVectors<T>& h, float* widened) {
    RowGroups(rows, head_k, h, widened).run(n);
  }

  __attribute__((always_inline)) void run(int64_t rows) {
    // Pass one of the first kLead groups, then pass two of each group with pass one kLead ahead.
    dot_group(0, 0);
    if (kLead == 2 && kGroupSize < rows) {
      dot_group(kGroupSize, 1);
    }
    for (int64_t g = 0, n = 0; g < rows; g += kGroupSize, ++n) {
      if (g + kLead * kGroupSize < rows) {
        update_group<true>(g, n);
      } else {
        update_group<false>(g, n);
      }
    }
  }

 private:
  static constexpr int R = kGroupSize;  // rows per group, short for the array bounds below
  // How many groups pass one runs ahead of pass two. Two, so that a group's tail has a whole
  // group's work to hide behind; one where a group is several rows run one after another: the
  // tail's latency is then a small part of the group's work, and with pass one two groups (eight
  // rows) ahead every 16-bit line from DRAM on Zen 3 came 1.5-12 points of rmw further from it than
  // with one group (docs/bench_ab_avx2_rows.txt, run 1). One also for an fp32 state on AVX-512:
  // on AMD Zen 4 it took 7 % fewer ns per row in L1/L2 and came 2-9 points nearer rmw from DRAM,
  // where 16-bit states took 5-6 % more ns per row with it (docs/bench_ab_zen4_lead.txt).
  static constexpr int kLead =
      kGroupSize > 1 && (kSerialRows || (kFp32LeadOne && std::is_same_v<S, float>)) ? 1 : 2;

  // Whether full blocks are stored in pairs (kPairStores, store_paired). Not where K is known and
  // at most 64: that row kernel keeps k and q in registers, and the held blocks would
  // push it past AVX-512's 32 (an FMA then reads a spilled operand from the stack,
  // tests/test_cpu_codegen.py).
  static constexpr bool kPairs = kPairStores<S> && (kHeadK == 0 || kHeadK > 64);

  // K: a compile-time constant where kHeadK is, so that row and block offsets are immediates.
  int64_t K() const { return kHeadK != 0 ? kHeadK : head_k_; }
  int64_t full_blocks_end() const { return K() / kBlock * kBlock; }
  S* row(int64_t r) const { return s_ + r * K(); }
  int64_t padded_k() const { return round_up(K(), kBlock); }
  // The widened rows of group n.
  float* widened(int64_t n) const { return widened_ + (n % 3) * ring_slot(K()); }

  // Pass one over one block of rows [kFirst, kFirst + kRows) of the group at `rows`, n <= kBlock
  // elements: u[r] += (exp(g) s[r][t]) k[t], lane-wise (and exp(g) s[r][t] kept in `keep`); kb is
  // k's block t.
  template <int kFirst = 0, int kRows = R>
  __attribute__((always_inline)) void dot_block(const S* rows, float* keep, int64_t t,
                                                int64_t n, const Blk& kb) {
    for_rows<kRows>([&](auto i) __attribute__((always_inline)) {
      constexpr int r = kFirst + i;
      const S* p = rows + r * K() + t;
      Blk x;
      if (n == kBlock) {
        prefetch_line(rows, r * K() + t, t);
        StateIo<S>::load(p, x);
      } else {
        StateIo<S>::load(p, n, x);
      }
      x = blk_mul(x, decay_);
      if constexpr (kKeepWidened) {
        blk_store(keep + r * padded_k() + t, x);
      }
      u_[r] = blk_fmadd(x, kb, u_[r]);
    });
  }

  // The deltas of the group at `first` from its finished dot products. When every u and delta is
  // finite, no updated state value can be NaN: finite u means every exp(g) s[t] and k[t] was
  // finite (an infinite or NaN term, or Inf times 0, keeps the sum non-finite), and adding
  // delta k[t] to a finite exp(g) s[t] can at most overflow to +-Inf. Its stores can then skip
  // their NaN handling (StateIo::store_finite).
  __attribute__((always_inline)) void finish_dot(int64_t first, int slot) {
    if constexpr (R == 4) {
      const Quad sums = quad_sum_rows(u_);
      const Quad v = quad_load(h_.v + first * h_.v_stride, h_.v_stride);
      const Quad delta = quad_mul(quad_set1(h_.beta), quad_sub(v, sums));
      quad_store(delta_[slot], delta);
      finite_[slot] = quad_finite(sums) && quad_finite(delta);
    } else {
      float sums[R];
      sum_rows<R>(u_, sums);
      bool finite = true;
      for_rows<R>([&](auto r) __attribute__((always_inline)) {
        delta_[slot][r] =
            h_.beta * (static_cast<float>(h_.v[(first + r) * h_.v_stride]) - sums[r]);
        finite = finite && std::isfinite(sums[r]) && std::isfinite(delta_[slot][r]);
      });
      finite_[slot] = finite;
    }
  }

  // Pass one of group n (at `first`) on its own (the first kLead groups).
  __attribute__((always_inline)) void dot_group(int64_t first, int64_t n) {
    for_rows<R>([&](auto r) __attribute__((always_inline)) { u_[r] = blk_zero(); });
    const S* rows = row(first);
    float* keep = widened(n);
    for_blocks<kHeadK>(full_blocks_end(), [&](int64_t t) __attribute__((always_inline)) {
      dot_block(rows, keep, t, kBlock, blk_load(h_.k + t));
    });
    if (K() % kBlock != 0) {
      dot_block(rows, keep, full_blocks_end(), K() % kBlock, blk_load(h_.k + full_blocks_end()));
    }
    finish_dot(first, static_cast<int>(n & 1));
  }

  // Pass two of group n (at `first`), with pass one of group n + kLead when kAhead; the NaN-free
  // stores where the group's values are known finite.
  template <bool kAhead>
  __attribute__((always_inline)) void update_group(int64_t first, int64_t n) {
    if (finite_[n & 1]) {
      update_group<kAhead, true>(first, n);
    } else {
      update_group<kAhead, false>(first, n);
    }
  }

  template <bool kAhead, bool kFinite>
  __attribute__((always_inline)) void update_group(int64_t first, int64_t n) {
    Blk acc[R];
    if constexpr (kSerialRows) {
      for_rows<R>([&](auto r) __attribute__((always_inline)) {
        update_rows<r, 1, kAhead, kFinite>(first, n, acc);
      });
    } else {
      update_rows<0, R, kAhead, kFinite>(first, n, acc);
    }
    if constexpr (kAhead) {
      finish_dot(first + kLead * R, static_cast<int>((n + kLead) & 1));
    }
    if constexpr (R == 4) {
      quad_store(h_.out + first, quad_sum_rows(acc));
    } else {
      float o[R];
      sum_rows<R>(acc, o);
      for_rows<R>([&](auto r) __attribute__((always_inline)) {
        h_.out[first + r] = static_cast<T>(std::isnan(o[r]) ? kNaN : o[r]);
      });
    }
  }

  // Pass two of rows [kFirst, kFirst + kRows) of group n (at `first`), leaving their outputs'
  // lane sums in acc; with pass one of the same rows of group n + kLead when kAhead.
  template <int kFirst, int kRows, bool kAhead, bool kFinite>
  __attribute__((always_inline)) void update_rows(int64_t first, int64_t n, Blk (&acc)[R]) {
    const int slot = static_cast<int>(n & 1);
    S* rows = row(first);
    const S* ahead = row(first + kLead * R);
    [[maybe_unused]] const float* mine = widened(n);
    [[maybe_unused]] float* keep_ahead = widened(n + kLead);
    Blk delta[R];
    [[maybe_unused]] Blk held[R];  // an even block of each row, stored with the next (kPairs)
    [[maybe_unused]] typename PairCheckFor<S>::type check;  // of the paired stores (kPairs)
    for_rows<kRows>([&](auto i) __attribute__((always_inline)) {
      constexpr int r = kFirst + i;
      delta[r] = blk_set1(delta_[slot][r]);
      acc[r] = blk_zero();
      if constexpr (kAhead) {
        u_[r] = blk_zero();
      }
    });
    // s[r][t] = exp(g) s[r][t] + delta[r] k[t]; o[r] += s[r][t] q[t], lane-wise.
    auto update_block = [&](int64_t t, int64_t n, const Blk& kb) __attribute__((always_inline)) {
      const Blk qb = blk_load(h_.q + t);
      for_rows<kRows>([&](auto i) __attribute__((always_inline)) {
        constexpr int r = kFirst + i;
        S* p = rows + r * K() + t;
        Blk x;  // exp(g) s[r][t]
        if constexpr (kKeepWidened) {
          x = blk_load(mine + r * padded_k() + t);
          // Else GCC keeps one of the bf16 K = 128 kernel's accumulators on the stack
          // (tests/test_cpu_codegen.py).
          blk_in_register(x);
        } else {
          if (n == kBlock) {
            StateIo<S>::load(p, x);
          } else {
            StateIo<S>::load(p, n, x);
          }
          x = blk_mul(x, decay_);
        }
        x = blk_fmadd(delta[r], kb, x);
        if (n != kBlock) {
          // Padded lanes hold delta * 0, which is NaN when delta is infinite (an Inf in v): zero
          // them so they cannot turn an infinite output into NaN. They are never stored.
          x = blk_and(x, h_.tail_lanes);
        }
        acc[r] = blk_fmadd(x, qb, acc[r]);
        if (n != kBlock) {
          StateIo<S>::store(p, n, x);
        } else if constexpr (kPairs && kFinite) {
          store_paired(p, t, x, held[r], check);
        } else if constexpr (kFinite) {
          StateIo<S>::store_finite(p, x);
        } else {
          StateIo<S>::store(p, x);
        }
      });
    };
    // k's block is loaded once for both passes: the state stores between them may alias it (a
    // vector store aliases anything), so GCC would load it again for pass one. On AMD Zen 2 (avx2)
    // that took an fp32 row 17 % fewer ns in L1/L2 and a bf16 row 1 % (fp16 between 14 % fewer
    // and 4 % more, with code placement), and from DRAM brought 16-bit states up to 7 points
    // nearer rmw, fp32 within the runs' spread (docs/bench_ab_zen2_kblock.txt). AVX-512: 16 loads
    // fewer per K = 128 row kernel, untimed.
    //
    // The two passes touch different rows and ring slots, so either may go first. With pass one
    // first (kAheadFirst16), pass two's update is k's last use and may overwrite its register,
    // where after pass one GCC copied delta for it: a 16-bit state's avx2 K = 128 row kernel has
    // 165 register moves fewer (bf16) and its rows took 1.5-1.8 % fewer ns in L1/L2 on AMD Zen 2
    // (in L1 bf16 3.1 % fewer to 1.7 % more), every line from cache and DRAM 0.1-3.0 points nearer
    // rmw. An fp32 row took 10-19 % more ns that way (docs/bench_ab_zen2_kblock.txt, runs 8-11).
    constexpr bool kAheadFirst = kAheadFirst16 && kKeepWidened;
    auto both_passes = [&](int64_t t, int64_t n) __attribute__((always_inline)) {
      const Blk kb = blk_load(h_.k + t);
      if constexpr (kAhead && kAheadFirst) {
        dot_block<kFirst, kRows>(ahead, keep_ahead, t, n, kb);
      }
      update_block(t, n, kb);
      if constexpr (kAhead && !kAheadFirst) {
        dot_block<kFirst, kRows>(ahead, keep_ahead, t, n, kb);
      }
    };
    for_blocks<kHeadK>(full_blocks_end(), [&](int64_t t) __attribute__((always_inline)) {
      both_passes(t, kBlock);
    });
    if (K() % kBlock != 0) {
      both_passes(full_blocks_end(), K() % kBlock);
    }
    if constexpr (kPairs && kFinite) {
      if (__builtin_expect(check.redo(), 0)) {
        store_pairs_again<kFirst, kRows>(rows, slot, mine);
      }
    }
  }

  // Full block t (at p) of a NaN-free group whose blocks are stored in pairs (kPairs): an
  // even block with a full block after it is held and stored with that one, a last full block
  // without one alone. Pass two reads the ring (or, without it, blocks it has not stored yet), so
  // holding a block back changes nothing it reads.
  __attribute__((always_inline)) void store_paired(S* p, int64_t t, const Blk& x, Blk& held,
                                                   typename PairCheckFor<S>::type& check) const {
    if ((t / kBlock) % 2 == 1) {
      StateIo<S>::store_pair_finite(p - kBlock, held, x, check);
    } else if (t + kBlock < full_blocks_end()) {
      held = x;
    } else {
      StateIo<S>::store_finite(p, x);
    }
  }

  // The paired stores of rows [kFirst, kFirst + kRows) of the group at `rows` once more, by
  // StateIo::store_pair_exact, where their check asks for it (PairCheckFor): each updated block
  // computed again as pass two did, from the ring (`mine`) and the group's deltas (slot). Out of
  // line and cold: it runs only for groups holding a zero or a denormal, and inline it made GCC
  // keep one of the bf16 K = 128 kernel's accumulators on the stack (tests/test_cpu_codegen.py,
  // which leaves out the registers saved around its calls).
  template <int kFirst, int kRows>
  __attribute__((noinline, cold)) void store_pairs_again(S* rows, int slot,
                                                          const float* mine) const {
    static_assert(kKeepWidened, "the updated blocks are computed again from the ring");
    for (int r = kFirst; r < kFirst + kRows; ++r) {
      const Blk delta = blk_set1(delta_[slot][r]);
      auto updated = [&](int64_t t) {
        return blk_fmadd(delta, blk_load(h_.k + t), blk_load(mine + r * padded_k() + t));
      };
      for (int64_t t = kBlock; t < full_blocks_end(); t += 2 * kBlock) {
        StateIo<S>::store_pair_exact(rows + r * K() + t - kBlock, updated(t - kBlock), updated(t));
      }
    }
  }

  S* const s_;
  const int64_t head_k_;
  // A copy: state stores through vector types may alias anything, and would make every use of a
  // referenced struct's pointers a reload.
  const HeadVectors<T> h_;
  const Blk decay_;
  float* const widened_;
  Blk u_[R];            // pass one's accumulators (the group in flight)
  float delta_[2][R];   // the deltas of the two groups in flight
  bool finite_[2] = {false, false};
};

// Strided scalar views of the small inputs.
template <typename T>
inline float at2(const void* base, int64_t i, int64_t j, int64_t si, int64_t sj) {
  return static_cast<float>(static_cast<const T*>(base)[i * si + j * sj]);
}

// K elements of q or k at unit stride to fp32, in memory order. c10 converts a Half one element
// at a time (on AVX-512 by a vcvtph2ps of a whole register for each), which GCC leaves scalar;
// the fp16 state's load widens 16 at once, exactly: on AMD Zen 4 about 70 ns less per (row, head)
// task with avx512 (3 % of a Qwen3-Next task), while the portable code took 5 % more per call with
// it and keeps the scalar loop (docs/bench_ab_zen4_fp16_qk.txt). GCC vectorises bf16's widening
// as written.
template <typename T>
void widen_unit_stride(const T* src, int64_t K, float* d) {
  if constexpr (std::is_same_v<T, c10::Half> && kVectorHalfLoads) {
    int64_t t = 0;
    for (; t + kBlock <= K; t += kBlock) {
      Blk x;
      StateIo<c10::Half>::load(src + t, x);
      blk_store(d + t, x);
    }
    if (t < K) {
      Blk x;
      StateIo<c10::Half>::load(src + t, K - t, x);
      blk_store(d + t, x);  // up to the padded length, which the caller zeroes past K
    }
  } else {
    for (int64_t t = 0; t < K; ++t) {
      d[t] = static_cast<float>(src[t]);
    }
  }
}

// q (scaled) and k of key head h of one row of mixed_qkv (`row`, column stride cs), L2-normalised
// in fp32 into dst[0, Kp) and dst[Kp, 2Kp), zero-padded past K and permuted into the element order
// of the state loads. The sums of squares go lane-wise over whole blocks in memory order (the
// padding adds zeros), then through sum_rows' tree: one order on every ISA and for every state
// dtype, and no chain of K dependent adds (which took most of this function's time).
template <typename T>
void normalize_qk(const T* row, int64_t cs, int64_t H, int64_t h, int64_t K, int64_t Kp,
                  float scale, const int32_t order[kBlock], bool identity, float* dst) {
  Blk sumsq[2];
  for (int64_t which = 0; which < 2; ++which) {  // 0: q, 1: k
    const T* src = row + (which * H * K + h * K) * cs;
    float* d = dst + which * Kp;
    if (cs == 1) {  // the usual case
      widen_unit_stride(src, K, d);
    } else {
      for (int64_t t = 0; t < K; ++t) {
        d[t] = static_cast<float>(src[t * cs]);
      }
    }
    std::fill(d + K, d + Kp, 0.f);
    sumsq[which] = blk_zero();
    for (int64_t t = 0; t < Kp; t += kBlock) {
      const Blk x = blk_load(d + t);
      sumsq[which] = blk_fmadd(x, x, sumsq[which]);
    }
  }
  float sums[2];
  sum_rows<2>(sumsq, sums);
  for (int64_t which = 0; which < 2; ++which) {
    float* d = dst + which * Kp;
    // q <- scale * q / sqrt(sum q^2 + eps); k <- k / sqrt(sum k^2 + eps)
    const float norm = std::sqrt(sums[which] + kNormEps);
    const float mul = which == 0 ? scale : 1.f;
    for (int64_t t = 0; t < K; ++t) {
      d[t] = mul * d[t] / norm;
    }
    // Only a bf16 state's order is not the identity. One vpermps a block on AVX-512, where a
    // scalar copy of each element took about 40 ns of a task on AMD Zen 4
    // (docs/bench_ab_zen4_bf16_qk.txt).
    if (!identity) {
      for (int64_t t = 0; t < Kp; t += kBlock) {
        blk_store(d + t, blk_permute(blk_load(d + t), order));
      }
    }
  }
}

// The whole op for K = KC (a compile-time constant, so the row loops unroll), or any K (KC = 0).
template <typename T, typename S, int KC>
void run_k(const GdnParams& p) {
  const int64_t B = p.batch, H = p.num_heads, Hv = p.num_v_heads, V = p.head_v;
  const int64_t K = KC != 0 ? KC : p.head_k;
  const int64_t group = Hv / H;  // value heads per key head
  const int64_t Kp = round_up(K, kBlock);
  const T* qkv = static_cast<const T*>(p.mixed_qkv);
  const int64_t rs = p.qkv_stride_row, cs = p.qkv_stride_col;  // mixed_qkv's strides
  S* state = static_cast<S*>(p.state);
  T* out = static_cast<T*>(p.out);
  const int64_t grouped = V / kGroupRows * kGroupRows;  // rows in whole groups

  // q and k are kept in the element order the state loads produce (identity unless StateIo<S>
  // reorders), so that s[t] always meets k[t] and q[t].
  int32_t order[kBlock];
  element_order<S>(order);
  bool identity = true;
  for (int64_t j = 0; j < kBlock; ++j) {
    identity = identity && order[j] == j;
  }
  const Blk tail_lanes = tail_mask(order, K % kBlock);

  const int64_t grain = std::max<int64_t>(1, kGrainElements / (V * K));
  // One task per (batch row, value head), in row-major order so the `group` value heads of one
  // key head are neighbours: each thread normalises q/k of a (row, key head) once and reuses it.
  // Every task is computed by one thread start to end, so results do not depend on the split.
  at::parallel_for(0, B * Hv, grain, [&](int64_t lo, int64_t hi) {
    // q and k of the current task; then RowGroups' ring of widened rows, 64-byte aligned.
    const int64_t ring = std::max(RowGroups<S, kGroupRows, KC, T>::ring_floats(K),
                                  RowGroups<S, 1, KC, T>::ring_floats(K));
    std::unique_ptr<float[]> qk(new float[2 * Kp + ring + kBlock]);
    float* widened = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(qk.get() + 2 * Kp) + 63) & ~uintptr_t{63});
    int64_t qk_of = -1;  // i * H + h of what qk holds
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t i = task / Hv, j = task % Hv, h = j / group;
      T* o = out + task * V;
      const int64_t s_idx = p.indices[i];
      if (s_idx <= 0) {
        std::fill(o, o + V, T(0.f));
        continue;
      }
      if (qk_of != i * H + h) {
        normalize_qk<T>(qkv + i * rs, cs, H, h, K, Kp, p.scale, order, identity, qk.get());
        qk_of = i * H + h;
      }
      // Gates. softplus(x) = max(x, log(1 + exp(min(x, threshold))))
      const float x = at2<T>(p.a, i, j, p.a_stride_row, p.a_stride_col) +
                      at2<T>(p.dt_bias, 0, j, 0, p.dt_bias_stride);
      const float sp = std::max(x, std::log(1.f + std::exp(std::min(x, p.softplus_threshold))));
      const float g = -std::exp(p.a_log[j * p.a_log_stride]) * sp;
      const float decay = std::exp(g);
      const float beta =
          1.f / (1.f + std::exp(-at2<T>(p.b, i, j, p.b_stride_row, p.b_stride_col)));

      S* st = state + s_idx * p.state_stride_slot + j * V * K;
      const HeadVectors<T> head{qk.get(), qk.get() + Kp, decay, beta,
                                qkv + i * rs + (2 * H * K + j * V) * cs, cs, o, tail_lanes};
      if (grouped > 0) {
        RowGroups<S, kGroupRows, KC, T>::update(st, K, grouped, head, widened);
      }
      if (grouped < V) {
        HeadVectors<T> rest = head;
        rest.v += grouped * cs;
        rest.out += grouped;
        RowGroups<S, 1, KC, T>::update(st + grouped * K, K, V - grouped, rest, widened);
      }
    }
  });
}

// Row kernels specialised on the common K (the loops unroll, k and q stay in registers where
// they fit); any other K takes the generic one. Same bits either way (see RowGroups). Not in
// the portable variant, whose unrolled blocks would take minutes to compile for little gain.
template <typename T, typename S>
void run(const GdnParams& p) {
#if !defined(CPU_CAPABILITY_DEFAULT)
  switch (p.specialize_k ? p.head_k : 0) {
    case 64:
      return run_k<T, S, 64>(p);
    case 128:
      return run_k<T, S, 128>(p);
    case 256:
      return run_k<T, S, 256>(p);
    default:
      break;
  }
#endif
  run_k<T, S, 0>(p);
}

} // namespace
} // namespace CPU_CAPABILITY

const bool CUSTOM_OPS_CONCAT(kernel_built_, CPU_CAPABILITY) = true;
template <typename T, typename S>
void CUSTOM_OPS_CONCAT(fused_gdn_decode_kernel_, CPU_CAPABILITY)(const GdnParams& p) {
  CPU_CAPABILITY::run<T, S>(p);
}
#endif

#define CUSTOM_OPS_INSTANTIATE(T, S) \
  template void CUSTOM_OPS_CONCAT(fused_gdn_decode_kernel_, CPU_CAPABILITY)<T, S>(const GdnParams&)
CUSTOM_OPS_INSTANTIATE(c10::BFloat16, float);
CUSTOM_OPS_INSTANTIATE(c10::BFloat16, c10::BFloat16);
CUSTOM_OPS_INSTANTIATE(c10::Half, float);
CUSTOM_OPS_INSTANTIATE(c10::Half, c10::Half);
#undef CUSTOM_OPS_INSTANTIATE

} // namespace custom_ops::cpu
