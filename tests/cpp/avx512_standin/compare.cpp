// The avx512 and avx512bf16 kernel bodies on the AVX-512 stand-ins (standin.h, a test double)
// against the real AVX2 kernel, bit for bit: out and state after three decode steps, for every
// accepted dtype pair, K with and without partial blocks (64 ... 2032), V that leaves rows outside
// AVX-512's groups of four, the K-specialised and generic row kernels, random inputs and inputs
// with NaN, Inf, denormal and near-maximal values. Exit status 0 when all agree.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "cpu/kernel.h"

using namespace custom_ops::cpu;

namespace {

long compared = 0, mismatches = 0;

template <typename T, typename S>
void compare(int K, int V, bool specialize, int seed) {
  const int B = 3, H = 2, Hv = 4, pool = 8, W = 2 * H * K + Hv * V;
  const long head = long(V) * K, slot = Hv * head;
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<T> qkv(B * W), a(B * Hv), b(B * Hv), dt_bias(Hv);
  for (auto* v : {&qkv, &a, &b, &dt_bias}) {
    for (T& x : *v) x = T(normal(gen));
  }
  std::vector<float> a_log(Hv);
  for (float& x : a_log) x = 0.5f * normal(gen);
  std::vector<S> state(pool * slot);
  for (S& x : state) x = S(0.5f * normal(gen));
  int32_t indices[3] = {2, 5, 0};  // row 2 invalid
  if (seed % 2) {
    const float tiny = std::is_same_v<S, c10::Half> ? 3e-7f : 1e-39f;  // a denormal of S
    const float big = std::is_same_v<S, c10::Half> ? 30000.f : 1e38f;
    state[2 * slot + 1 * head + 3] = S(NAN);
    state[2 * slot + 2 * head + 5 * K + 1] = S(INFINITY);
    state[5 * slot + 3 * head + 2 * K + K - 1] = S(-INFINITY);
    for (long t = 0; t < head; ++t) state[5 * slot + t] = S(tiny);
    for (int t = 0; t < K; ++t) state[2 * slot + 3 * head + 4 * K + t] = S(big);
    for (int t = 0; t < V; ++t) qkv[1 * W + 2 * H * K + t] = T(0.f);  // v = 0: denormal updates
    qkv[2 * H * K + 2 * V + 5 % V] = T(INFINITY);
    a[1 * Hv + 1] = T(NAN);
  }
  auto run = [&](void (*kernel)(const GdnParams&), std::vector<S>& st, std::vector<T>& out) {
    st = state;
    out.assign(B * Hv * V, T(0.f));
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
    p.state = st.data();
    p.state_stride_slot = Hv * V * K;
    p.indices = indices;
    p.out = out.data();
    p.scale = 1.f / std::sqrt(float(K));
    p.softplus_threshold = 20.f;
    p.specialize_k = specialize;
    for (int step = 0; step < 3; ++step) kernel(p);
  };
  std::vector<S> st_avx2, st_other;
  std::vector<T> out_avx2, out_other;
  run(fused_gdn_decode_kernel_AVX2<T, S>, st_avx2, out_avx2);
  const struct {
    const char* name;
    void (*kernel)(const GdnParams&);
  } variants[] = {{"avx512", fused_gdn_decode_kernel_AVX512<T, S>},
                  {"avx512bf16", fused_gdn_decode_kernel_AVX512BF16<T, S>}};
  for (const auto& variant : variants) {
    run(variant.kernel, st_other, out_other);
    const bool same_state =
        std::memcmp(st_avx2.data(), st_other.data(), st_avx2.size() * sizeof(S)) == 0;
    const bool same_out =
        std::memcmp(out_avx2.data(), out_other.data(), out_avx2.size() * sizeof(T)) == 0;
    compared += 2;
    if (!same_state || !same_out) {
      mismatches += !same_state + !same_out;
      if (mismatches < 20) {
        std::printf("%s differs from avx2 (%s%s): K=%d V=%d specialised=%d seed=%d state %zu B, "
                    "input %zu B\n",
                    variant.name, same_state ? "" : "state ", same_out ? "" : "out", K, V,
                    int(specialize), seed, sizeof(S), sizeof(T));
      }
    }
  }
}

} // namespace

int main() {
  for (int K : {64, 88, 96, 128, 136, 256, 2032}) {
    for (int V : {13, 16, 128}) {
      for (bool specialize : {false, true}) {
        for (int seed : {1, 2, 3, 4}) {
          compare<c10::BFloat16, float>(K, V, specialize, seed);
          compare<c10::BFloat16, c10::BFloat16>(K, V, specialize, seed);
          compare<c10::Half, float>(K, V, specialize, seed);
          compare<c10::Half, c10::Half>(K, V, specialize, seed);
        }
      }
    }
  }
  std::printf("%ld comparisons with avx2, %ld differ\n", compared, mismatches);
  return mismatches == 0 ? 0 : 1;
}
