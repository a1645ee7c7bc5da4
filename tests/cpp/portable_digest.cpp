// One kernel variant's results as a hash per case, for comparing builds on different
// architectures: tests/test_cpu_kernel.py runs it built for x86-64 (portable and avx2) and, where
// a cross compiler and qemu are installed, for AArch64 (portable), and compares the lines. Each
// case is out and state after three decode steps: every accepted dtype pair, K with and without
// partial blocks, V that leaves rows outside groups of four, the K-specialised and generic row
// kernels, random inputs and inputs with NaN, Inf, denormal and near-maximal values. The inputs
// come from integer arithmetic and exact conversions only, so every build starts from the same
// bits whatever its libm. argv[1]: "portable", or "avx2" where built with -DDIGEST_AVX2.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "cpu/kernel.h"

using namespace custom_ops::cpu;

namespace {

// FNV-1a over the bytes.
uint64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// A value in [-scale, scale) from 24 random bits: exact in float.
float uniform(std::mt19937& gen, float scale) {
  const int32_t bits = int32_t(gen() >> 8) - (1 << 23);
  return float(bits) * (scale / float(1 << 23));
}

const char* name_of(const c10::BFloat16*) { return "bf16"; }
const char* name_of(const c10::Half*) { return "fp16"; }
const char* name_of(const float*) { return "fp32"; }

template <typename T, typename S>
void digest(void (*kernel)(const GdnParams&), int K, int V, bool specialize, int seed) {
  const int B = 3, H = 2, Hv = 4, pool = 8, W = 2 * H * K + Hv * V + 3;  // + 3: a row gap
  const long head = long(V) * K, slot = Hv * head;
  std::mt19937 gen(seed);
  std::vector<T> qkv(B * W), a(B * Hv), b(B * Hv), dt_bias(Hv);
  for (auto* v : {&qkv, &a, &b, &dt_bias}) {
    for (T& x : *v) x = T(uniform(gen, 2.f));
  }
  std::vector<float> a_log(Hv);
  for (float& x : a_log) x = uniform(gen, 1.f);
  std::vector<S> state(pool * slot);
  for (S& x : state) x = S(uniform(gen, 1.f));
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
  std::vector<T> out(B * Hv * V, T(0.f));
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
  p.state_stride_slot = Hv * V * K;
  p.indices = indices;
  p.out = out.data();
  p.scale = 1.f / float(1 << 4);  // exact, unlike 1/sqrt(K) from a libm
  p.softplus_threshold = 20.f;
  p.specialize_k = specialize;
  uint64_t h_out = fnv1a(nullptr, 0), h_state = h_out;
  for (int step = 0; step < 3; ++step) {
    kernel(p);
    h_out = fnv1a(out.data(), out.size() * sizeof(T), h_out);
    h_state = fnv1a(state.data(), state.size() * sizeof(S), h_state);
  }
  std::printf("%s/%s K=%d V=%d specialised=%d seed=%d out=%016llx state=%016llx\n",
              name_of(static_cast<T*>(nullptr)), name_of(static_cast<S*>(nullptr)), K, V,
              int(specialize), seed, (unsigned long long)h_out, (unsigned long long)h_state);
}

template <typename T, typename S>
using Kernel = void (*)(const GdnParams&);

template <typename T, typename S>
Kernel<T, S> kernel_named(const char* name) {
  if (std::strcmp(name, "portable") == 0) return fused_gdn_decode_kernel_DEFAULT<T, S>;
#ifdef DIGEST_AVX2
  if (std::strcmp(name, "avx2") == 0) return fused_gdn_decode_kernel_AVX2<T, S>;
#endif
  return nullptr;
}

template <typename T, typename S>
bool digest_all(const char* name) {
  const Kernel<T, S> kernel = kernel_named<T, S>(name);
  if (kernel == nullptr) return false;
  for (int K : {64, 88, 128, 136, 256}) {
    for (int V : {13, 16}) {
      for (bool specialize : {false, true}) {
        for (int seed : {1, 2, 3}) digest<T, S>(kernel, K, V, specialize, seed);
      }
    }
  }
  return true;
}

} // namespace

int main(int argc, char** argv) {
  const char* name = argc > 1 ? argv[1] : "portable";
  if (!digest_all<c10::BFloat16, float>(name)) {
    std::fprintf(stderr, "no variant %s in this build\n", name);
    return 2;
  }
  digest_all<c10::BFloat16, c10::BFloat16>(name);
  digest_all<c10::Half, float>(name);
  digest_all<c10::Half, c10::Half>(name);
  return 0;
}
