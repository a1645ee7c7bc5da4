// The fused CPU kernel body. Included once per instruction set by kernel_<isa>.cpp, each compiled
// with its own CPU_CAPABILITY (see setup.py), so at::vec resolves to that ISA's Vectorized<>.
//
// Memory-bound: the state is B*Hv*V*K elements and each element is loaded once from memory and
// stored once. Per state row (K elements) we make two passes that both hit L1: the first computes
// u = S (exp(g) k), the second writes S' = exp(g) S + delta k^T and accumulates out = S' q.
#pragma once

// vec.h first: it includes the intrinsic headers ahead of ATen (see there).
#include "cpu/vec.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>

#include "cpu/kernel.h"

#define CUSTOM_OPS_CONCAT_(a, b) a##b
#define CUSTOM_OPS_CONCAT(a, b) CUSTOM_OPS_CONCAT_(a, b)

namespace custom_ops::cpu {
namespace CPU_CAPABILITY {
namespace {

// Elements per vector step: two float vectors, or one vector of 16-bit floats.
constexpr int64_t kStep = 2 * kF;
static_assert(Vectorized<c10::BFloat16>::size() == kStep, "16-bit vector must hold 2 float vectors");
static_assert(Vectorized<c10::Half>::size() == kStep, "16-bit vector must hold 2 float vectors");
// Below this many state elements a parallel chunk is not worth a thread.
constexpr int64_t kGrainElements = 1 << 14;
constexpr float kNormEps = 1e-6f;

// Two float vectors from kStep state elements (or the first n < kStep, the rest read as 0), and
// back with round-to-nearest-even. store_finite may assume no lane is NaN (the caller has proved
// it); it must give the same bits as store for such values.
template <typename S>
struct Io {
  static inline void load(const S* p, fVec& lo, fVec& hi) {
    std::tie(lo, hi) = at::vec::convert_to_float<S>(Vectorized<S>::loadu(p));
  }
  static inline void load(const S* p, int64_t n, fVec& lo, fVec& hi) {
    std::tie(lo, hi) = at::vec::convert_to_float<S>(Vectorized<S>::loadu(p, n));
  }
  static inline void store(S* p, const fVec& lo, const fVec& hi) {
    at::vec::convert_from_float<S>(lo, hi).store(p);
  }
  static inline void store(S* p, int64_t n, const fVec& lo, const fVec& hi) {
    at::vec::convert_from_float<S>(lo, hi).store(p, n);
  }
  static inline void store_finite(S* p, const fVec& lo, const fVec& hi) { store(p, lo, hi); }
};
template <>
struct Io<float> {
  static inline void load(const float* p, fVec& lo, fVec& hi) {
    lo = fVec::loadu(p);
    hi = fVec::loadu(p + kF);
  }
  static inline void load(const float* p, int64_t n, fVec& lo, fVec& hi) {
    lo = fVec::loadu(p, std::min(n, kF));
    hi = n > kF ? fVec::loadu(p + kF, n - kF) : fVec(0.f);
  }
  static inline void store(float* p, const fVec& lo, const fVec& hi) {
    lo.store(p);
    hi.store(p + kF);
  }
  static inline void store(float* p, int64_t n, const fVec& lo, const fVec& hi) {
    lo.store(p, std::min(n, kF));
    if (n > kF) {
      hi.store(p + kF, n - kF);
    }
  }
  static inline void store_finite(float* p, const fVec& lo, const fVec& hi) { store(p, lo, hi); }
};

#ifdef CUSTOM_OPS_HAVE_BF16_LANES
// bf16 state in vec.h's lane order (one instruction per widen/narrow step instead of at::vec's
// order-preserving conversion): k and q are stored in that same order (see element_order), and
// dot products do not care about order.
template <>
struct Io<c10::BFloat16> {
  using S = c10::BFloat16;
  static inline void load(const S* p, fVec& lo, fVec& hi) { load_bf16_lanes(p, lo, hi); }
  static inline void load(const S* p, int64_t n, fVec& lo, fVec& hi) {
    load_bf16_lanes(p, n, lo, hi);
  }
  static inline void store(S* p, const fVec& lo, const fVec& hi) { store_bf16_lanes(p, lo, hi); }
  static inline void store(S* p, int64_t n, const fVec& lo, const fVec& hi) {
    store_bf16_lanes(p, n, lo, hi);
  }
  static inline void store_finite(S* p, const fVec& lo, const fVec& hi) {
    store_bf16_lanes_no_nan(p, lo, hi);
  }
};
#endif

// The element order Io<S>::load produces within one kStep block: order[j] is the memory index of
// the j-th float (lo then hi). Found by loading the indices themselves, so it is right for every
// Io specialisation (identity for float and for at::vec's conversions).
template <typename S>
void element_order(int64_t order[kStep]) {
  S idx[kStep];
  for (int64_t j = 0; j < kStep; ++j) {
    idx[j] = static_cast<S>(static_cast<float>(j));  // exact: j < 2^8
  }
  fVec lo, hi;
  Io<S>::load(idx, lo, hi);
  float f[kStep];
  lo.store(f);
  hi.store(f + kF);
  for (int64_t j = 0; j < kStep; ++j) {
    order[j] = static_cast<int64_t>(f[j]);
  }
}

// out[r] = horizontal sum of v[r], r < R (vec.h's hsum4 sums four rows together).
template <int R>
inline void hsum_rows(const fVec* v, float* out) {
  if constexpr (R == 4) {
    hsum4(v, out);
  } else {
    for (int r = 0; r < R; ++r) {
      out[r] = hsum(v[r]);
    }
  }
}

inline int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

// How far ahead (in state rows) pass one prefetches.
constexpr int64_t kPrefetchRows = 8;

// Rows updated together (one group). Their dependency chains (dot, horizontal sum, delta, update,
// dot, horizontal sum) overlap; one row alone is latency-bound. With 16 vector registers (AVX2,
// portable) a float state fits two rows' accumulators of both passes without spilling.
template <typename S>
constexpr int group_rows() {
#if defined(CPU_CAPABILITY_AVX512)
  return 4;
#else
  return std::is_same_v<S, float> ? 2 : 4;
#endif
}

// Lanes of the last partial step (K % kStep elements, in load order) that hold real elements:
// all bits set there, zero in the padding.
struct TailMask {
  fVec lo, hi;
};

inline TailMask tail_mask(const int64_t order[kStep], int64_t tail) {
  uint32_t bits[kStep];
  for (int64_t j = 0; j < kStep; ++j) {
    bits[j] = order[j] < tail ? 0xffffffffu : 0u;
  }
  float f[kStep];
  std::memcpy(f, bits, sizeof(f));
  return {fVec::loadu(f), fVec::loadu(f + kF)};
}

// Prefetch for writing the cache lines of kStep state elements at p (pass one runs this
// kPrefetchRows rows ahead: more misses in flight than the hardware prefetcher alone keeps when
// the state streams from DRAM). Integer arithmetic: the address may lie past the state; a
// prefetch never faults.
template <typename S>
inline void prefetch_step(const S* p, int64_t t) {
  constexpr int64_t kStepBytes = kStep * sizeof(S);
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if constexpr (kStepBytes >= 64) {
    for (int64_t b = 0; b < kStepBytes; b += 64) {
      __builtin_prefetch(reinterpret_cast<const void*>(a + b), 1, 3);
    }
  } else if ((t * static_cast<int64_t>(sizeof(S))) % 64 == 0) {
    __builtin_prefetch(reinterpret_cast<const void*>(a), 1, 3);
  }
}

// The state rows of one value head (rows x K, rows a multiple of R) and their outputs:
//   u = S (exp(g) k); delta = beta (v - u); S' = exp(g) S + delta k^T; o = S' q.
// kd = exp(g) k, k and q are the head's fp32 vectors in load order, zero-padded to a multiple of
// kStep, so the last partial step needs no scalar tail (the padded lanes add exact zeros).
// The decay multiplies k before the dot product, not the sum after it: S k alone can overflow
// where exp(g) S k does not.
// Rows go in groups of R; pass one (the dot with kd) of the next group runs interleaved with
// pass two (update and read-out) of the current one, so each group's reduction and scalar delta
// overlap the other's vector work. Every row's arithmetic and its order are the same whatever
// KC (K known at compile time, or 0), R's neighbours or the interleaving: only R and the ISA
// decide the bits.
template <typename S, int R, int KC, typename T>
inline void update_head(S* st, int64_t K_, int64_t rows, const float* kd, const float* k,
                        const float* q, float decay, float beta, const T* v, int64_t cs, T* o,
                        const TailMask& keep) {
  const int64_t K = KC != 0 ? KC : K_;
  const int64_t full = K / kStep * kStep;
  const int64_t tail = K - full;
  const fVec vdecay(decay);
  fVec u0[R], u1[R];
  float delta[R];
  bool finite = false;

  auto dot_begin = [&]() {
    for (int r = 0; r < R; ++r) {
      u0[r] = fVec(0.f);
      u1[r] = fVec(0.f);
    }
  };
  // Scalar math: u[r] += sum_{t in step} s[r][t] * kd[t]
  auto dot_step = [&](const S* s, int64_t t, int64_t n) {
    const fVec k0 = fVec::loadu(kd + t), k1 = fVec::loadu(kd + t + kF);
    for (int r = 0; r < R; ++r) {
      fVec s0, s1;
      if (n == kStep) {
        prefetch_step(s + (r + kPrefetchRows) * K + t, t);
        Io<S>::load(s + r * K + t, s0, s1);
      } else {
        Io<S>::load(s + r * K + t, n, s0, s1);
      }
      u0[r] = at::vec::fmadd(s0, k0, u0[r]);
      u1[r] = at::vec::fmadd(s1, k1, u1[r]);
    }
  };
  // The group's deltas. When every u and delta is finite, no updated state value can be NaN:
  // finite u means every s[t] and kd[t] was finite (an infinite or NaN term keeps the sum
  // non-finite), so decay*s[t] is finite and adding delta*k[t] can at most overflow to +-Inf.
  // The narrowing to a 16-bit state can then skip its NaN handling (Io::store_finite).
  auto dot_end = [&](int64_t row) {
    float u[R];
    for (int r = 0; r < R; ++r) {
      u0[r] = u0[r] + u1[r];
    }
    hsum_rows<R>(u0, u);
    finite = true;
    for (int r = 0; r < R; ++r) {
      delta[r] = beta * (static_cast<float>(v[(row + r) * cs]) - u[r]);
      finite = finite && std::isfinite(u[r]) && std::isfinite(delta[r]);
    }
  };

  dot_begin();
  for (int64_t t = 0; t < full; t += kStep) {
    dot_step(st, t, kStep);
  }
  if (tail) {
    dot_step(st, full, tail);
  }
  dot_end(0);

  for (int64_t g = 0; g < rows; g += R) {
    S* s = st + g * K;
    const S* next = s + R * K;
    const bool more = g + R < rows;
    const bool fin = finite;
    fVec vdelta[R], o0[R], o1[R];
    for (int r = 0; r < R; ++r) {
      vdelta[r] = fVec(delta[r]);
      o0[r] = fVec(0.f);
      o1[r] = fVec(0.f);
    }
    // Scalar math: s[r][t] = decay * s[r][t] + delta[r] * k[t]; o[r] += s[r][t] * q[t]
    auto update_step = [&](int64_t t, int64_t n) {
      const fVec k0 = fVec::loadu(k + t), k1 = fVec::loadu(k + t + kF);
      const fVec q0 = fVec::loadu(q + t), q1 = fVec::loadu(q + t + kF);
      for (int r = 0; r < R; ++r) {
        S* p = s + r * K + t;
        fVec s0, s1;
        if (n == kStep) {
          Io<S>::load(p, s0, s1);
        } else {
          Io<S>::load(p, n, s0, s1);
        }
        s0 = at::vec::fmadd(vdelta[r], k0, s0 * vdecay);
        s1 = at::vec::fmadd(vdelta[r], k1, s1 * vdecay);
        if (n != kStep) {
          // Padded lanes hold delta * 0, which is NaN when delta is infinite (an Inf in v): zero
          // them so they cannot turn an infinite output into NaN. They are never stored.
          s0 = fVec::blendv(fVec(0.f), s0, keep.lo);
          s1 = fVec::blendv(fVec(0.f), s1, keep.hi);
        }
        o0[r] = at::vec::fmadd(s0, q0, o0[r]);
        o1[r] = at::vec::fmadd(s1, q1, o1[r]);
        if (n != kStep) {
          Io<S>::store(p, n, s0, s1);
        } else if (fin) {
          Io<S>::store_finite(p, s0, s1);
        } else {
          Io<S>::store(p, s0, s1);
        }
      }
    };
    if (more) {
      dot_begin();
    }
    for (int64_t t = 0; t < full; t += kStep) {
      update_step(t, kStep);
      if (more) {
        dot_step(next, t, kStep);
      }
    }
    if (tail) {
      update_step(full, tail);
      if (more) {
        dot_step(next, full, tail);
      }
    }
    float orow[R];
    for (int r = 0; r < R; ++r) {
      o0[r] = o0[r] + o1[r];
    }
    hsum_rows<R>(o0, orow);
    for (int r = 0; r < R; ++r) {
      o[g + r] = static_cast<T>(orow[r]);
    }
    if (more) {
      dot_end(g + R);
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
                  float scale, const int64_t order[kStep], bool identity, float* dst) {
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
      float block[kStep];
      for (int64_t t = 0; t < Kp; t += kStep) {
        std::copy(d + t, d + t + kStep, block);
        for (int64_t j = 0; j < kStep; ++j) {
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
  const int64_t Kp = round_up(K, kStep);
  const T* qkv = static_cast<const T*>(p.mixed_qkv);
  const int64_t rs = p.qkv_stride_row, cs = p.qkv_stride_col;
  S* state = static_cast<S*>(p.state);
  T* out = static_cast<T*>(p.out);
  constexpr int R = group_rows<S>();
  const int64_t grouped = V / R * R;

  // q and k are kept in the element order the state loads produce (identity unless Io<S>
  // reorders), so that s[t] always meets k[t] and q[t].
  int64_t order[kStep];
  element_order<S>(order);
  bool identity = true;
  for (int64_t j = 0; j < kStep; ++j) {
    identity = identity && order[j] == j;
  }
  const TailMask keep = tail_mask(order, K % kStep);

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
      const int64_t s_idx = p.indices[i * p.indices_stride];
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
      S* st = state + (s_idx * Hv + j) * V * K;
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
// they fit); any other K takes the generic one. Same bits either way (see update_head).
template <typename T, typename S>
void run(const GdnParams& p) {
  switch (p.specialize_k ? p.head_k : 0) {
    case 64:
      return run_k<T, S, 64>(p);
    case 128:
      return run_k<T, S, 128>(p);
    case 256:
      return run_k<T, S, 256>(p);
    default:
      return run_k<T, S, 0>(p);
  }
}

} // namespace
} // namespace CPU_CAPABILITY

template <typename T, typename S>
void CUSTOM_OPS_CONCAT(fused_gdn_decode_kernel_, CPU_CAPABILITY)(const GdnParams& p) {
  CPU_CAPABILITY::run<T, S>(p);
}

#define CUSTOM_OPS_INSTANTIATE(T, S) \
  template void CUSTOM_OPS_CONCAT(fused_gdn_decode_kernel_, CPU_CAPABILITY)<T, S>(const GdnParams&)
CUSTOM_OPS_INSTANTIATE(c10::BFloat16, float);
CUSTOM_OPS_INSTANTIATE(c10::BFloat16, c10::BFloat16);
CUSTOM_OPS_INSTANTIATE(c10::Half, float);
CUSTOM_OPS_INSTANTIATE(c10::Half, c10::Half);
#undef CUSTOM_OPS_INSTANTIATE

} // namespace custom_ops::cpu
