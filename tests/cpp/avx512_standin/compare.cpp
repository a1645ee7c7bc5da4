// The avx512 and avx512bf16 kernel bodies on the AVX-512 stand-ins (standin.h, a test double)
// against the real AVX2 kernel, bit for bit: out and state after three decode steps, for every
// accepted dtype pair, K with and without partial blocks (64 ... 2032), V that leaves rows outside
// AVX-512's groups of four, the K-specialised and generic row kernels, random inputs and inputs
// with NaN, Inf, denormal and near-maximal values. Exit status 0 when all agree.
#include <cstdio>
#include <cstring>
#include <vector>

#include "../small_call.h"

using namespace custom_ops::cpu;
using custom_ops::cpu::testing::SmallCall;

namespace {

long compared = 0, mismatches = 0;

template <typename T, typename S>
void compare(int K, int V, bool specialize, int seed) {
  const SmallCall<T, S> inputs(K, V, seed, seed % 2 == 1);
  auto run = [&](void (*kernel)(const GdnParams&), std::vector<S>& st, std::vector<T>& out) {
    SmallCall<T, S> call = inputs;
    const GdnParams p = call.params(specialize);
    for (int step = 0; step < 3; ++step) kernel(p);
    st = call.state;
    out = call.out;
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
