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

inline int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

// R consecutive state rows s[r*K ...] of one value head: decay, delta-rule update, read-out.
// Writes out[r] = s'_r . q. k and q are the normalised fp32 key/query of the head's key head,
// zero-padded to a multiple of kStep, so the last partial step needs no scalar tail (the padded
// lanes add exact zeros). Rows are interleaved so that their dependency chains (dot, horizontal
// sum, delta, update, dot, horizontal sum) overlap; one row alone is latency-bound.
template <typename S, int R>
inline void update_rows(S* s, int64_t K, const float* k, const float* q, float decay, float beta,
                        const float* v, float* out) {
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
  for (int r = 0; r < R; ++r) {
    const float u = decay * hsum(u0[r] + u1[r]);
    vdelta[r] = fVec(beta * (v[r] - u));
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
        s0 = fVec::set(fVec(0.f), s0, std::min(n, kF));
        s1 = n > kF ? fVec::set(fVec(0.f), s1, n - kF) : fVec(0.f);
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
    out[r] = hsum(o0[r] + o1[r]);
  }
}

// Rows interleaved per update_rows call.
constexpr int kRows = 4;

// Strided scalar views of the small inputs.
template <typename T>
inline float at2(const void* base, int64_t i, int64_t j, int64_t si, int64_t sj) {
  return static_cast<float>(static_cast<const T*>(base)[i * si + j * sj]);
}

template <typename T, typename S>
void run(const GdnParams& p) {
  const int64_t B = p.batch, H = p.num_heads, Hv = p.num_v_heads, K = p.head_k, V = p.head_v;
  const int64_t group = Hv / H;  // value heads per key head
  const T* qkv = static_cast<const T*>(p.mixed_qkv);
  const int64_t rs = p.qkv_stride_row, cs = p.qkv_stride_col;
  auto slot = [&](int64_t i) { return p.indices[i * p.indices_stride]; };

  // q and k of every (valid row, key head), L2-normalised once in fp32 and shared by the
  // `group` value heads that read them. Layout [B][H][q|k][Kp], zero-padded to Kp.
  const int64_t Kp = round_up(K, kStep);
  std::unique_ptr<float[]> qk(new float[B * H * 2 * Kp]);
  at::parallel_for(0, B * H, std::max<int64_t>(1, kGrainElements / K), [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t i = task / H, h = task % H;
      if (slot(i) <= 0) {
        continue;
      }
      for (int64_t which = 0; which < 2; ++which) {  // 0: q, 1: k
        const T* src = qkv + i * rs + (which * H * K + h * K) * cs;
        float* dst = qk.get() + (task * 2 + which) * Kp;
        float sumsq = 0.f;
        for (int64_t t = 0; t < K; ++t) {
          dst[t] = static_cast<float>(src[t * cs]);
          sumsq += dst[t] * dst[t];
        }
        // q <- scale * q / sqrt(sum q^2 + eps); k <- k / sqrt(sum k^2 + eps)
        const float norm = std::sqrt(sumsq + kNormEps);
        const float mul = which == 0 ? p.scale : 1.f;
        for (int64_t t = 0; t < K; ++t) {
          dst[t] = mul * dst[t] / norm;
        }
        std::fill(dst + K, dst + Kp, 0.f);
      }
    }
  });

  S* state = static_cast<S*>(p.state);
  T* out = static_cast<T*>(p.out);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / (V * K));
  // One task per (batch row, value head); each is computed by one thread start to end, so the
  // result is the same whatever the thread count.
  at::parallel_for(0, B * Hv, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t i = task / Hv, j = task % Hv;
      T* o = out + task * V;
      const int64_t s_idx = slot(i);
      if (s_idx <= 0) {
        std::fill(o, o + V, T(0.f));
        continue;
      }
      // Gates. softplus(x) = max(x, log(1 + exp(min(x, threshold))))
      const float x = at2<T>(p.a, i, j, p.a_stride_row, p.a_stride_col) +
                      at2<T>(p.dt_bias, 0, j, 0, p.dt_bias_stride);
      const float sp = std::max(x, std::log(1.f + std::exp(std::min(x, p.softplus_threshold))));
      const float g = -std::exp(p.a_log[j * p.a_log_stride]) * sp;
      const float decay = std::exp(g);
      const float beta =
          1.f / (1.f + std::exp(-at2<T>(p.b, i, j, p.b_stride_row, p.b_stride_col)));

      const float* qk_row = qk.get() + ((i * H + j / group) * 2) * Kp;
      S* st = state + (s_idx * Hv + j) * V * K;
      const T* v = qkv + i * rs + (2 * H * K + j * V) * cs;
      float vr[kRows], orow[kRows];
      int64_t r = 0;
      for (; r + kRows <= V; r += kRows) {
        for (int l = 0; l < kRows; ++l) {
          vr[l] = static_cast<float>(v[(r + l) * cs]);
        }
        update_rows<S, kRows>(st + r * K, K, qk_row + Kp, qk_row, decay, beta, vr, orow);
        for (int l = 0; l < kRows; ++l) {
          o[r + l] = static_cast<T>(orow[l]);
        }
      }
      for (; r < V; ++r) {
        vr[0] = static_cast<float>(v[r * cs]);
        update_rows<S, 1>(st + r * K, K, qk_row + Kp, qk_row, decay, beta, vr, orow);
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
