// The fused CPU kernel body. Included once per instruction set by kernel_<isa>.cpp, each compiled
// with its own CPU_CAPABILITY and instruction-set flags (see setup.py); vec.h supplies that ISA's
// blocks, so this file reads as math and computes the same bits for every ISA.
//
// Memory-bound: the state is B*Hv*V*K elements and each element is loaded once from memory and
// stored once. Per state row (K elements) we make two passes that both hit L1: the first computes
// u = S (exp(g) k), the second writes S' = exp(g) S + delta k^T and accumulates out = S' q.
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
void element_order(int64_t order[kBlock]) {
  S idx[kBlock];
  for (int64_t e = 0; e < kBlock; ++e) {
    idx[e] = static_cast<S>(static_cast<float>(e));  // exact: e < 2^8
  }
  Blk b;
  StateIo<S>::load(idx, b);
  float f[kBlock];
  blk_store(f, b);
  for (int64_t l = 0; l < kBlock; ++l) {
    order[l] = static_cast<int64_t>(f[l]);
  }
}

inline int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

// How far ahead of pass one (in bytes of state) to prefetch: more misses in flight than the
// hardware prefetcher alone keeps when the state streams from DRAM.
constexpr int64_t kPrefetchBytes = 4096;

// Rows updated together (one group). Their dependency chains (dot, horizontal sum, delta, update,
// dot, horizontal sum) overlap. AVX-512 has 32 registers of a whole block each and keeps four
// rows' accumulators of both passes in them; with 16 (AVX2) more than one row spills. The bits do
// not depend on it.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kGroupRows = 4;
#else
constexpr int kGroupRows = 1;
#endif

// Lanes of the last partial block (K % kBlock elements) that hold real elements: all bits set
// there, zero in the padding.
inline Blk tail_mask(const int64_t order[kBlock], int64_t tail) {
  uint32_t bits[kBlock];
  for (int64_t l = 0; l < kBlock; ++l) {
    bits[l] = order[l] < tail ? 0xffffffffu : 0u;
  }
  float f[kBlock];
  std::memcpy(f, bits, sizeof(f));
  return blk_load(f);
}

// Prefetch for writing the cache line of the state element at p, once per line.
template <typename S>
inline void prefetch_line(const S* p, int64_t t) {
  // Integer arithmetic: the address may lie past the state; a prefetch never faults.
  const uintptr_t a = reinterpret_cast<uintptr_t>(p) + kPrefetchBytes;
  constexpr int64_t kBlockBytes = kBlock * sizeof(S);
  if constexpr (kBlockBytes >= 64) {
    for (int64_t b = 0; b < kBlockBytes; b += 64) {
      __builtin_prefetch(reinterpret_cast<const void*>(a + b), 1, 3);
    }
  } else if ((t * static_cast<int64_t>(sizeof(S))) % 64 == 0) {
    __builtin_prefetch(reinterpret_cast<const void*>(a), 1, 3);
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

// The state rows of one value head (rows x K, rows a multiple of R) and their outputs:
//   u = S (exp(g) k); delta = beta (v - u); S' = exp(g) S + delta k^T; o = S' q.
// kd = exp(g) k, k and q are the head's fp32 vectors in the state's element order, zero-padded to
// a multiple of kBlock, so the last partial block needs no scalar tail (the padded lanes add exact
// zeros). The decay multiplies k before the dot product, not the sum after it: S k alone can
// overflow where exp(g) S k does not.
// Rows go in groups of R. Pass one (the dot with kd) of group n + 2 runs interleaved with pass two
// (update and read-out) of group n: a group's reduction and scalar delta then have a whole group's
// vector work to hide behind before pass two needs them. Every row's arithmetic and its order are
// the same whatever KC (K known at compile time, or 0), R, the interleaving or the ISA.
template <typename S, int R, int KC, typename T>
inline void update_head(S* st, int64_t K_, int64_t rows, const float* kd, const float* k,
                        const float* q, float decay, float beta, const T* v, int64_t cs, T* o,
                        const Blk& keep) {
  const int64_t K = KC != 0 ? KC : K_;
  const int64_t full = K / kBlock * kBlock;
  const int64_t tail = K - full;
  const Blk vdecay = blk_set1(decay);
  // Pass one's accumulators, and the deltas of the two groups in flight (group n in slot n % 2).
  Blk u[R];
  float delta[2][R];
  bool finite[2] = {false, false};

  // Scalar math: u[r] += sum_{t in block} s[r][t] * kd[t]
  auto dot_block = [&](const S* s, int64_t t, int64_t n) __attribute__((always_inline)) {
    const Blk kb = blk_load(kd + t);
    for_rows<R>([&](auto r) __attribute__((always_inline)) {
      Blk x;
      if (n == kBlock) {
        prefetch_line(s + r * K + t, t);
        StateIo<S>::load(s + r * K + t, x);
      } else {
        StateIo<S>::load(s + r * K + t, n, x);
      }
      u[r] = blk_fmadd(x, kb, u[r]);
    });
  };
  // The deltas of the group at `row`. When every u and delta is finite, no updated state value
  // can be NaN: finite u means every s[t] and kd[t] was finite (an infinite or NaN term keeps the
  // sum non-finite), so decay*s[t] is finite and adding delta*k[t] can at most overflow to +-Inf.
  // The stores can then skip their NaN handling (StateIo::store_finite).
  auto dot_end = [&](int64_t row, int slot) __attribute__((always_inline)) {
    float sums[R];
    sum_rows<R>(u, sums);
    bool fin = true;
    for_rows<R>([&](auto r) __attribute__((always_inline)) {
      delta[slot][r] = beta * (static_cast<float>(v[(row + r) * cs]) - sums[r]);
      fin = fin && std::isfinite(sums[r]) && std::isfinite(delta[slot][r]);
    });
    finite[slot] = fin;
  };
  auto dot_rows = [&](int64_t row, int slot) __attribute__((always_inline)) {
    const S* s = st + row * K;
    for_rows<R>([&](auto r) __attribute__((always_inline)) {
      u[r] = blk_zero();
    });
    for_blocks<KC>(full,
                   [&](int64_t t) __attribute__((always_inline)) { dot_block(s, t, kBlock); });
    if (tail) {
      dot_block(s, full, tail);
    }
    dot_end(row, slot);
  };

  // Pass two of rows [g, g + R) (slot `slot`), with pass one of rows [g + 2R, g + 3R) when kAhead;
  // kFinite: the group's u and delta are finite (see dot_end).
  auto group = [&]<bool kAhead, bool kFinite>(int64_t g, int slot) __attribute__((always_inline)) {
    S* s = st + g * K;
    const S* ahead = s + 2 * R * K;
    Blk vdelta[R], acc[R];
    for_rows<R>([&](auto r) __attribute__((always_inline)) {
      vdelta[r] = blk_set1(delta[slot][r]);
      acc[r] = blk_zero();
      if constexpr (kAhead) {
        u[r] = blk_zero();
      }
    });
    // Scalar math: s[r][t] = decay * s[r][t] + delta[r] * k[t]; o[r] += s[r][t] * q[t]
    auto update_block = [&](int64_t t, int64_t n) __attribute__((always_inline)) {
      const Blk kb = blk_load(k + t), qb = blk_load(q + t);
      for_rows<R>([&](auto r) __attribute__((always_inline)) {
        S* p = s + r * K + t;
        Blk x;
        if (n == kBlock) {
          StateIo<S>::load(p, x);
        } else {
          StateIo<S>::load(p, n, x);
        }
        x = blk_fmadd(vdelta[r], kb, blk_mul(x, vdecay));
        if (n != kBlock) {
          // Padded lanes hold delta * 0, which is NaN when delta is infinite (an Inf in v): zero
          // them so they cannot turn an infinite output into NaN. They are never stored.
          x = blk_and(x, keep);
        }
        acc[r] = blk_fmadd(x, qb, acc[r]);
        if (n != kBlock) {
          StateIo<S>::store(p, n, x);
        } else if constexpr (kFinite) {
          StateIo<S>::store_finite(p, x);
        } else {
          StateIo<S>::store(p, x);
        }
      });
    };
    for_blocks<KC>(full, [&](int64_t t) __attribute__((always_inline)) {
      update_block(t, kBlock);
      if constexpr (kAhead) {
        dot_block(ahead, t, kBlock);
      }
    });
    if (tail) {
      update_block(full, tail);
      if constexpr (kAhead) {
        dot_block(ahead, full, tail);
      }
    }
    if constexpr (kAhead) {
      dot_end(g + 2 * R, slot);
    }
    float orow[R];
    sum_rows<R>(acc, orow);
    for_rows<R>([&](auto r) __attribute__((always_inline)) {
      o[g + r] = static_cast<T>(std::isnan(orow[r]) ? kNaN : orow[r]);
    });
  };

  dot_rows(0, 0);
  if (R < rows) {
    dot_rows(R, 1);
  }
  for (int64_t g = 0, n = 0; g < rows; g += R, ++n) {
    const int slot = static_cast<int>(n & 1);
    const bool ahead = g + 2 * R < rows;
    if (finite[slot]) {
      ahead ? group.template operator()<true, true>(g, slot)
            : group.template operator()<false, true>(g, slot);
    } else {
      ahead ? group.template operator()<true, false>(g, slot)
            : group.template operator()<false, false>(g, slot);
    }
  }
}

// Strided scalar views of the small inputs.
template <typename T>
inline float at2(const void* base, int64_t i, int64_t j, int64_t si, int64_t sj) {
  return static_cast<float>(static_cast<const T*>(base)[i * si + j * sj]);
}

// q (scaled) and k of key head h of row i, L2-normalised in fp32 into dst[0, Kp) and
// dst[Kp, 2Kp), zero-padded past K and permuted into the element order of the state loads.
template <typename T>
void normalize_qk(const T* row, int64_t cs, int64_t H, int64_t h, int64_t K, int64_t Kp,
                  float scale, const int64_t order[kBlock], bool identity, float* dst) {
  for (int64_t which = 0; which < 2; ++which) {  // 0: q, 1: k
    const T* src = row + (which * H * K + h * K) * cs;
    float* d = dst + which * Kp;
    float sumsq = 0.f;
    for (int64_t t = 0; t < K; ++t) {
      d[t] = static_cast<float>(src[t * cs]);
      sumsq += d[t] * d[t];
    }
    // q <- scale * q / sqrt(sum q^2 + eps); k <- k / sqrt(sum k^2 + eps)
    const float norm = std::sqrt(sumsq + kNormEps);
    const float mul = which == 0 ? scale : 1.f;
    for (int64_t t = 0; t < K; ++t) {
      d[t] = mul * d[t] / norm;
    }
    std::fill(d + K, d + Kp, 0.f);
    if (!identity) {
      float block[kBlock];
      for (int64_t t = 0; t < Kp; t += kBlock) {
        std::copy(d + t, d + t + kBlock, block);
        for (int64_t j = 0; j < kBlock; ++j) {
          d[t + j] = block[order[j]];
        }
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
  const int64_t rs = p.qkv_stride_row, cs = p.qkv_stride_col;
  S* state = static_cast<S*>(p.state);
  T* out = static_cast<T*>(p.out);
  constexpr int R = kGroupRows;
  const int64_t grouped = V / R * R;

  // q and k are kept in the element order the state loads produce (identity unless StateIo<S>
  // reorders), so that s[t] always meets k[t] and q[t].
  int64_t order[kBlock];
  element_order<S>(order);
  bool identity = true;
  for (int64_t j = 0; j < kBlock; ++j) {
    identity = identity && order[j] == j;
  }
  const Blk keep = tail_mask(order, K % kBlock);

  const int64_t grain = std::max<int64_t>(1, kGrainElements / (V * K));
  // One task per (batch row, value head), in row-major order so the `group` value heads of one
  // key head are neighbours: each thread normalises q/k of a (row, key head) once and reuses it.
  // Every task is computed by one thread start to end, so results do not depend on the split.
  at::parallel_for(0, B * Hv, grain, [&](int64_t lo, int64_t hi) {
    // q, k, then kd = exp(g) k of the current task.
    std::unique_ptr<float[]> qk(new float[3 * Kp]);
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

      const float* q = qk.get();
      const float* k = qk.get() + Kp;
      float* kd = qk.get() + 2 * Kp;
      for (int64_t t = 0; t < Kp; ++t) {
        kd[t] = decay * k[t];
      }
      S* st = state + s_idx * p.state_stride_slot + j * V * K;
      const T* v = qkv + i * rs + (2 * H * K + j * V) * cs;
      if (grouped > 0) {
        update_head<S, R, KC>(st, K, grouped, kd, k, q, decay, beta, v, cs, o, keep);
      }
      if (grouped < V) {
        update_head<S, 1, KC>(st + grouped * K, K, V - grouped, kd, k, q, decay, beta,
                              v + grouped * cs, cs, o + grouped, keep);
      }
    }
  });
}

// Row kernels specialised on the common K (the loops unroll, k and q stay in registers where
// they fit); any other K takes the generic one. Same bits either way (see update_head). Not in
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
