// The fused CPU kernel body. Included once per instruction set by kernel_<isa>.cpp, each compiled
// with its own CPU_CAPABILITY (see setup.py), so at::vec resolves to that ISA's Vectorized<>.
//
// Memory-bound: the state is B*Hv*V*K elements and each element is loaded once from memory and
// stored once. Per state row (K elements) we make two passes that both hit L1: the first computes
// u = (exp(g) S) k, the second writes S' = exp(g) S + delta k^T and accumulates out = S' q.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "cpu/kernel.h"

#define CUSTOM_OPS_CONCAT_(a, b) a##b
#define CUSTOM_OPS_CONCAT(a, b) CUSTOM_OPS_CONCAT_(a, b)

namespace custom_ops::cpu {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
constexpr int64_t kF = fVec::size();
// Elements per vector step: two float vectors, or one vector of 16-bit floats.
constexpr int64_t kStep = 2 * kF;
static_assert(Vectorized<c10::BFloat16>::size() == kStep, "16-bit vector must hold 2 float vectors");
static_assert(Vectorized<c10::Half>::size() == kStep, "16-bit vector must hold 2 float vectors");
// Below this many state elements a parallel chunk is not worth a thread.
constexpr int64_t kGrainElements = 1 << 14;
constexpr float kNormEps = 1e-6f;

// Two float vectors from kStep state elements (or the first n < kStep, the rest read as 0), and
// back with round-to-nearest-even.
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
};

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// bf16 state in "lane order": widening a bf16 is a 16-bit shift, so interleaving the words with
// zeros (unpacklo/unpackhi) gives two float vectors in one instruction each, and packus_epi32 of
// the rounded high halves is its exact inverse. The element order inside the two vectors differs
// from memory order (per 128-bit lane: words 0-3 -> lo, 4-7 -> hi); k and q are stored in that
// same order (see element_order), and dot products do not care about order.
#if defined(CPU_CAPABILITY_AVX512)
using iVec = __m512i;
inline iVec lane_load(const void* p) { return _mm512_loadu_si512(p); }
inline iVec lane_load(const void* p, int64_t n) {
  return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p);
}
inline void lane_store(void* p, iVec x) { _mm512_storeu_si512(p, x); }
inline void lane_store(void* p, int64_t n, iVec x) {
  _mm512_mask_storeu_epi16(p, static_cast<__mmask32>((1ull << n) - 1), x);
}
inline iVec i_zero() { return _mm512_setzero_si512(); }
inline iVec i_set1(int32_t v) { return _mm512_set1_epi32(v); }
inline iVec i_unpacklo16(iVec a, iVec b) { return _mm512_unpacklo_epi16(a, b); }
inline iVec i_unpackhi16(iVec a, iVec b) { return _mm512_unpackhi_epi16(a, b); }
inline iVec i_srli(iVec a, int n) { return _mm512_srli_epi32(a, n); }
inline iVec i_and(iVec a, iVec b) { return _mm512_and_si512(a, b); }
inline iVec i_add(iVec a, iVec b) { return _mm512_add_epi32(a, b); }
inline iVec i_packus32(iVec a, iVec b) { return _mm512_packus_epi32(a, b); }
inline fVec as_f(iVec a) { return _mm512_castsi512_ps(a); }
inline iVec as_i(const fVec& a) { return _mm512_castps_si512(a); }
inline iVec keep_nan(iVec rounded, const fVec& x) {
  // NaN must stay NaN: the rounding add above can carry a NaN's mantissa into the sign bit.
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), i_set1(0x7fc0));
}
#else
using iVec = __m256i;
inline iVec lane_load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline iVec lane_load(const void* p, int64_t n) {
  alignas(32) uint16_t buf[16] = {0};
  std::memcpy(buf, p, n * sizeof(uint16_t));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
}
inline void lane_store(void* p, iVec x) { _mm256_storeu_si256(static_cast<__m256i*>(p), x); }
inline void lane_store(void* p, int64_t n, iVec x) {
  alignas(32) uint16_t buf[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf), x);
  std::memcpy(p, buf, n * sizeof(uint16_t));
}
inline iVec i_zero() { return _mm256_setzero_si256(); }
inline iVec i_set1(int32_t v) { return _mm256_set1_epi32(v); }
inline iVec i_unpacklo16(iVec a, iVec b) { return _mm256_unpacklo_epi16(a, b); }
inline iVec i_unpackhi16(iVec a, iVec b) { return _mm256_unpackhi_epi16(a, b); }
inline iVec i_srli(iVec a, int n) { return _mm256_srli_epi32(a, n); }
inline iVec i_and(iVec a, iVec b) { return _mm256_and_si256(a, b); }
inline iVec i_add(iVec a, iVec b) { return _mm256_add_epi32(a, b); }
inline iVec i_packus32(iVec a, iVec b) { return _mm256_packus_epi32(a, b); }
inline fVec as_f(iVec a) { return _mm256_castsi256_ps(a); }
inline iVec as_i(const fVec& a) { return _mm256_castps_si256(a); }
inline iVec keep_nan(iVec rounded, const fVec& x) {
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(rounded, i_set1(0x7fc0), _mm256_castps_si256(nan));
}
#endif

// Round-to-nearest-even of fp32 to bf16, result in the low 16 bits of each 32-bit lane.
inline iVec round_bf16(const fVec& x) {
  const iVec bits = as_i(x);
  const iVec lsb = i_and(i_srli(bits, 16), i_set1(1));
  return keep_nan(i_srli(i_add(i_add(bits, i_set1(0x7fff)), lsb), 16), x);
}

template <>
struct Io<c10::BFloat16> {
  using S = c10::BFloat16;
  static inline void widen(iVec x, fVec& lo, fVec& hi) {
    lo = as_f(i_unpacklo16(i_zero(), x));
    hi = as_f(i_unpackhi16(i_zero(), x));
  }
  static inline iVec narrow(const fVec& lo, const fVec& hi) {
    return i_packus32(round_bf16(lo), round_bf16(hi));
  }
  static inline void load(const S* p, fVec& lo, fVec& hi) { widen(lane_load(p), lo, hi); }
  static inline void load(const S* p, int64_t n, fVec& lo, fVec& hi) {
    widen(lane_load(p, n), lo, hi);
  }
  static inline void store(S* p, const fVec& lo, const fVec& hi) { lane_store(p, narrow(lo, hi)); }
  static inline void store(S* p, int64_t n, const fVec& lo, const fVec& hi) {
    lane_store(p, n, narrow(lo, hi));
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

inline float hsum(const fVec& v) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  return at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, v);
#else
  float lanes[kF];
  v.store(lanes);
  float sum = 0.f;
  for (int64_t l = 0; l < kF; ++l) {
    sum += lanes[l];
  }
  return sum;
#endif
}

// out[r] = horizontal sum of v[r], r < R. For R = 4 on AVX2/AVX-512 the four sums are formed
// together (a transpose-and-add tree): about a third of the shuffles and adds of four separate
// reductions, which matter next to the few FMAs per row.
template <int R>
inline void hsum_rows(const fVec* v, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (R == 4) {
    // Per 128-bit lane: ab = [a0+a2, b0+b2, a1+a3, b1+b3], likewise cd; then [a, b, c, d].
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
    __m512 t = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    // Add the four 128-bit lanes.
    t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, _MM_SHUFFLE(1, 0, 3, 2)));
    t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, _MM_SHUFFLE(2, 3, 0, 1)));
    _mm_storeu_ps(out, _mm512_castps512_ps128(t));
    return;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (R == 4) {
    const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1]));
    const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3]));
    const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
    return;
  }
#endif
  for (int r = 0; r < R; ++r) {
    out[r] = hsum(v[r]);
  }
}

inline int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

// How far ahead (in state rows) pass one prefetches.
constexpr int64_t kPrefetchRows = 8;

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

// R consecutive state rows s[r*K ...] of one value head: decay, delta-rule update, read-out.
// Writes out[r] = s'_r . q. k and q are the normalised fp32 key/query of the head's key head,
// zero-padded to a multiple of kStep, so the last partial step needs no scalar tail (the padded
// lanes add exact zeros). Rows are interleaved so that their dependency chains (dot, horizontal
// sum, delta, update, dot, horizontal sum) overlap; one row alone is latency-bound.
template <typename S, int R>
inline void update_rows(S* s, int64_t K, const float* k, const float* q, float decay, float beta,
                        const float* v, float* out, const TailMask& keep) {
  const int64_t full = K / kStep * kStep;
  const int64_t tail = K - full;
  fVec s0, s1;

  // Scalar math: u[r] = decay * sum_t s[r][t] * k[t]   (= (exp(g) S) k)
  fVec u0[R], u1[R];
  for (int r = 0; r < R; ++r) {
    u0[r] = fVec(0.f);
    u1[r] = fVec(0.f);
  }
  auto dot_k = [&](int64_t t, int64_t n) {
    const fVec k0 = fVec::loadu(k + t), k1 = fVec::loadu(k + t + kF);
    for (int r = 0; r < R; ++r) {
      if (n == kStep) {
        // Rows of the group two groups ahead: keeps more misses in flight than the hardware
        // prefetcher alone when the state streams from DRAM.
        // (Integer arithmetic: the address may lie past the state; a prefetch never faults.)
        const uintptr_t ahead = reinterpret_cast<uintptr_t>(s) +
                                ((r + kPrefetchRows) * K + t) * sizeof(S);
        __builtin_prefetch(reinterpret_cast<const void*>(ahead), 1, 3);
        if (kStep * sizeof(S) > 64) {
          __builtin_prefetch(reinterpret_cast<const void*>(ahead + 64), 1, 3);
        }
        Io<S>::load(s + r * K + t, s0, s1);
      } else {
        Io<S>::load(s + r * K + t, n, s0, s1);
      }
      u0[r] = at::vec::fmadd(s0, k0, u0[r]);
      u1[r] = at::vec::fmadd(s1, k1, u1[r]);
    }
  };
  for (int64_t t = 0; t < full; t += kStep) {
    dot_k(t, kStep);
  }
  if (tail) {
    dot_k(full, tail);
  }
  fVec vdelta[R];
  float u[R];
  for (int r = 0; r < R; ++r) {
    u0[r] = u0[r] + u1[r];
  }
  hsum_rows<R>(u0, u);
  for (int r = 0; r < R; ++r) {
    vdelta[r] = fVec(beta * (v[r] - decay * u[r]));
  }

  // Scalar math: s[r][t] = decay * s[r][t] + delta[r] * k[t]; o[r] += s[r][t] * q[t]
  const fVec vdecay(decay);
  fVec o0[R], o1[R];
  for (int r = 0; r < R; ++r) {
    o0[r] = fVec(0.f);
    o1[r] = fVec(0.f);
  }
  auto update = [&](int64_t t, int64_t n) {
    const fVec k0 = fVec::loadu(k + t), k1 = fVec::loadu(k + t + kF);
    const fVec q0 = fVec::loadu(q + t), q1 = fVec::loadu(q + t + kF);
    for (int r = 0; r < R; ++r) {
      S* p = s + r * K + t;
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
      if (n == kStep) {
        Io<S>::store(p, s0, s1);
      } else {
        Io<S>::store(p, n, s0, s1);
      }
    }
  };
  for (int64_t t = 0; t < full; t += kStep) {
    update(t, kStep);
  }
  if (tail) {
    update(full, tail);
  }
  for (int r = 0; r < R; ++r) {
    o0[r] = o0[r] + o1[r];
  }
  hsum_rows<R>(o0, out);
}

// Rows interleaved per update_rows call.
constexpr int kRows = 4;

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

template <typename T, typename S>
void run(const GdnParams& p) {
  const int64_t B = p.batch, H = p.num_heads, Hv = p.num_v_heads, K = p.head_k, V = p.head_v;
  const int64_t group = Hv / H;  // value heads per key head
  const int64_t Kp = round_up(K, kStep);
  const T* qkv = static_cast<const T*>(p.mixed_qkv);
  const int64_t rs = p.qkv_stride_row, cs = p.qkv_stride_col;
  S* state = static_cast<S*>(p.state);
  T* out = static_cast<T*>(p.out);

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
    std::unique_ptr<float[]> qk(new float[2 * Kp]);
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
      S* st = state + (s_idx * Hv + j) * V * K;
      const T* v = qkv + i * rs + (2 * H * K + j * V) * cs;
      float vr[kRows], orow[kRows];
      int64_t r = 0;
      for (; r + kRows <= V; r += kRows) {
        for (int l = 0; l < kRows; ++l) {
          vr[l] = static_cast<float>(v[(r + l) * cs]);
        }
        update_rows<S, kRows>(st + r * K, K, k, q, decay, beta, vr, orow, keep);
        for (int l = 0; l < kRows; ++l) {
          o[r + l] = static_cast<T>(orow[l]);
        }
      }
      for (; r < V; ++r) {
        vr[0] = static_cast<float>(v[r * cs]);
        update_rows<S, 1>(st + r * K, K, k, q, decay, beta, vr, orow, keep);
        o[r] = static_cast<T>(orow[0]);
      }
    }
  });
}

} // namespace
} // namespace CPU_CAPABILITY

void CUSTOM_OPS_CONCAT(fused_gdn_decode_kernel_, CPU_CAPABILITY)(const GdnParams& p) {
  using CPU_CAPABILITY::run;
  if (p.input_dtype == DType::kBFloat16) {
    if (p.state_dtype == DType::kFloat32) {
      run<c10::BFloat16, float>(p);
    } else {
      run<c10::BFloat16, c10::BFloat16>(p);
    }
  } else {
    if (p.state_dtype == DType::kFloat32) {
      run<c10::Half, float>(p);
    } else {
      run<c10::Half, c10::Half>(p);
    }
  }
}

} // namespace custom_ops::cpu
