// One small call of the CPU kernel, for the C++ test programs (avx512_standin/compare.cpp,
// portable_digest.cpp): B = 3 rows (row 2 invalid) on slots 2 and 5 of a pool of 8, H = 2,
// Hv = 4, packed rows 3 elements apart beyond their width. The inputs come from 24-bit integers
// (exact in float), so every build starts from the same bits whatever its architecture and libm;
// with `specials`, NaN, +-Inf, denormal and near-maximal state values, v = 0 (denormal updates),
// an Inf in v and a NaN gate.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include "cpu/kernel.h"

namespace custom_ops::cpu::testing {

template <typename T, typename S>
struct SmallCall {
  static constexpr int B = 3, H = 2, Hv = 4, kPool = 8;
  int K, V, W;
  long head, slot;
  std::vector<T> qkv, a, b, dt_bias, out;
  std::vector<float> a_log;
  std::vector<S> state;
  int32_t indices[B] = {2, 5, 0};

  SmallCall(int K_, int V_, int seed, bool specials)
      : K(K_), V(V_), W(2 * H * K_ + Hv * V_ + 3), head(long(V_) * K_), slot(Hv * head) {
    std::mt19937 gen(seed);
    // A value in [-scale, scale) from 24 random bits.
    auto uniform = [&](float scale) {
      return float(int32_t(gen() >> 8) - (1 << 23)) * (scale / float(1 << 23));
    };
    qkv.resize(B * W);
    a.resize(B * Hv);
    b.resize(B * Hv);
    dt_bias.resize(Hv);
    for (auto* v : {&qkv, &a, &b, &dt_bias}) {
      for (T& x : *v) x = T(uniform(2.f));
    }
    a_log.resize(Hv);
    for (float& x : a_log) x = uniform(1.f);
    state.resize(kPool * slot);
    for (S& x : state) x = S(uniform(1.f));
    out.assign(B * Hv * V, T(0.f));
    if (specials) {
      const float tiny = std::is_same_v<S, c10::Half> ? 3e-7f : 1e-39f;  // a denormal of S
      const float big = std::is_same_v<S, c10::Half> ? 30000.f : 1e38f;
      state[2 * slot + 1 * head + 3] = S(NAN);
      state[2 * slot + 2 * head + 5 * K + 1] = S(INFINITY);
      state[5 * slot + 3 * head + 2 * K + K - 1] = S(-INFINITY);
      for (long t = 0; t < head; ++t) state[5 * slot + t] = S(tiny);
      for (int t = 0; t < K; ++t) state[2 * slot + 3 * head + 4 * K + t] = S(big);
      for (int t = 0; t < V; ++t) qkv[1 * W + 2 * H * K + t] = T(0.f);
      qkv[2 * H * K + 2 * V + 5 % V] = T(INFINITY);
      a[1 * Hv + 1] = T(NAN);
    }
  }

  // The call's parameters, pointing into this object.
  GdnParams params(bool specialize_k) {
    GdnParams p{};
    p.batch = B;
    p.num_heads = H;
    p.num_v_heads = Hv;
    p.head_k = K;
    p.head_v = V;
    p.mixed_qkv = qkv.data();
    p.qkv_stride_row = W;
    p.qkv_stride_col = 1;
    p.a = a.data();
    p.a_stride_row = Hv;
    p.a_stride_col = 1;
    p.b = b.data();
    p.b_stride_row = Hv;
    p.b_stride_col = 1;
    p.a_log = a_log.data();
    p.a_log_stride = 1;
    p.dt_bias = dt_bias.data();
    p.dt_bias_stride = 1;
    p.state = state.data();
    p.state_stride_slot = slot;
    p.indices = indices;
    p.out = out.data();
    p.scale = 1.f / float(1 << 4);  // exact, unlike 1/sqrt(K) from a libm
    p.softplus_threshold = 20.f;
    p.specialize_k = specialize_k;
    return p;
  }
};

} // namespace custom_ops::cpu::testing
