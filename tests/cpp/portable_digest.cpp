// One kernel variant's results as a hash per case, for comparing builds by other compilers and
// for other architectures: tests/test_cpu_kernel.py runs it built here (portable and avx2), by
// clang where installed, and for AArch64 (portable) where a cross compiler and qemu are
// installed, and compares the lines. Each
// case is out and state after three decode steps: every accepted dtype pair, K with and without
// partial blocks, V that leaves rows outside groups of four, the K-specialised and generic row
// kernels, random inputs and inputs with NaN, Inf, denormal and near-maximal values (small_call.h,
// whose inputs are the same bits whatever the libm). argv[1]: "portable", or "avx2" where built
// with -DDIGEST_AVX2.
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "small_call.h"

using namespace custom_ops::cpu;
using custom_ops::cpu::testing::SmallCall;

namespace {

// FNV-1a over the bytes.
uint64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

const char* name_of(const c10::BFloat16*) { return "bf16"; }
const char* name_of(const c10::Half*) { return "fp16"; }
const char* name_of(const float*) { return "fp32"; }

template <typename T, typename S>
void digest(void (*kernel)(const GdnParams&), int K, int V, bool specialize, int seed) {
  SmallCall<T, S> call(K, V, seed, seed % 2 == 1);
  const GdnParams p = call.params(specialize);
  uint64_t h_out = fnv1a(nullptr, 0), h_state = h_out;
  for (int step = 0; step < 3; ++step) {
    kernel(p);
    h_out = fnv1a(call.out.data(), call.out.size() * sizeof(T), h_out);
    h_state = fnv1a(call.state.data(), call.state.size() * sizeof(S), h_state);
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
